"""Log probabilities as the APIs write them, from the engine's per-token dicts.

One reading of a RequestOutput's ``new_logprobs`` for every API: OpenAI's
completions (parallel lists), chat completions and the Responses API
(``{token, logprob, bytes, top_logprobs}`` per token), and Ollama's.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from functools import cached_property

from tokenizers.decoders import DecodeStream

from tandem.entrypoints.server.errors import bad_request
from tandem.outputs import RequestOutput
from tandem.sampling_params import MAX_LOGPROBS
from tandem.tokenizer import Tokenizer

_CONTEXT = 8  # prompt ids an output decode starts after
NEG = -9999.0  # vLLM's stand-in for -inf: JSON has no infinities

Entry = tuple[int, float, list[tuple[int, float]]]  # (token id, logprob, its top k)


def check_top(k: int | None, param: str) -> None:
    """A 400 naming ``param`` unless ``k`` alternatives per token is within OpenAI's bound."""
    if k is not None and not 0 <= k <= MAX_LOGPROBS:
        raise bad_request(f"{param} must be between 0 and {MAX_LOGPROBS}, got {k}", param)


class TokenNames:
    """A token's text and bytes as the APIs show them (vLLM's ``token_id:N`` without a
    tokenizer)."""

    def __init__(self, tok: Tokenizer | None) -> None:
        self.tok = tok
        self._names: dict[int, str] = {}

    def text(self, tid: int) -> str:
        if self.tok is None:
            return f"token_id:{tid}"
        return self.tok.decode([tid], skip_special_tokens=False)

    def name(self, tid: int) -> str:
        """A token's key in the completions API's logprobs: its text as it reads after
        other text (a SentencePiece word-start keeps its space: alone it decodes
        without, and two tokens shared a key), or OpenAI's ``bytes:\\xNN`` spelling
        for a part of a character (alone, every such part decodes to U+FFFD)."""
        if self.tok is None:
            return self.text(tid)
        name = self._names.get(tid)
        if name is None:
            dec = self.tok.decode
            name = dec([self._anchor, tid], skip_special_tokens=False)[len(self._anchor_text):]
            if "\ufffd" in name:
                name = "bytes:" + "".join(f"\\x{b:02x}" for b in self.tok.token_bytes(tid))
            self._names[tid] = name
        return name

    @cached_property
    def _anchor(self) -> int:
        """A token that ends a word, decoded before each named one (see ``name``)."""
        return self.tok.encode("a")[-1]

    @cached_property
    def _anchor_text(self) -> str:
        return self.tok.decode([self._anchor], skip_special_tokens=False)

    def bytes(self, tid: int, text: str) -> list[int]:
        """OpenAI's ``bytes`` of the token whose ``text`` this is: its own, so the parts
        of a character that several tokens share join up (its text alone is U+FFFD)."""
        if self.tok is None:
            return list(text.encode())
        return list(self.tok.token_bytes(tid, text))


def finite(x: float | None) -> float:
    return x if x is not None and math.isfinite(x) else NEG


def _entry(tid: int, lps: dict[int, float], k: int, with_sampled: bool) -> Entry:
    top = sorted(lps.items(), key=lambda kv: -kv[1])[:k]
    if with_sampled and all(t != tid for t, _ in top):
        top.append((tid, lps.get(tid, NEG)))
    return tid, finite(lps.get(tid)), [(t, finite(lp)) for t, lp in top]


def entries(outs: Iterable[RequestOutput], k: int, with_sampled: bool = False) -> list[Entry]:
    """(token, logprob, top k) per new token of ``outs``; ``with_sampled``: the sampled
    token joins its top k when it is not among them (the completions API's up to
    logprobs + 1 entries)."""
    return [_entry(tid, lps, k, with_sampled) for out in outs
            for tid, lps in zip(out.new_token_ids, out.new_logprobs or [])]


def prompt_entries(out: RequestOutput, k: int) -> list[Entry]:
    """The prompt's tokens after the first, as ``entries`` gives the sampled ones (the
    completions API's echo with logprobs); ``out`` carries its prompt_logprobs."""
    return [_entry(tid, lps, k, True)
            for tid, lps in zip(out.prompt_token_ids[1:], (out.prompt_logprobs or [])[1:])]


def token_logprobs(outs: Iterable[RequestOutput], k: int, names: TokenNames) -> list[dict]:
    """Chat completions' ``logprobs.content`` and the Responses API's ``logprobs``."""
    def one(tid: int, lp: float) -> dict:
        text = names.text(tid)
        return {"token": text, "logprob": lp, "bytes": names.bytes(tid, text)}

    return [{**one(t, lp), "top_logprobs": [one(u, v) for u, v in top]}
            for t, lp, top in entries(outs, k)]


class TextOffsets:
    """Where each token of a completion's logprobs begins in the choice's text (the
    completions API's ``text_offset``): the echoed prompt's tokens walked along the
    echo, the output's along their own decode after the prompt's last tokens, as the
    reply's text is made. A part of a character begins where the character does; a
    token the echo does not hold (a BOS the tokenizer added) adds nothing."""

    def __init__(self, tok: Tokenizer | None, prompt_ids: list[int], echo: str,
                 walk_prompt: bool, skip_special_tokens: bool) -> None:
        self.pos = 0 if walk_prompt else len(echo)
        self._echo = echo
        self._in_prompt = walk_prompt
        self._tok = tok
        self._prompt = self._output = None
        if tok is not None:
            if walk_prompt:
                self._prompt = DecodeStream(skip_special_tokens=False)
            self._output = DecodeStream(skip_special_tokens=skip_special_tokens)
            for t in prompt_ids[-_CONTEXT:]:  # a word start after them keeps its space
                self._step(self._output, t)

    def prompt_token(self, tid: int, name: str) -> int:
        at = self.pos
        piece = self._piece(self._prompt, tid, name)
        if self._echo.startswith(piece, at):
            self.pos += len(piece)
        elif at == 0 and self._echo.startswith(piece.lstrip(" ")):  # the text's first word
            self.pos += len(piece.lstrip(" "))
        return at

    def output_token(self, tid: int, name: str) -> int:
        if self._in_prompt:  # the echo ends here, whatever its tokens added up to
            self.pos, self._in_prompt = len(self._echo), False
        at = self.pos
        self.pos += len(self._piece(self._output, tid, name))
        return at

    def _piece(self, stream: DecodeStream | None, tid: int, name: str) -> str:
        """The text the token adds (none for a part of a character: its last part adds
        the character); without a tokenizer, its name."""
        return name if stream is None else self._step(stream, tid)

    def _step(self, stream: DecodeStream, tid: int) -> str:
        try:
            return stream.step(self._tok.backend, tid) or ""
        except Exception:  # tokenizers' "Invalid prefix" around invalid UTF-8: no offset move
            return ""
