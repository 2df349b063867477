"""A step's sampling parameters as tensors, gathered once per step from its requests.

The sampler reads only this. Each per-row setting becomes a tensor, or None when
no row uses it, so a batch pays only for what its requests ask for.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from itertools import chain

import numpy as np
import torch

from tandem.sampling_params import SamplingParams


@dataclass
class SamplingMetadata:
    """Per-step batch sampling state, built once per step from the requests.

    Rows are the rows of the logits. "Random rows" are the non-greedy rows; the
    per-row tensors `temperature`, `top_k`, `top_p`, `min_p` are aligned with
    `random_rows` (length R), not with the batch. A tensor that no row needs is
    None, which is also the flag that skips its work in the sampler.
    """

    num_rows: int
    vocab_size: int
    all_greedy: bool
    all_random: bool
    # Index tensors, None when the batch is all greedy / all random.
    greedy_rows: torch.Tensor | None = None
    random_rows: torch.Tensor | None = None
    # Random rows only ([R]); None when all_greedy.
    temperature: torch.Tensor | None = None
    top_k: torch.Tensor | None = None  # int64, 0 = off; None: no random row uses top-k
    top_p: torch.Tensor | None = None  # float32, 1.0 = off; None: no random row uses top-p
    min_p: torch.Tensor | None = None  # float32, 0.0 = off; None: no random row uses min-p
    max_top_k: int = 0  # largest enabled top_k (0 when none)
    # Random rows that use top-k or top-p (positions within the random rows);
    # None when every random row does.
    filter_rows: torch.Tensor | None = None
    # Position within the random rows -> that request's generator.
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    # The other random rows' draws (None: torch's global generator).
    default_generator: torch.Generator | None = None
    # Penalties, sparse: only (row, token) pairs that occur in a penalty row's
    # prompt or output are touched, never a dense [rows, V] tensor.
    no_penalties: bool = True
    # Distinct (batch row, token) in prompt or output of rows with repetition_penalty
    # != 1, and that row's penalty per pair.
    repetition_pairs: tuple[torch.Tensor, torch.Tensor] | None = None
    repetition_values: torch.Tensor | None = None
    # Distinct (batch row, token) in the output of rows with presence/frequency
    # penalties, and the amount to subtract: frequency * count + presence.
    output_pairs: tuple[torch.Tensor, torch.Tensor] | None = None
    output_deltas: torch.Tensor | None = None
    # min_tokens: (rows, token ids) whose logits are set to -inf this step.
    min_tokens_mask: tuple[torch.Tensor, torch.Tensor] | None = None
    # Logprobs: K = the largest requested count; rows that asked (None: all).
    max_num_logprobs: int | None = None
    logprob_rows: torch.Tensor | None = None
    # Structured outputs: (constrained rows, the grammar's allowed-token bitmask
    # [rows, ceil(V / 32)] int32, see apply_token_bitmask_); None when no row is
    # constrained (then it costs nothing). The model runner sets it after build.
    grammar_mask: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def argmax_only(self) -> bool:
        """Sampling is the argmax of the raw logits: all greedy, nothing to
        mask, penalize or report."""
        return (self.all_greedy and self.no_penalties and self.min_tokens_mask is None
                and self.max_num_logprobs is None and self.grammar_mask is None)

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None] | None,
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
        eos_token_ids: Collection[int],
        vocab_size: int,
        device: torch.device | str = "cpu",
        default_generator: torch.Generator | None = None,
    ) -> SamplingMetadata:
        """Collect the step's per-request parameters into tensors.

        O(B) Python when no request uses penalties or min_tokens: the token
        lists are only read (their lengths for min_tokens, their contents for
        penalties) by the requests that need them.
        """
        num_rows = len(params)
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        meta = cls(
            num_rows=num_rows,
            vocab_size=vocab_size,
            all_greedy=not random_rows,
            all_random=len(random_rows) == num_rows,
            default_generator=default_generator,
        )
        if not meta.all_greedy and not meta.all_random:
            meta.greedy_rows = _index([i for i, p in enumerate(params) if p.greedy], device)
            meta.random_rows = _index(random_rows, device)
        if random_rows:
            sampled = [params[i] for i in random_rows]
            meta._gather_temperatures(sampled, device)
            meta._gather_top_k_top_p(sampled, device)
            meta._gather_min_p(sampled, device)
            meta._gather_seeds(generators, random_rows)
        meta._gather_logprobs(params, device)
        meta._gather_min_tokens(params, output_token_ids, eos_token_ids, device)
        meta._gather_penalties(params, prompt_token_ids, output_token_ids, device)
        return meta

    def _gather_temperatures(
        self, sampled: Sequence[SamplingParams], device: torch.device | str
    ) -> None:
        """The random rows' temperatures (every random row has one)."""
        self.temperature = torch.tensor(
            [p.temperature for p in sampled], dtype=torch.float32, device=device
        )

    def _gather_top_k_top_p(
        self, sampled: Sequence[SamplingParams], device: torch.device | str
    ) -> None:
        """Top-k and top-p per random row, and which random rows filter at all.

        A top_k of 0, or one that covers the whole vocabulary, is off.
        """
        v = self.vocab_size
        top_ks = [p.top_k if 0 < p.top_k < v else 0 for p in sampled]
        uses_top_p = [p.top_p < 1.0 for p in sampled]
        self.max_top_k = max(top_ks)
        if self.max_top_k > 0:
            self.top_k = torch.tensor(top_ks, dtype=torch.long, device=device)
        if any(uses_top_p):
            self.top_p = torch.tensor([p.top_p for p in sampled], dtype=torch.float32,
                                      device=device)
        if self.top_k is not None or self.top_p is not None:
            filt = [r for r, (k, tp) in enumerate(zip(top_ks, uses_top_p)) if k > 0 or tp]
            if len(filt) < len(sampled):
                self.filter_rows = _index(filt, device)

    def _gather_min_p(
        self, sampled: Sequence[SamplingParams], device: torch.device | str
    ) -> None:
        """Min-p per random row, when any uses it."""
        if any(p.min_p > 0.0 for p in sampled):
            self.min_p = torch.tensor([p.min_p for p in sampled], dtype=torch.float32,
                                      device=device)

    def _gather_seeds(
        self, generators: Sequence[torch.Generator | None] | None, random_rows: list[int]
    ) -> None:
        """Seeded random rows' own generators, keyed by position within the random rows."""
        if generators is not None:
            self.generators = {
                r: gen for r, i in enumerate(random_rows) if (gen := generators[i]) is not None
            }

    def _gather_logprobs(
        self, params: Sequence[SamplingParams], device: torch.device | str
    ) -> None:
        """The largest logprob count asked for, and the rows that asked."""
        rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        if rows:
            self.max_num_logprobs = max(p.logprobs for p in params if p.logprobs is not None)
            if len(rows) < self.num_rows:
                self.logprob_rows = _index(rows, device)

    def _gather_min_tokens(
        self,
        params: Sequence[SamplingParams],
        output_token_ids: Sequence[Sequence[int]],
        eos_token_ids: Collection[int],
        device: torch.device | str,
    ) -> None:
        """(row, token) pairs banned this step because their row is under min_tokens."""
        v = self.vocab_size
        rows: list[int] = []
        cols: list[int] = []
        for i, p in enumerate(params):
            if p.min_tokens and len(output_token_ids[i]) < p.min_tokens:
                # vLLM masks every end-of-generation id under min_tokens, even
                # with ignore_eos (they are always in its all_stop_token_ids),
                # plus the stop token ids: the engine's own set, so what may
                # not be sampled is exactly what would end the request.
                stops = {t for t in (*eos_token_ids, *(p.stop_token_ids or ())) if 0 <= t < v}
                rows.extend([i] * len(stops))
                cols.extend(stops)
        if rows:
            self.min_tokens_mask = (_index(rows, device), _index(cols, device))

    def _gather_penalties(
        self,
        params: Sequence[SamplingParams],
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
        device: torch.device | str,
    ) -> None:
        """Distinct (row, token) pairs and per-pair penalty values.

        One flat id tensor per kind and a `torch.unique` over row * V + token:
        O(tokens) tensor work, Python only to flatten the id lists.
        """
        rows = [
            i for i, p in enumerate(params)
            if p.repetition_penalty != 1.0 or p.presence_penalty != 0.0
            or p.frequency_penalty != 0.0
        ]
        if not rows:
            return
        v = self.vocab_size
        self.no_penalties = False

        def keys(rows_: list[int], seqs: Sequence[Sequence[int]]) -> torch.Tensor:
            lens = [len(seqs[i]) for i in rows_]
            # np.fromiter flattens id lists faster than torch.tensor(list).
            flat = np.fromiter(chain.from_iterable(seqs[i] for i in rows_), np.int64, sum(lens))
            ids = torch.from_numpy(flat)
            row = torch.repeat_interleave(torch.tensor(rows_), torch.tensor(lens))
            ok = (ids >= 0) & (ids < v)  # out-of-vocabulary ids are never sampled
            return row[ok] * v + ids[ok]

        def per_row(name: str) -> torch.Tensor:
            vals = [0.0] * self.num_rows
            for i in rows:
                vals[i] = getattr(params[i], name)
            return torch.tensor(vals, dtype=torch.float32)

        out_rows = [i for i in rows if params[i].presence_penalty or params[i].frequency_penalty]
        if out_rows:
            out_keys, counts = torch.unique(keys(out_rows, output_token_ids), return_counts=True)
            r = out_keys // v
            deltas = per_row("frequency_penalty")[r] * counts + per_row("presence_penalty")[r]
            self.output_pairs = (r.to(device), (out_keys % v).to(device))
            self.output_deltas = deltas.to(device)
        rep_rows = [i for i in rows if params[i].repetition_penalty != 1.0]
        if rep_rows:
            seen = torch.unique(torch.cat(
                [keys(rep_rows, prompt_token_ids), keys(rep_rows, output_token_ids)]
            ))
            r = seen // v
            self.repetition_pairs = (r.to(device), (seen % v).to(device))
            self.repetition_values = per_row("repetition_penalty")[r].to(device)


def _index(rows: list[int], device: torch.device | str) -> torch.Tensor:
    """Row indices as the int64 tensor index_select and indexing take."""
    return torch.tensor(rows, dtype=torch.long, device=device)
