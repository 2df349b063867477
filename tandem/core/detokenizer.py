"""Incremental detokenization: UTF-8 safe streaming, stop strings across tokens.

Per token the work is O(len(new text) + longest stop string), never O(text):
`tokenizers.decoders.DecodeStream` decodes only a short window of ids, the stop
search only looks at the new text plus the (longest stop - 1) characters before
it, and the not-yet-emitted text is kept apart from the rest so `take_delta`
never slices the whole output.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

# tokenizers raises this when a window's decode does not extend the previous
# one (non-monotonic output around invalid UTF-8); vLLM recovers by restarting
# the stream, and so do we.
_INVALID_PREFIX = "Invalid prefix encountered"
# Prompt context for the stream: enough ids that the first output token decodes
# as a continuation (leading-space handling), cut where it decodes cleanly.
_MIN_CONTEXT, _MAX_CONTEXT = 4, 24


class IncrementalDetokenizer:
    """One request's output text, built token by token.

    The engine calls `add_token` for each new output token (a non-None result
    means a stop string matched: finish the request), and `take_delta` to get
    the text to stream. `min_tokens` follows vLLM: stop strings are only
    checked once more than `min_tokens` tokens were added.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
        prompt_token_ids: Sequence[int] = (),
        min_tokens: int = 0,
    ) -> None:
        if isinstance(stop, str):
            stop = [stop]
        if any(not s for s in stop):
            raise ValueError("stop strings must not be empty.")
        self._tokenizer = tokenizer
        self._stop = list(stop)
        self._include_stop = include_stop_str_in_output
        self._skip_special = skip_special_tokens
        self._min_tokens = min_tokens
        self._max_stop = max((len(s) for s in self._stop), default=0)
        # Text that might still turn out to start a stop string is held back; with
        # include_stop_str_in_output it is output either way (as vLLM does).
        self._holdback = self._max_stop - 1 if self._stop and not self._include_stop else 0
        self._context = self._prompt_context(prompt_token_ids)
        self._stream = self._new_stream(self._context)
        self._parts: list[str] = []  # the text, in pieces (joined lazily)
        self._len = 0
        self._tail = ""  # last (longest stop - 1) characters, for the stop search
        self._unsent = ""  # text[emitted:]
        self._ids: list[int] = []
        self._pending = 0  # trailing ids the stream has not turned into text yet
        self._num_tokens = 0
        self.stop_reason: str | None = None  # the stop string that ended the text
        self._flushed = False

    @property
    def text(self) -> str:
        """All output text so far (after stop-string truncation)."""
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    def add_token(self, token_id: int) -> str | None:
        """Decode one more token; return the stop string now in the text, if any.

        After a stop string matched the text is final and further tokens are
        ignored (the engine finishes the request).
        """
        if self.stop_reason is not None:
            return None
        self._num_tokens += 1
        self._ids.append(token_id)
        chunk = self._step(token_id)
        if chunk is None:
            self._pending += 1
            return None
        self._pending = 0
        return self._append(chunk)

    def take_delta(self, finished: bool) -> str:
        """The text not returned yet.

        Unfinished, it keeps back the last (longest stop - 1) characters, which
        could be the start of a stop string. Finished, it releases everything but
        the half character the text may end in (max_tokens cut a character's
        bytes): `Tokenizer.decode` ends such text in U+FFFD, a glyph no reader
        wants; vLLM's and Ollama's streams never send it either.
        """
        if finished and self._pending and self.stop_reason is None and not self._flushed:
            self._flushed = True
            tail = self._flush_pending()
            self._append(tail[:-1] if tail.endswith("\ufffd") else tail)
        if finished:
            delta, self._unsent = self._unsent, ""
            return delta
        keep = len(self._unsent) - self._holdback
        if keep <= 0:
            return ""
        delta, self._unsent = self._unsent[:keep], self._unsent[keep:]
        return delta

    # -- internals ---------------------------------------------------------

    def _append(self, chunk: str) -> str | None:
        """Add decoded text, then search the region where a new match can be."""
        if not chunk:
            return None
        self._parts.append(chunk)
        self._len += len(chunk)
        self._unsent += chunk
        window = self._tail + chunk
        tail_len = len(self._tail)
        if self._max_stop > 1:
            self._tail = window[-(self._max_stop - 1) :]
        if not self._stop or self._num_tokens <= self._min_tokens:
            return None
        best = -1
        best_stop = None
        for s in self._stop:
            # A new match must end inside the new chunk.
            pos = window.find(s, max(0, tail_len - len(s) + 1))
            if pos != -1 and (best == -1 or pos < best):
                best, best_stop = pos, s
        if best_stop is None:
            return None
        end = best + (len(best_stop) if self._include_stop else 0)
        self._truncate(len(window) - end)
        self.stop_reason = best_stop
        return best_stop

    def _truncate(self, n: int) -> None:
        """Drop the last n characters (never already emitted: see the hold-back)."""
        if n <= 0:
            return
        text = self.text[: self._len - n]
        self._parts = [text]
        self._len = len(text)
        self._unsent = self._unsent[: len(self._unsent) - n]
        self._tail = text[-(self._max_stop - 1) :] if self._max_stop > 1 else ""

    def _step(self, token_id: int) -> str | None:
        try:
            return self._stream.step(self._tokenizer, token_id)
        except Exception as e:  # tokenizers raises a bare Exception here
            if _INVALID_PREFIX not in str(e):
                raise
            # Restart from this token alone; its text may lose a leading space.
            self._stream = self._new_stream([])
            return self._stream.step(self._tokenizer, token_id)

    def _flush_pending(self) -> str:
        """Text of the trailing ids the stream still holds (it ends in U+FFFD: the
        bytes of an unfinished character, or invalid ones)."""
        ids = self._ids[-self._pending :]
        ctx = (self._context + self._ids[: -self._pending])[-_MIN_CONTEXT:]
        dec = self._tokenizer.decode
        full = dec(ctx + ids, skip_special_tokens=self._skip_special)
        base = dec(ctx, skip_special_tokens=self._skip_special)
        if full.startswith(base):
            return full[len(base) :]
        return dec(ids, skip_special_tokens=self._skip_special)

    def _prompt_context(self, prompt_token_ids: Sequence[int]) -> list[int]:
        """The shortest prompt suffix (>= 4 ids) that decodes without U+FFFD.

        Starting the stream mid-character would make its first output start
        with a replacement character; starting it with no context would decode
        the first output token as if it began the text (some decoders then drop
        its leading space).
        """
        ids = list(prompt_token_ids[-_MAX_CONTEXT:])
        if len(ids) <= _MIN_CONTEXT:
            return ids
        for n in range(_MIN_CONTEXT, len(ids) + 1):
            suffix = ids[-n:]
            text = self._tokenizer.decode(suffix, skip_special_tokens=self._skip_special)
            if "\ufffd" not in text:
                return suffix
        return []

    def _new_stream(self, context: list[int]) -> DecodeStream:
        if not context:
            return DecodeStream(skip_special_tokens=self._skip_special)
        try:
            return DecodeStream(context, skip_special_tokens=self._skip_special)
        except TypeError:  # tokenizers < 0.22: no ids argument; prime by stepping
            stream = DecodeStream(skip_special_tokens=self._skip_special)
            for t in context:
                stream.step(self._tokenizer, t)
            return stream
