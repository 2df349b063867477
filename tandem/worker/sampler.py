"""Batched sampling on tensors: penalties, temperature, top-k/top-p/min-p, logprobs.

On CPU a full-vocabulary sort, `torch.multinomial` and even `argmax` cost far
more than the streaming passes (`amax`, `exp`), so the sampler avoids them and
stays exact: a blocked argmax for greedy rows, a hierarchical exponential race
(block, then token in it) for random rows, and top-k/top-p as a per-row logit
threshold from one `topk` prefilter, widened when a nucleus needs more. Seeded
rows draw noise shaped by the vocabulary alone, so a seed's draws do not depend
on the rest of the batch or on which path its row takes.

Order (vLLM's): min_tokens and grammar masking, repetition/frequency/presence penalties,
then argmax for greedy rows, or temperature -> top-k -> top-p -> min-p -> race.
Logprobs are log_softmax of the raw model logits, before any of that (vLLM V1's
default "raw_logprobs").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tandem.kernels import custom_ops
from tandem.worker.sampling_metadata import SamplingMetadata
from tandem.worker.structured_output import apply_token_bitmask_

# Block size of the blocked argmax and of the hierarchical race: 49,152 = 192 x 256,
# so a row costs 192 block noise draws + 256 in-block draws.
BLOCK = 256
# Candidates kept for rows with top_p < 1 and no top_k. Larger costs more topk
# time on every such row; smaller sends more rows to the exact full-sort fallback.
TOP_P_PREFILTER = 256
# Second try for rows whose nucleus is wider than that: a topk of 4,096 costs
# less than sorting the row and covers most of them (SmolLM2 at T=1, top-p 0.9:
# 12% of rows need > 256 tokens, 1.3% > 1,024; at top-p 0.95, 26% and 7.5%).
TOP_P_WIDER = 4096
# Exp(1) draws can be exactly 0 on CPU; p / 0 would be inf (or nan for a masked
# token), so clamp the noise away from zero (bias ~1e-38, i.e. none).
_TINY = torch.finfo(torch.float32).tiny
# Lowest input the race's exp sees (see exp_weights): e^-87 is a normal float.
EXP_FLOOR = -87.0


@dataclass
class SamplerOutput:
    """One step's sampled tokens (and logprobs when any row asked).

    `logprobs[:, 0]` is the sampled token's logprob, then the top-K in
    descending order (K = the batch's largest request); `logprob_token_ids`
    holds the matching ids. Rows that did not ask hold NaN / -1; a row that
    asked for k < K uses the first k + 1 columns.
    """

    sampled_token_ids: torch.Tensor  # int64 [B]
    logprobs: torch.Tensor | None = None  # float32 [B, K+1]
    logprob_token_ids: torch.Tensor | None = None  # int64 [B, K+1]


class Sampler(torch.nn.Module):
    """Turns a step's last-position logits into one token id per row."""

    @torch.inference_mode()
    def forward(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """The logits are the step's own: masks and penalties go into them in place
        (a [32, 49k] copy saved per step) unless logprobs need the raw values."""
        raw = logits
        logits = self._process_logits(logits, meta, keep_raw=meta.max_num_logprobs is not None)
        if meta.all_greedy:
            sampled = blocked_argmax(logits)
        elif meta.all_random:
            sampled = self._sample_random(logits, meta)
        else:
            assert meta.greedy_rows is not None and meta.random_rows is not None
            sampled = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
            sampled[meta.greedy_rows] = blocked_argmax(logits.index_select(0, meta.greedy_rows))
            sampled[meta.random_rows] = self._sample_random(
                logits.index_select(0, meta.random_rows), meta
            )
        out = SamplerOutput(sampled_token_ids=sampled)
        if meta.max_num_logprobs is not None:
            out.logprobs, out.logprob_token_ids = _gather_logprobs(raw, sampled, meta)
        return out

    @staticmethod
    def _process_logits(logits: torch.Tensor, meta: SamplingMetadata,
                        keep_raw: bool = True) -> torch.Tensor:
        """min_tokens and grammar masks, then penalties, in place: the step's logits
        are its own, copied only when the raw ones are still needed (logprobs)."""
        raw = logits
        logits = logits.float()
        if meta.min_tokens_mask is None and meta.no_penalties and meta.grammar_mask is None:
            return logits
        if keep_raw and logits is raw:
            logits = logits.clone()
        if meta.min_tokens_mask is not None:
            logits[meta.min_tokens_mask] = -math.inf
        if meta.grammar_mask is not None:
            apply_token_bitmask_(logits, *meta.grammar_mask)
        if meta.repetition_pairs is not None:
            # vLLM: divide positive logits, multiply negative ones (prompt + output).
            rp = meta.repetition_values
            vals = logits[meta.repetition_pairs]
            logits[meta.repetition_pairs] = torch.where(vals > 0, vals / rp, vals * rp)
        if meta.output_pairs is not None:
            logits[meta.output_pairs] -= meta.output_deltas
        return logits

    @staticmethod
    def _sample_random(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Temperature, top-k, top-p, min-p, then the hierarchical exponential race.

        Everything is decided in raw-logit space (temperature is monotone), so
        the only full-vocabulary passes are exp_weights' (one kernel on CPU),
        the threshold mask and the race's block sums: the
        top-p normaliser is the sum of those same weights, not a second
        logsumexp pass.
        """
        weights, row_max = exp_weights(logits, meta)
        thr = None  # per row: drop logits below it
        if meta.top_k is not None or meta.top_p is not None:
            thr = _top_k_top_p_threshold(logits, weights, row_max, meta)
        if meta.min_p is not None:
            # p_i < min_p * p_max  <=>  l_i < l_max + T * log(min_p).
            temp = meta.temperature.unsqueeze(1)
            thr_m = (row_max + temp * torch.log(meta.min_p).unsqueeze(1)).squeeze(1)
            thr = thr_m if thr is None else torch.maximum(thr, thr_m)
        if thr is not None:
            weights.masked_fill_(logits < thr.unsqueeze(1), 0.0)
        return _hierarchical_race(weights, meta.generators, meta.default_generator)


def exp_weights(logits: torch.Tensor, meta: SamplingMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """(exp((logits - row_max) / T) per random row, row_max [R, 1]): the race's
    unnormalised probabilities, exactly 0 for masked (-inf) logits.

    The exponent is floored at EXP_FLOOR: on CPU exp of an input whose result
    is denormal (or of -inf) is many times slower than of a normal one, and a
    low temperature puts most of a vocabulary there. So a token more than
    87 nats below the best keeps e^-87 (~1e-38) instead of less. On CPU one
    kernel does it in two passes per row (tandem/kernels/csrc/sampling.h), where
    torch takes five plus two to zero the masked entries again.
    """
    assert meta.temperature is not None
    if logits.device.type == "cpu" and logits.is_contiguous() and custom_ops.available():
        return torch.ops.tandem.exp_weights(logits, meta.temperature)
    row_max = logits.amax(dim=-1, keepdim=True)
    weights = (logits - row_max).div_(meta.temperature.unsqueeze(1))
    weights = weights.clamp_(min=EXP_FLOOR).exp_()
    return weights.masked_fill_(logits == -math.inf, 0.0), row_max


def blocked_argmax(x: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax (first index on ties), via per-block amax.

    `torch.argmax` is far slower on CPU than `amax`; reducing to block maxima
    first and arg-maxing inside one block per row is cheaper and returns the
    same index.
    """
    x = x.contiguous()
    rows, v = x.shape
    nb = v // BLOCK
    if nb < 2:
        return x.argmax(dim=-1)
    block_max = x.as_strided((rows, nb, BLOCK), (v, BLOCK, 1)).amax(dim=-1)
    if v > nb * BLOCK:
        block_max = torch.cat([block_max, x[:, nb * BLOCK :].amax(dim=-1, keepdim=True)], 1)
    idx = _block_indices(block_max.argmax(dim=-1), v)
    # Clamped duplicates of index v-1 come after the real one: first-index rule holds.
    best = x.gather(1, idx).argmax(dim=-1, keepdim=True)
    return idx.gather(1, best).squeeze(1)


def _block_indices(block: torch.Tensor, v: int) -> torch.Tensor:
    """Token ids of each row's block ([R, BLOCK]), clamped into the vocabulary."""
    offs = torch.arange(BLOCK, device=block.device)
    return (block.unsqueeze(1) * BLOCK + offs).clamp_(max=v - 1)


def _hierarchical_race(
    weights: torch.Tensor, generators: dict[int, torch.Generator],
    default: torch.Generator | None = None,
) -> torch.Tensor:
    """Sample row i with probability weights[i] / weights[i].sum(), exactly.

    Race over block masses (argmax mass_b / E_b picks block b with probability
    mass_b / total), then over the weights inside the chosen block. Noise is
    [R, n_blocks + BLOCK]: one batched draw, then seeded rows overwrite their
    row from their own generator, so their draw count depends only on V.
    """
    rows, v = weights.shape
    nb = v // BLOCK
    mass = weights.as_strided((rows, nb, BLOCK), (v, BLOCK, 1)).sum(dim=-1)
    has_tail = v > nb * BLOCK
    if has_tail:
        mass = torch.cat([mass, weights[:, nb * BLOCK :].sum(dim=-1, keepdim=True)], 1)
    n_blocks = mass.shape[1]
    noise = torch.empty(rows, n_blocks + BLOCK, device=weights.device)
    noise.exponential_(generator=default)
    for row, gen in generators.items():
        noise[row].exponential_(generator=gen)
    noise.clamp_(min=_TINY)
    block = (mass / noise[:, :n_blocks]).argmax(dim=-1)
    idx = _block_indices(block, v)
    w = weights.gather(1, idx)
    if has_tail:
        # Clamped duplicates of the last token must not add to its chances.
        offs = torch.arange(BLOCK, device=weights.device)
        w.masked_fill_(block.unsqueeze(1) * BLOCK + offs >= v, 0.0)
    pick = (w / noise[:, n_blocks:]).argmax(dim=-1, keepdim=True)
    return idx.gather(1, pick).squeeze(1)


def _top_k_top_p_threshold(
    logits: torch.Tensor, weights: torch.Tensor, row_max: torch.Tensor, meta: SamplingMetadata
) -> torch.Tensor:
    """Per random row, the smallest logit that top-k then top-p keep (-inf: all).

    Top-p follows vLLM: on the top-k-renormalised distribution, keep a token
    when the mass of the tokens ranked above it is < top_p (at least one).
    `weights` are exp((logits - row_max) / T), so candidate probabilities are
    their weights over the row's total weight.
    """
    rows_all, v = logits.shape
    sub = meta.filter_rows
    assert meta.temperature is not None
    temp = meta.temperature
    ls, top_k, top_p = logits, meta.top_k, meta.top_p
    if sub is not None:
        ls, temp, row_max = ls.index_select(0, sub), temp[sub], row_max[sub]
        top_k = None if top_k is None else top_k[sub]
        top_p = None if top_p is None else top_p[sub]
    n = ls.shape[0]
    k_pref = meta.max_top_k
    if top_p is not None:
        k_pref = max(k_pref, TOP_P_PREFILTER)
    k_pref = min(k_pref, v)
    vals = torch.topk(ls, k_pref, dim=-1).values  # descending
    thr = torch.full((n,), -math.inf, device=logits.device)
    kk = None
    if top_k is not None:
        k_on = top_k > 0
        kk = torch.where(k_on, top_k, k_pref)
        thr = torch.where(k_on, vals.gather(1, (kk - 1).unsqueeze(1)).squeeze(1), thr)
    if top_p is None:
        return _scatter_rows(thr, sub, rows_all)

    def cand_weights(vals: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        m, t = (row_max, temp) if rows is None else (row_max[rows], temp[rows])
        return (vals - m).div_(t.unsqueeze(1)).clamp_(min=EXP_FLOOR).exp_()

    p_on = top_p < 1.0
    cw = cand_weights(vals, None)
    total = weights.sum(dim=-1)
    if sub is not None:
        total = total[sub]
    if kk is not None:
        ranks = torch.arange(k_pref, device=logits.device)
        cw.masked_fill_(ranks >= kk.unsqueeze(1), 0.0)
        # Top-k rows renormalise over their k candidates; others over the vocabulary.
        total = torch.where(k_on, cw.sum(dim=-1), total)
    n_keep, covered = _nucleus_size(cw, total, top_p)
    if kk is not None:
        n_keep = torch.minimum(n_keep, kk)
    thr_p = vals.gather(1, (n_keep - 1).unsqueeze(1)).squeeze(1)
    thr = torch.where(p_on, torch.maximum(thr, thr_p), thr)
    # Exactness: a top-p-only row whose candidates hold less than top_p of the
    # mass needs tokens past the prefilter: retry it with a wider topk, then
    # with a full sort. Top-k rows never need this (their k are all in).
    short = p_on & (covered < top_p)
    if kk is not None:
        short &= ~k_on
    width = k_pref
    for wider in (TOP_P_WIDER, v):
        if width >= v or not bool(short.any()):
            break
        if min(wider, v) <= width:
            continue
        width = min(wider, v)
        fb = short.nonzero().squeeze(1)
        lf = ls.index_select(0, fb)
        if width == v:
            vals_f = torch.sort(lf, dim=-1, descending=True).values
        else:
            vals_f = torch.topk(lf, width, dim=-1).values
        n_keep, covered = _nucleus_size(cand_weights(vals_f, fb), total[fb], top_p[fb])
        thr[fb] = vals_f.gather(1, (n_keep - 1).unsqueeze(1)).squeeze(1)
        short = torch.zeros_like(short)
        short[fb] = covered < top_p[fb]
    return _scatter_rows(thr, sub, rows_all)


def _scatter_rows(thr: torch.Tensor, rows: torch.Tensor | None, n: int) -> torch.Tensor:
    if rows is None:
        return thr
    full = torch.full((n,), -math.inf, device=thr.device)
    full[rows] = thr
    return full


def _nucleus_size(
    weights: torch.Tensor, total: torch.Tensor, top_p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-p cut over descending candidates: (tokens kept, mass the candidates hold).

    A token is kept when the mass ranked above it is < top_p (vLLM's rule:
    the smallest prefix reaching top_p, at least one token). The count is exact
    whenever the candidates' mass reaches top_p.
    """
    # float64 running sum: over thousands of tail tokens float32 drifts by ~1e-5,
    # more than a tail token's probability at top_p near 1.
    probs = weights.double() / total.double().unsqueeze(1)
    csum = probs.cumsum(dim=-1)
    n_keep = ((csum - probs) < top_p.double().unsqueeze(1)).sum(-1).clamp_(min=1)
    return n_keep, csum[:, -1].float()


def _gather_logprobs(
    raw: torch.Tensor, sampled: torch.Tensor, meta: SamplingMetadata
) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, K+1] logprobs and ids: the sampled token, then the top-K (raw logits)."""
    k = meta.max_num_logprobs
    assert k is not None
    rows = meta.logprob_rows
    src = raw if rows is None else raw.index_select(0, rows)
    tok = sampled if rows is None else sampled.index_select(0, rows)
    lp = torch.log_softmax(src.float(), dim=-1)
    lps = [lp.gather(1, tok.unsqueeze(1))]
    ids = [tok.unsqueeze(1)]
    if k > 0:
        top = torch.topk(lp, min(k, lp.shape[1]), dim=-1)
        lps.append(top.values)
        ids.append(top.indices)
    out_lp = torch.cat(lps, 1)
    out_ids = torch.cat(ids, 1)
    if rows is None:
        return out_lp, out_ids
    b = meta.num_rows
    full_lp = torch.full((b, out_lp.shape[1]), math.nan, device=raw.device)
    full_ids = torch.full((b, out_ids.shape[1]), -1, dtype=torch.long, device=raw.device)
    full_lp[rows] = out_lp
    full_ids[rows] = out_ids
    return full_lp, full_ids
