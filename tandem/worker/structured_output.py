"""Constrained decoding (structured outputs): grammars, per-request matchers, token masks.

The backend is llguidance. It fills a row's mask slower than xgrammar, but
either is a small part of a decode step; what decides is the weight:
llguidance is one 3 MB wheel with no dependencies, while xgrammar brings
apache-tvm-ffi and triton (a 286 MB wheel) for kernels a CPU engine never
runs. It is the ``structured`` extra, imported lazily:
an engine without it serves unconstrained requests as before, and a
constrained request gets a ValueError naming the extra.

* Compile once per spec: the llguidance tokenizer is built once per engine
  (on the first constrained request); each distinct spec (keyed on its
  canonical JSON) is compiled into a pristine matcher, kept in an LRU cache,
  and every request gets a cheap ``deep_copy`` of it.
* Per request a ``StructuredOutputRequest`` lives on the ``Request``. It has
  consumed exactly the request's output tokens (those after a think block, when
  the request lets a reasoning model think first): preemption keeps the output
  and samples nothing until the recompute reaches its end, and a chunked
  prefill samples nothing until its last chunk, so neither needs a rollback.
* Per step the runner fills the constrained rows' masks once the forward pass
  is issued (on a GPU it overlaps the kernels), on the engine thread: any
  other thread on a 2-core CPU slows the forward as much as it hides (a
  worker thread during the forward gained nothing; llguidance's own
  executor pool slowed the forward). The sampler applies the
  packed bitmask as it comes (``apply_token_bitmask_``).
"""

from __future__ import annotations

import functools
import json
import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from copy import copy
from typing import TYPE_CHECKING, Any

import torch

from tandem.kernels import custom_ops
from tandem.sampling_params import (
    THINK_CLOSE,
    THINK_OPEN,
    StructuredOutputsParams,
    partial_suffix,
)
from tandem.worker.unique_items import UniqueItems, Vocabulary, wants_unique_items

if TYPE_CHECKING:
    from tandem.core.request import Request
    from tandem.tokenizer import Tokenizer

# Distinct specs kept compiled: compiling one costs far more than the
# deep_copy each request takes.
GRAMMAR_CACHE_SIZE = 256
# JSON as json.dumps writes it (", " and ": ", no other whitespace): tokens a
# model has seen, and no room for the endless-whitespace loop a flexible
# whitespace rule lets a small model fall into.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


# Where a JSON schema holds subschemas: under each key of a mapping, in a list,
# or as the value itself (``items`` may be either of the last two).
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SCHEMA_VALUES = ("items", "additionalProperties", "unevaluatedProperties", "not", "if",
                  "then", "else", "contains", "propertyNames", "additionalItems")


def ascii_digits(regex: str) -> str:
    """``regex`` with ``\\d`` / ``\\D`` as ASCII digits (``[0-9]``), as JSON Schema's
    ECMA-262 patterns and vLLM's default backend (xgrammar) read them: llguidance
    reads them as Unicode's digit class, and the default model answered
    ``\\d{3}-\\d{4}`` with U+1FBF8 (segmented digits, several byte tokens each)
    until max_tokens. Escapes stay escapes; inside a character class the ASCII
    class ``[:digit:]`` stands in."""
    out: list[str] = []
    depth = 0  # character classes nest in llguidance's (Rust's) syntax
    i = 0
    while i < len(regex):
        c = regex[i]
        if c == "\\" and i + 1 < len(regex):
            n = regex[i + 1]
            if n in "dD":
                out.append(("[:digit:]" if n == "d" else "[:^digit:]") if depth
                           else ("[0-9]" if n == "d" else "[^0-9]"))
            else:
                out.append(c + n)
            i += 2
            continue
        if c == "[":
            if depth and regex.startswith("[:", i):  # an ASCII class inside a class
                end = regex.find(":]", i + 2)
                if end > 0:
                    out.append(regex[i:end + 2])
                    i = end + 2
                    continue
            depth += 1
            out.append(c)
            i += 1
            # a first ']' (after an optional '^') is a literal
            if regex.startswith("^", i):
                out.append("^")
                i += 1
            if regex.startswith("]", i):
                out.append("]")
                i += 1
            continue
        if c == "]" and depth:
            depth -= 1
        out.append(c)
        i += 1
    return "".join(out)


_INT64 = (-(2**63), 2**63 - 1)


def _check_integer_bounds(schema: dict) -> None:
    """ValueError for an integer's bound past 64 bits: llguidance clamps it to int64,
    and the output breaks the bound the schema sets (a minimum of 1e308 gave
    9223372036854775807)."""
    kinds = schema.get("type")
    if "integer" not in (kinds if isinstance(kinds, list) else [kinds]):
        return
    for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
        v = schema.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and \
                not _INT64[0] <= v <= _INT64[1]:
            raise ValueError(f"an integer's {key} of {v} is past the 64-bit range "
                             "structured outputs can enforce")


def compiled_schema(schema: Any, in_all_of: bool = False) -> Any:
    """``schema`` as tandem compiles it: with ``"additionalProperties": false``
    on each object that lists its properties and says nothing of others, as
    vLLM's default backend (xgrammar's strict mode) and Ollama (llama.cpp's
    converter) compile it: JSON Schema itself lets any other key in, and a
    sampled model adds them (a pydantic model's schema, which Ollama's docs pass
    as ``format``, never says). The parts of an ``allOf`` stay open: closed each
    to its own properties, no object could satisfy two of them. And with each
    ``pattern``'s digits ASCII (ascii_digits). Only subschemas are visited: a
    ``const``, ``enum`` or ``default`` value is data, kept as given."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for k, v in schema.items():
        if k in _SCHEMA_MAPS and isinstance(v, dict):
            out[k] = {ascii_digits(name) if k == "patternProperties" else name:
                      compiled_schema(sub) for name, sub in v.items()}
        elif k in _SCHEMA_LISTS and isinstance(v, list):
            out[k] = [compiled_schema(sub, k == "allOf" and len(v) > 1) for sub in v]
        elif k in _SCHEMA_VALUES:
            out[k] = compiled_schema(v)
    if isinstance(schema.get("pattern"), str):
        out["pattern"] = ascii_digits(schema["pattern"])
    _check_integer_bounds(schema)
    if (not in_all_of and isinstance(schema.get("properties"), dict)
            and "additionalProperties" not in schema and "patternProperties" not in schema):
        out["additionalProperties"] = False
    return out


def spec_key(spec: StructuredOutputsParams) -> tuple[str, str]:
    """(the field that is set, its canonical text): the grammar cache's key.

    A schema's keys keep their order: it is the order the properties are generated in.
    """
    if spec.json is not None:
        return "json", json.dumps(spec.json, separators=(",", ":"))
    if spec.json_object:
        return "json_object", ""
    if spec.regex is not None:
        return "regex", spec.regex
    if spec.choice is not None:
        return "choice", json.dumps(spec.choice)
    if spec.structural_tag is not None:
        return "structural_tag", json.dumps(spec.structural_tag, separators=(",", ":"))
    assert spec.grammar is not None  # StructuredOutputsParams checks exactly one is set
    return "grammar", spec.grammar


class GrammarFailedError(ValueError):
    """A request's grammar cannot go on: llguidance hit one of its limits (a
    lexer's or parser's size, on a valid but pathological schema or regex) or
    admits no token at all (a schema with no finite instance, e.g. a cycle of
    $refs). The request's own input is the cause: it alone ends."""


def _compile_error(message: str) -> str:
    """llguidance's compile error without the backtrace a Rust panic in it carries
    (2.5 kB of frames and build paths; the panic's own line says what failed)."""
    return message.split("<backtrace>", 1)[0].strip()


def _failure(field: str, matcher) -> str:
    """The matcher's error, first line only: what follows is its whole state,
    the grammar included."""
    first = (matcher.get_error() or "").strip().splitlines()[:1]
    reason = first[0] if first else "it refused the sampled token"
    if reason == "NoExtensionBias":  # llguidance's word for an empty mask
        reason = ("no token can continue the output (does the schema have no finite "
                  "instance, e.g. a cycle of $refs?)")
    return f"structured_outputs.{field} failed mid-output: {reason}"


class StructuredOutputRequest:
    """One sequence's grammar state: the matcher has consumed its output since the
    grammar began, which is all of it unless a think block came first.

    ``phase``: ``"grammar"`` (the matcher masks every token), ``"thinking"``
    (inside a think block: free until the output shows ``</think>``, but for
    tokens that would end the tag and go on with text the grammar never saw:
    ``pending`` is the tag's start the output ends with) or ``"may_open"``
    (the first token: the grammar's, or ``<think>``, which starts the block).
    """

    __slots__ = ("matcher", "phase", "pending", "field", "unique", "_recent", "_decode",
                 "_open_id")

    def __init__(self, matcher, phase: str = "grammar",
                 decode: Callable[[list[int]], str] | None = None,
                 open_id: int | None = None, field: str = "grammar",
                 unique: UniqueItems | None = None) -> None:
        self.matcher = matcher  # llguidance.LLMatcher
        self.field = field  # the spec's field (spec_key), named by a failure
        self.unique = unique  # a top-level array's uniqueItems, which llguidance ignores
        self.phase = phase
        self.pending = ""
        self._recent: list[int] = []  # the last output tokens, while thinking
        self._decode = decode
        self._open_id = open_id

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token; True when the grammar is complete (only an
        end-of-generation token could follow, or one was just taken)."""
        if self.phase == "may_open":
            self.phase = "thinking" if token_id == self._open_id else "grammar"
            if self.phase == "thinking":
                return False
        if self.phase == "thinking":
            # Each token holds at least one of the tag's characters: its length
            # in tokens (and one for a tag that starts mid-token) is enough.
            self._recent = [*self._recent[-len(THINK_CLOSE):], token_id]
            text = self._decode(self._recent)
            if THINK_CLOSE in text:
                self.phase, self.pending = "grammar", ""
            else:
                self.pending = THINK_CLOSE[:partial_suffix(text, THINK_CLOSE)]
            return False
        m = self.matcher
        # An error from the mask's computation left the mask only end-of-text
        # tokens, which the matcher would take: checked first, or it read as done.
        if m.is_error() or not m.consume_token(token_id):
            raise GrammarFailedError(_failure(self.field, m))
        if self.unique is not None:
            self.unique.accept(token_id)
        return m.is_stopped()

    @property
    def terminated(self) -> bool:
        """The grammar is complete: no token but an end-of-generation one may follow."""
        return self.matcher.is_stopped()


class StructuredOutputManager:
    """Compiles and caches grammars (any thread) and fills the step's token masks
    (the engine thread, between the forward pass and sampling).

    Compiling happens in ``make_request``, which callers run off the event loop;
    the lock covers the tokenizer and the cache, never a matcher in use.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int,
                 eos_token_ids: Collection[int]) -> None:
        self.tokenizer = tokenizer
        # llguidance needs a place for every token the tokenizer has; one past the
        # model's rows is never sampled (masks are cut to the logits' width).
        self.vocab_size = max(vocab_size, tokenizer.vocab_size)
        self.eos_token_ids = sorted(eos_token_ids)
        self._lock = threading.Lock()
        self._ll_tokenizer = None
        self._ll_json_tokenizer = None
        self._grammars: OrderedDict[tuple[str, str], object] = OrderedDict()
        self._bitmask: torch.Tensor | None = None
        self._tag_ends: dict[str, torch.Tensor | None] = {}  # see _prepare_tag_ends
        self._vocab: Vocabulary | None = None

    # ------------------------------------------------------------ compile
    def new_request(self, spec: StructuredOutputsParams) -> StructuredOutputRequest:
        """A fresh matcher for ``spec``; ValueError naming the field if it does not compile."""
        key = spec_key(spec)
        with self._lock:
            pristine = self._grammars.get(key)
            if pristine is None:
                pristine = self._compile(key)
                self._grammars[key] = pristine
                if len(self._grammars) > GRAMMAR_CACHE_SIZE:
                    self._grammars.popitem(last=False)
            else:
                self._grammars.move_to_end(key)
            phase = self._phase(spec)
            unique = UniqueItems(self._vocabulary()) if wants_unique_items(spec.json) else None
            return StructuredOutputRequest(pristine.deep_copy(), phase, self._decode,
                                           self._open_id if phase == "may_open" else None,
                                           key[0], unique)

    def _vocabulary(self) -> Vocabulary:
        """Every token's bytes, read once from the grammar's tokenizer (under the lock)."""
        if self._vocab is None:
            tok = self._ll_tokenizer
            self._vocab = Vocabulary([tok.decode_bytes([i]) for i in range(self.vocab_size)],
                                     self.eos_token_ids)
        return self._vocab

    def _phase(self, spec: StructuredOutputsParams) -> str:
        """The first phase of a request (see StructuredOutputRequest). A first token
        may open a think block only where <think> is one token: the mask admits it
        beside the grammar's; otherwise the grammar applies from the first token."""
        if spec.reasoning is not None:
            self._prepare_tag_ends()
        if spec.reasoning == "inside":
            return "thinking"
        if spec.reasoning == "may_open" and self._open_id is not None:
            return "may_open"
        return "grammar"

    @functools.cached_property
    def _open_id(self) -> int | None:
        """<think> as one token, if the vocabulary has it."""
        ids = self.tokenizer.encode(THINK_OPEN, add_special_tokens=False)
        return ids[0] if len(ids) == 1 else None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def _prepare_tag_ends(self) -> None:
        """For each start of </think> a thinking output may end with (and none), the
        mask of every token but those that would complete the tag and go on with
        text ("k>." after "</thin"), which the grammar, starting after the tag,
        would never see; None where no token does. Built once, from the
        vocabulary's texts, with the first request that may think (compiling runs
        off the event loop, not in a step)."""
        if self._tag_ends:
            return
        texts = self.tokenizer.backend.decode_batch(
            [[i] for i in range(self.tokenizer.vocab_size)], skip_special_tokens=False)
        ends: dict[str, torch.Tensor | None] = {}
        for n in range(len(THINK_CLOSE)):
            pending = THINK_CLOSE[:n]
            banned = [i for i, t in enumerate(texts) if ">" in t and _overshoots(pending + t)]
            ends[pending] = None
            if banned:
                ok = torch.ones(-(-self.vocab_size // 32) * 32, dtype=torch.bool)
                ok[banned] = False
                ends[pending] = _pack_bits(ok)
        self._tag_ends = ends

    def _compile(self, key: tuple[str, str]):
        llg = _import_llguidance()
        field, text = key
        if self._ll_tokenizer is None:
            backend = copy(self.tokenizer.backend)  # llguidance reads its JSON form
            backend.no_padding()
            backend.no_truncation()
            self._ll_tokenizer = llg.LLTokenizer(
                backend.to_str(), n_vocab=self.vocab_size, eos_token=self.eos_token_ids)
            # JSON's own slices (token sets precomputed for string bodies and the
            # like): measured below in benchmarks/structured_outputs.py.
            self._ll_json_tokenizer = self._ll_tokenizer.with_slices(
                llg.LLTokenizer.json_slices())
        try:
            if field == "json":
                schema = compiled_schema(json.loads(text))
                if wants_unique_items(schema):  # llguidance refuses it; masks() enforces it
                    schema = {k: v for k, v in schema.items() if k != "uniqueItems"}
                schema = json.dumps(schema)
                grammar = llg.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
            elif field == "json_object":
                grammar = llg.LLMatcher.grammar_from_json_schema(
                    '{"type": "object"}', defaults=JSON_OPTIONS)
            elif field == "regex":
                grammar = llg.LLMatcher.grammar_from_regex(ascii_digits(text))
            elif field == "choice":
                grammar = llg.grammar_from("choice", text)
            elif field == "structural_tag":
                grammar = _structural_tag_grammar(llg, json.loads(text))
            else:  # Lark, or GBNF (converted to Lark)
                grammar = llg.grammar_from("grammar", text)
        except ValueError as e:
            raise ValueError(f"structured_outputs.{field} cannot be compiled: "
                             f"{_compile_error(str(e))}") from None
        tokenizer = self._ll_json_tokenizer if field in ("json", "json_object",
                                                         "structural_tag") \
            else self._ll_tokenizer
        matcher = llg.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured_outputs.{field} cannot be compiled: "
                             f"{_compile_error(matcher.get_error())}")
        return matcher

    # ---------------------------------------------------------- per step
    def masks(self, reqs: Sequence[Request]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(row indices, allowed-token bitmask [rows, words] int32) of this step's
        constrained rows for ``SamplingMetadata.grammar_mask``; None when no row is.

        The bitmask is a view of a buffer the next call overwrites: it is meant
        for this step's sampler only.
        """
        rows = [i for i, r in enumerate(reqs) if (g := r.structured_output_request) is not None
                and (g.phase != "thinking" or self._tag_ends.get(g.pending) is not None)]
        if not rows:
            return None
        n = len(rows)
        if self._bitmask is None or self._bitmask.shape[0] < n:
            self._bitmask = torch.empty(max(n, 64), -(-self.vocab_size // 32), dtype=torch.int32)
        words = self._bitmask[:n]
        # Each matcher fills its row on this thread. llguidance's LLExecutor (a
        # rayon pool, even of one thread) took longer a row than this, and its
        # worker, spinning on a 2-core machine, slowed the next forward
        # (benchmarks/structured_outputs.py).
        nbytes = words.shape[1] * 4
        base = words.data_ptr()
        for j, i in enumerate(rows):
            grammar = reqs[i].structured_output_request
            if grammar.phase == "thinking":
                words[j] = self._tag_ends[grammar.pending]
                continue
            grammar.matcher.unsafe_compute_mask_ptr(base + j * nbytes, nbytes)
            if grammar.unique is not None:
                grammar.unique.narrow(grammar.matcher, words[j].numpy())
            if grammar.phase == "may_open":  # <think> besides the grammar's first tokens
                word, bit = divmod(self._open_id, 32)
                words[j, word] |= (1 << bit) - (1 << 32 if bit == 31 else 0)
        return torch.tensor(rows, dtype=torch.long), words


def _structural_tag_grammar(llg, tag: dict) -> str:
    """Free text in which each trigger starts a structure: its begin, a JSON value of its
    schema (compiled as a ``json`` spec's is), its end. llguidance's lazy lexemes find
    the triggers, so the text before and between structures is not constrained."""
    tags = [llg.StructTag(trigger=next(t for t in tag["triggers"] if s["begin"].startswith(t)),
                          begin=s["begin"], end=s["end"],
                          grammar={**compiled_schema(s["schema"]), "x-guidance": JSON_OPTIONS})
            for s in tag["structures"]]
    return llg.LLMatcher.grammar_from_lark(llg.StructTag.to_grammar(tags, assume_special=False))


def _overshoots(text: str) -> bool:
    """text holds </think> and more than whitespace after it."""
    at = text.find(THINK_CLOSE)
    return at >= 0 and bool(text[at + len(THINK_CLOSE):].strip())


def _pack_bits(ok: torch.Tensor) -> torch.Tensor:
    """[32 k] bool (True = allowed) -> llguidance's bitmask row: k int32 words, bit t % 32
    of word t // 32 for token t."""
    weights = torch.tensor([1 << b for b in range(32)], dtype=torch.int64)
    words = (ok.view(-1, 32).to(torch.int64) * weights).sum(1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def apply_token_bitmask_(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor,
                         value: float = -math.inf) -> None:
    """Set ``logits[rows[r], t] = value`` for every token t the grammar bans.

    ``bitmask`` is llguidance's: int32 words, bit t % 32 of word t // 32 set when
    token t is allowed; tokens past its last word are banned. On CPU the packed
    words are read in place by a kernel (tandem/kernels/csrc/token_bitmask.h);
    elsewhere, or without the kernels, they are unpacked with torch ops.
    """
    if logits.device.type == "cpu" and custom_ops.available():
        torch.ops.tandem.apply_token_bitmask_(logits, rows, bitmask, value)
        return
    vocab = logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :vocab].bool()
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
    logits[rows] = logits[rows].masked_fill_(~allowed, value)


def _import_llguidance():
    try:
        import llguidance
    except ImportError:
        raise ValueError(
            "structured_outputs needs the grammar backend: pip install 'tandem[structured]' "
            "(llguidance)") from None
    return llguidance
