"""Per-request sampling parameters (vLLM's names, defaults and valid ranges).

Validation happens here, at the edge, so the sampler and the engine can trust
every field: a bad value is a ValueError with a message naming the field (the
HTTP layer turns it into a 400), never an assert deep inside a step.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any

# vLLM's threshold: below it, temperature means greedy (argmax) decoding.
_SAMPLING_EPS = 1e-5
# Top logprobs a token may ask for besides the sampled one: OpenAI's bound on
# top_logprobs and vLLM's default max_logprobs.
MAX_LOGPROBS = 20
# A float32's smallest normal and largest values: the sampler divides logits by
# the repetition penalty in float32, where 1e-300 is 0 (every logit inf).
_FP32_TINY, _FP32_MAX = 1.1754944e-38, 3.4028235e38
# A reasoning model's think block (Qwen3, QwQ, DeepSeek-R1): a grammar waits for its end.
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
REASONING_STARTS = ("inside", "may_open")


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``tag``: a tag
    split across tokens, held back (or watched for) until the next token says."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def checked_params(params: object) -> SamplingParams:
    """``params`` if it is a SamplingParams (None: the defaults); a ValueError if not
    (a dict of fields was read attribute by attribute, deep in the engine)."""
    if params is None:
        return SamplingParams()
    if not isinstance(params, SamplingParams):
        raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
    return params


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class StructuredOutputsParams:
    """A constraint on the output (vLLM's names): exactly one of JSON matching a
    schema, any JSON object, a regex, one of a list of choices, or a grammar
    (Lark/EBNF as the grammar backend accepts).

    Only the shape is checked here; whether a schema, regex or grammar compiles
    is the grammar backend's verdict, given when the request is added.

    ``reasoning`` lets a reasoning model think first, as vLLM's reasoning
    parsers do: None, the grammar applies from the first token; ``"inside"``,
    the output starts inside a think block (the prompt opened it) and is free
    until ``</think>``; ``"may_open"``, the first token may also be
    ``<think>`` (then as ``"inside"``), else the grammar applies from it.
    """

    json: str | dict[str, Any] | None = None  # a JSON schema, as an object or its text
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None  # any JSON object (OpenAI's json_object mode)
    # Free text, but from a trigger on, one of the structures (vLLM's field):
    # {"structures": [{"begin": str, "schema": {...}, "end": str}], "triggers": [str]}.
    structural_tag: str | dict[str, Any] | None = None
    reasoning: str | None = None  # None, or one of REASONING_STARTS

    def __post_init__(self) -> None:
        given = [k for k in ("json", "regex", "choice", "grammar", "json_object",
                             "structural_tag") if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs needs exactly one of json, regex, choice, "
                             f"grammar, json_object, structural_tag; got {given or 'none'}.")
        if self.structural_tag is not None:
            self.structural_tag = _checked_structural_tag(self.structural_tag)
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except ValueError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise ValueError("structured_outputs.json must be a JSON schema (an object), "
                             f"got {type(self.json).__name__}.")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string.")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) for c in self.choice)):
                raise ValueError("structured_outputs.choice must be a non-empty list of strings.")
            self.choice = list(self.choice)
        if self.json_object not in (None, True, False):
            raise ValueError("structured_outputs.json_object must be a boolean.")
        if self.reasoning is not None and self.reasoning not in REASONING_STARTS:
            raise ValueError(f"structured_outputs.reasoning must be one of "
                             f"{', '.join(REASONING_STARTS)} or None, got {self.reasoning!r}.")


def _checked_structural_tag(tag: str | dict[str, Any]) -> dict[str, Any]:
    """vLLM's structural tag, as an object: every structure's begin starts with a trigger."""
    where = "structured_outputs.structural_tag"
    if isinstance(tag, str):
        try:
            tag = json.loads(tag)
        except ValueError as e:
            raise ValueError(f"{where} is not valid JSON: {e}") from None
    triggers = tag.get("triggers") if isinstance(tag, dict) else None
    structures = tag.get("structures") if isinstance(tag, dict) else None
    if not isinstance(triggers, list) or not triggers or \
            not all(isinstance(t, str) and t for t in triggers):
        raise ValueError(f"{where}.triggers must be a non-empty list of non-empty strings.")
    if not isinstance(structures, list) or not structures:
        raise ValueError(f"{where}.structures must be a non-empty list.")
    for i, st in enumerate(structures):
        if not isinstance(st, dict) or not isinstance(st.get("begin"), str) or \
                not isinstance(st.get("end"), str) or not isinstance(st.get("schema"), dict):
            raise ValueError(f"{where}.structures[{i}] needs begin and end (strings) and "
                             "schema (an object).")
        if not any(st["begin"].startswith(t) for t in triggers):
            raise ValueError(f"{where}.structures[{i}].begin starts with none of the triggers.")
    return tag


@dataclass
class SamplingParams:
    """How to pick tokens for one request, and when to stop.

    `stop` and `stop_token_ids` are normalised to lists. A greedy request
    (temperature < 1e-5) has top_p/top_k/min_p reset to their neutral values,
    as vLLM does, so the sampler never does filtering work for it.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    # None: until the context window is full; 0: the prompt alone, no token generated
    # (with prompt_logprobs: a text scored, as OpenAI's legacy echo with max_tokens 0).
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None  # top logprobs to return besides the sampled token
    # Per prompt token after the first: its logprob and this many top ones (vLLM's
    # field). Such a request's prompt is computed in full, never from the prefix cache.
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        self._check_int("n", self.n, minimum=1)
        self._check_float("temperature", self.temperature, lo=0.0)
        self._check_float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if not _is_int(self.top_k):
            raise ValueError(f"top_k must be an integer, got {self.top_k!r}.")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (disabled) or at least 1, got {self.top_k}.")
        self._check_float("min_p", self.min_p, lo=0.0, hi=1.0)
        self._check_float("presence_penalty", self.presence_penalty, lo=-2.0, hi=2.0)
        self._check_float("frequency_penalty", self.frequency_penalty, lo=-2.0, hi=2.0)
        self._check_float("repetition_penalty", self.repetition_penalty)
        if not _FP32_TINY <= self.repetition_penalty <= _FP32_MAX:  # the sampler's fp32
            raise ValueError(
                f"repetition_penalty must be greater than 0 and within a float32's range "
                f"({_FP32_TINY:.3g} to {_FP32_MAX:.3g}), got {self.repetition_penalty}."
            )
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}.")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise ValueError(f"seed must fit in 64 bits, got {self.seed}.")
        if self.max_tokens is not None:
            self._check_int("max_tokens", self.max_tokens, minimum=0)
        self._check_int("min_tokens", self.min_tokens, minimum=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be less than or equal to "
                f"max_tokens ({self.max_tokens})."
            )
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None:
                self._check_int(name, k, minimum=0)
                if k > MAX_LOGPROBS:
                    raise ValueError(f"{name} must be at most {MAX_LOGPROBS}, got {k}.")
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}.")
        if self.structured_outputs is not None and not isinstance(
                self.structured_outputs, StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams.")

        if self.stop is None:
            stop: list[str] = []
        elif isinstance(self.stop, str):
            stop = [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            stop = list(self.stop)
        else:
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}.")
        for s in stop:
            if not isinstance(s, str):
                raise ValueError(f"stop strings must be strings, got {s!r}.")
            if not s:
                raise ValueError("stop strings must not be empty.")
        self.stop = stop

        if self.stop_token_ids is None:
            stop_ids: list[int] = []
        elif isinstance(self.stop_token_ids, (list, tuple)):
            stop_ids = list(self.stop_token_ids)
        else:
            raise ValueError(
                f"stop_token_ids must be a list of integers, got {self.stop_token_ids!r}."
            )
        for t in stop_ids:
            if not _is_int(t) or t < 0:
                raise ValueError(f"stop_token_ids must be non-negative integers, got {t!r}.")
        self.stop_token_ids = stop_ids

        if self.greedy:
            # As vLLM: filtering is meaningless for argmax; neutral values keep
            # the sampler's "no top-k / no top-p" fast paths.
            self.top_p = 1.0
            self.top_k = 0
            self.min_p = 0.0

    @staticmethod
    def _check_int(name: str, value: object, minimum: int) -> None:
        if not _is_int(value):
            raise ValueError(f"{name} must be an integer, got {value!r}.")
        if value < minimum:  # type: ignore[operator]
            raise ValueError(f"{name} must be at least {minimum}, got {value}.")

    @staticmethod
    def _check_float(
        name: str, value: object, lo: float | None = None, hi: float | None = None
    ) -> None:
        if not _is_number(value) or not math.isfinite(value):  # type: ignore[arg-type]
            raise ValueError(f"{name} must be a finite number, got {value!r}.")
        if lo is not None and value < lo:  # type: ignore[operator]
            if hi is None:
                raise ValueError(f"{name} must be at least {lo}, got {value}.")
            raise ValueError(f"{name} must be in [{lo}, {hi}], got {value}.")
        if hi is not None and value > hi:  # type: ignore[operator]
            raise ValueError(f"{name} must be in [{lo}, {hi}], got {value}.")

    def fan_out(self) -> list[SamplingParams]:
        """n engine requests (n = 1 each) for an n-sequence request; sequence i
        samples with seed + i (so each is its own run alone with that seed)."""
        if self.n == 1:
            return [self]
        return [dataclasses.replace(self, n=1, seed=None if self.seed is None else self.seed + i)
                for i in range(self.n)]

    @property
    def greedy(self) -> bool:
        """Argmax decoding (vLLM's rule: temperature below 1e-5)."""
        return self.temperature < _SAMPLING_EPS
