"""Log probabilities as the APIs write them, from the engine's per-token dicts.

One reading of a RequestOutput's ``new_logprobs`` for every API: OpenAI's
completions (parallel lists), chat completions and the Responses API
(``{token, logprob, bytes, top_logprobs}`` per token), and Ollama's.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from tandem.entrypoints.server.errors import bad_request
from tandem.outputs import RequestOutput
from tandem.sampling_params import MAX_LOGPROBS
from tandem.tokenizer import Tokenizer

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

    def text(self, tid: int) -> str:
        if self.tok is None:
            return f"token_id:{tid}"
        return self.tok.decode([tid], skip_special_tokens=False)

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
