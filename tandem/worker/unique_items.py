"""``uniqueItems`` on a top-level JSON array, enforced at mask time.

llguidance compiles ``uniqueItems`` as a warning ("Unimplemented keys") and lets
an item repeat: a small model under ``tool_choice: "required"`` with parallel
calls wrote the same call three times. A context-free grammar cannot say "not
equal to an earlier item", so the matcher's mask is narrowed here instead.

Items are compared by their text. The grammar fixes the separators and the
whitespace (``JSON_OPTIONS``) and writes properties in the schema's order, so
two identical values are written identically.

While the item being written is a prefix of an earlier one (or none is begun
yet), a token is banned if it completes a copy of an earlier item, or leads
to a state from which every continuation the grammar allows completes one
(an enum of two units after both were used: the last free choice is the one to
steer). That look-ahead walks the matcher (consume, mask, rollback) only
along earlier items' texts, memoized by the output's text; any state where a
token leaves every earlier item behind is safe, since the grammar can always
finish an item from there. A ban never empties a mask: where every token
completes a copy, the grammar itself asks for one and the mask is left alone.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# Above this many allowed tokens a state is not enumerated: the tokens that
# follow earlier items are looked up instead, and any other allowed one is safe.
ENUMERATE_MAX = 256
_GAP = frozenset(b" \t\n\r,")


def wants_unique_items(schema: Any) -> bool:
    """Whether ``schema`` is an array whose items must all differ."""
    return isinstance(schema, dict) and schema.get("type") == "array" \
        and schema.get("uniqueItems") is True


@dataclass
class ItemScanner:
    """The top-level array's items as text, from the output's bytes.

    ``items``: the finished items; ``cur``: the one being written (empty between
    items); ``closed``: the array has ended. Strings are tracked so that brackets
    inside them do not count."""

    depth: int = 0
    in_str: bool = False
    esc: bool = False
    closed: bool = False
    items: list[bytes] = field(default_factory=list)
    cur: bytearray = field(default_factory=bytearray)

    def copy(self) -> ItemScanner:
        return ItemScanner(self.depth, self.in_str, self.esc, self.closed, list(self.items),
                           bytearray(self.cur))

    def feed(self, data: bytes) -> bool:
        """Advance by ``data``; False as soon as an item repeats an earlier one."""
        for c in data:
            if self.closed:
                return True
            if self.in_str:
                if self.depth >= 1:
                    self.cur.append(c)
                if self.esc:
                    self.esc = False
                elif c == 0x5C:  # backslash
                    self.esc = True
                elif c == 0x22:  # closing quote
                    self.in_str = False
                    if self.depth == 1 and not self._finish():
                        return False
                continue
            if self.depth == 0:
                if c == 0x5B:  # the array opens
                    self.depth = 1
                continue
            if self.depth == 1 and (c in _GAP or c == 0x5D):
                if self.cur and not self._finish():  # a scalar ends at its separator
                    return False
                if c == 0x5D:
                    self.closed = True
                continue
            self.cur.append(c)
            if c == 0x22:
                self.in_str = True
            elif c in b"[{":
                self.depth += 1
            elif c in b"]}":
                self.depth -= 1
                if self.depth == 1 and not self._finish():
                    return False
        return True

    def _finish(self) -> bool:
        item = bytes(self.cur)
        self.cur.clear()
        if item in self.items:
            return False
        self.items.append(item)
        return True

    def on_track(self) -> list[bytes]:
        """The earlier items the current one may still become a copy of."""
        if self.closed or self.depth == 0:
            return []
        return [e for e in self.items if e.startswith(self.cur)]


class Vocabulary:
    """Every token's bytes, indexed for the look-ups along earlier items' texts."""

    def __init__(self, token_bytes: list[bytes], eos_ids: list[int]) -> None:
        self.token_bytes = token_bytes
        self.eos = frozenset(eos_ids)
        self.by_bytes: dict[bytes, list[int]] = {}
        for i, b in enumerate(token_bytes):
            if b and i not in self.eos:
                self.by_bytes.setdefault(b, []).append(i)
        self.sorted = sorted(self.by_bytes)
        self.max_len = max(map(len, self.sorted), default=0)

    def following(self, rest: bytes) -> set[int]:
        """Tokens whose bytes are a prefix of ``rest`` or start with it."""
        out: set[int] = set()
        for n in range(1, min(len(rest), self.max_len) + 1):
            out.update(self.by_bytes.get(rest[:n], ()))
        lo = bisect.bisect_left(self.sorted, rest)
        for b in self.sorted[lo:]:
            if not b.startswith(rest):
                break
            out.update(self.by_bytes[b])
        return out


def _allowed(mask: np.ndarray) -> np.ndarray:
    """Token ids a packed bitmask row (int32 words, little-endian bits) allows."""
    return np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little"))


def _popcount(mask: np.ndarray) -> int:
    return int(np.unpackbits(mask.view(np.uint8)).sum())


class UniqueItems:
    """One request's tracker: the scanner, fed the output, and the memo of the
    look-ahead (keyed by the output's text, so it holds across steps)."""

    __slots__ = ("scanner", "vocab", "text", "_safe")

    def __init__(self, vocab: Vocabulary) -> None:
        self.scanner = ItemScanner()
        self.vocab = vocab
        self.text = bytearray()
        self._safe: dict[bytes, bool] = {}

    def accept(self, token_id: int) -> None:
        data = self.vocab.token_bytes[token_id]
        n = len(self.scanner.items)
        self.scanner.feed(data)
        self.text += data
        if len(self.scanner.items) != n:  # the memo's states all lie behind
            self._safe.clear()

    def narrow(self, matcher, mask: np.ndarray) -> None:
        """Clear in ``mask`` (the row llguidance just filled for ``matcher``) the tokens
        that complete a copy of an earlier item or lead to a state that must."""
        if not self.scanner.on_track():
            return
        text = bytes(self.text)
        banned = [t for t in self._candidates(self.scanner, mask)
                  if not self._token_ok(self.scanner, text, matcher, t)]
        if not banned or len(banned) >= _popcount(mask):
            return
        words = mask.view(np.uint32)
        for t in banned:
            words[t // 32] &= np.uint32(~(1 << (t % 32)) & 0xFFFFFFFF)

    def _candidates(self, scanner: ItemScanner, mask: np.ndarray) -> list[int]:
        """The allowed tokens that keep the item on an earlier one's track (all allowed
        tokens, where few are)."""
        if _popcount(mask) <= ENUMERATE_MAX:
            return [int(t) for t in _allowed(mask)]
        out: set[int] = set()
        for e in scanner.on_track():
            out |= self.vocab.following(e[len(scanner.cur):])
        return [t for t in out if mask[t // 32] >> (t % 32) & 1]

    def _token_ok(self, scanner: ItemScanner, text: bytes, matcher, t: int) -> bool:
        """Whether taking ``t`` after ``text`` leaves a way on without a copy."""
        if t in self.vocab.eos:
            return True
        data = self.vocab.token_bytes[t]
        after = scanner.copy()
        if not after.feed(data):
            return False
        if after.closed or not after.on_track() and after.cur:
            return True
        return self._state_safe(after, text + data, matcher, t)

    def _state_safe(self, scanner: ItemScanner, text: bytes, matcher, t: int) -> bool:
        """After consuming ``t`` on ``matcher``: some allowed token avoids a copy."""
        if text in self._safe:
            return self._safe[text]
        # Checked first: a refused consume would leave the request's own matcher in error.
        if not matcher.validate_tokens([t]):
            self._safe[text] = False
            return False
        self._safe[text] = True  # a cycle (whitespace) is not a dead end
        matcher.consume_token(t)
        try:
            if matcher.is_stopped():
                return True
            mask = np.frombuffer(matcher.compute_bitmask(), dtype=np.int32).copy()
            count = _popcount(mask)
            cands = self._candidates(scanner, mask)
            if count > len(cands):  # an allowed token off every earlier item's track
                return True
            ok = any(self._token_ok(scanner, text, matcher, c) for c in cands)
            self._safe[text] = ok
            return ok
        finally:
            matcher.rollback(1)
