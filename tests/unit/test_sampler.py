"""Sampler: exactness of the filters and the race, seeds, penalties, logprobs.

The references here are the straightforward versions (full sort, softmax,
per-token loops) that the sampler avoids for speed.
"""

from __future__ import annotations

import math

import pytest
import torch

from tandem.sampling_params import SamplingParams
from tandem.worker import sampler as sampler_mod
from tandem.worker.sampler import BLOCK, Sampler, blocked_argmax
from tandem.worker.sampling_metadata import SamplingMetadata

EOS = 2


def make_meta(params, logits, *, gens=None, prompts=None, outputs=None, eos=(EOS,)):
    b, v = logits.shape
    return SamplingMetadata.build(
        params,
        gens if gens is not None else [None] * b,
        prompts if prompts is not None else [[] for _ in range(b)],
        outputs if outputs is not None else [[] for _ in range(b)],
        eos,
        v,
        "cpu",
    )


def sample(params, logits, **kw):
    return Sampler()(logits, make_meta(params, logits, **kw))


def reference_allowed(row: torch.Tensor, p: SamplingParams, tol: float = 0.0):
    """Tokens top-k -> top-p -> min-p keep, by full sort in float64.

    With tol > 0, also returns the tokens within tol of a top-p / min-p cut: the
    sampler works on float32 logits, so those may legitimately go either way.
    """
    x = row.double() / p.temperature
    v = x.shape[0]
    order = torch.argsort(x, descending=True)
    keep_sorted = torch.ones(v, dtype=torch.bool)
    near = torch.zeros(v, dtype=torch.bool)
    if 0 < p.top_k < v:
        keep_sorted[p.top_k :] = False
    xs = x[order]
    if p.top_p < 1.0:
        probs = torch.softmax(xs.masked_fill(~keep_sorted, -math.inf), 0)
        excl = torch.cumsum(probs, 0) - probs
        nucleus = excl < p.top_p
        nucleus[0] = True
        near |= (excl - p.top_p).abs() < tol
        keep_sorted &= nucleus
    if p.min_p > 0.0:
        probs = torch.softmax(xs.masked_fill(~keep_sorted, -math.inf), 0)
        keep_sorted &= probs >= p.min_p * probs[0]
        near |= (probs / probs[0] - p.min_p).abs() < tol
    mask = torch.zeros(v, dtype=torch.bool)
    mask[order[keep_sorted]] = True
    if not tol:
        return mask
    ambiguous = torch.zeros(v, dtype=torch.bool)
    ambiguous[order[near]] = True
    return mask, ambiguous


def allowed_by_sampler(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The sampler's own kept set (its raw-logit threshold), for exact comparison."""
    meta = make_meta(params, logits)
    temp = meta.temperature.unsqueeze(1)
    row_max = logits.amax(-1, keepdim=True)
    weights = ((logits - row_max) / temp).exp()
    thr = torch.full((logits.shape[0],), -math.inf)
    if meta.top_k is not None or meta.top_p is not None:
        thr = sampler_mod._top_k_top_p_threshold(logits, weights, row_max, meta)
    if meta.min_p is not None:
        thr = torch.maximum(thr, (row_max + temp * torch.log(meta.min_p).unsqueeze(1)).squeeze(1))
    return logits >= thr.unsqueeze(1)


# -- greedy ------------------------------------------------------------------


@pytest.mark.parametrize("v", [7, 2 * BLOCK, 3 * BLOCK + 17, 49152])
def test_greedy_is_argmax(v):
    torch.manual_seed(0)
    logits = torch.randn(9, v)
    # Ties: the first index must win, as torch.argmax does.
    logits[1, :] = 0.0
    logits[2, [5, v - 1]] = 100.0
    logits[3, v - 1] = 100.0
    out = sample([SamplingParams(temperature=0.0)] * 9, logits)
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    assert torch.equal(blocked_argmax(logits), logits.argmax(-1))
    assert out.logprobs is None and out.logprob_token_ids is None


def test_top_k_1_is_greedy():
    torch.manual_seed(1)
    logits = torch.randn(32, 3000) * 3
    out = sample([SamplingParams(temperature=1.3, top_k=1)] * 32, logits)
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))


def test_mixed_greedy_and_random_rows():
    torch.manual_seed(2)
    logits = torch.randn(6, 1000)
    logits[:, 17] += 50.0  # every random row samples 17 with probability ~1
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8)] * 3
    out = sample(params, logits)
    for i in range(0, 6, 2):
        assert out.sampled_token_ids[i] == 17
        assert out.sampled_token_ids[i + 1] == 17
    logits[0, 3] = 100.0
    assert sample(params, logits).sampled_token_ids[0] == 3


# -- filters: exact kept sets ------------------------------------------------


FILTER_CASES = [
    dict(top_k=50),
    dict(top_k=5, temperature=0.5),
    dict(top_p=0.9),
    dict(top_p=0.3, temperature=2.0),
    dict(top_p=0.95, top_k=200),
    dict(min_p=0.05),
    dict(top_k=100, top_p=0.8, min_p=0.02),
    dict(top_p=0.999, temperature=0.7),
]


@pytest.mark.parametrize("scale", [0.5, 3.0, 8.0])
def test_kept_sets_match_full_sort_reference(scale, monkeypatch):
    """Exact, whatever the prefilter: peaked rows (scale 8) fit in the first topk,
    medium ones (3) need the wider topk, flat ones (0.5) the full sort."""
    widths: list[int] = []
    sorts: list[int] = []
    topk, sort = torch.topk, torch.sort

    def spy_topk(x, k, *a, **kw):
        widths.append(k)
        return topk(x, k, *a, **kw)

    def spy_sort(x, *a, **kw):
        sorts.append(x.shape[0])
        return sort(x, *a, **kw)

    monkeypatch.setattr(torch, "topk", spy_topk)
    monkeypatch.setattr(torch, "sort", spy_sort)
    torch.manual_seed(3)
    v = 12000
    params = [SamplingParams(**c) for c in FILTER_CASES] * 3
    params.insert(4, SamplingParams(temperature=1.0))  # an unfiltered row in between
    logits = torch.randn(len(params), v) * scale
    got = allowed_by_sampler(logits, params)
    monkeypatch.undo()
    for i, p in enumerate(params):
        ref, ambiguous = reference_allowed(logits[i], p, tol=2e-6)
        differ = (got[i] != ref) & ~ambiguous
        assert not differ.any(), (i, p, int(got[i].sum()), int(ref.sum()))
        assert int(ambiguous.sum()) <= 5
    assert widths[0] == sampler_mod.TOP_P_PREFILTER
    assert (sampler_mod.TOP_P_WIDER in widths) == (scale < 8.0)
    assert bool(sorts) == (scale == 0.5)


@pytest.mark.parametrize("scale", [0.5, 4.0])
def test_sampled_tokens_stay_in_kept_set(scale):
    torch.manual_seed(4)
    v = 4 * BLOCK + 100  # a tail block too
    params = [SamplingParams(**c) for c in FILTER_CASES] * 8
    logits = torch.randn(len(params), v) * scale
    allowed = torch.stack([reference_allowed(logits[i], p) for i, p in enumerate(params)])
    for _ in range(20):
        ids = sample(params, logits).sampled_token_ids
        assert allowed[torch.arange(len(params)), ids].all()


# -- the race: distribution ---------------------------------------------------


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum()
    expected = probs * n
    return float(((counts - expected) ** 2 / expected).sum())


def categories(v: int, heavy: list[int]) -> torch.Tensor:
    """Map tokens to categories: each heavy token alone, the rest lumped together."""
    cat = torch.full((v,), len(heavy), dtype=torch.long)
    cat[heavy] = torch.arange(len(heavy))
    return cat


@pytest.mark.parametrize(
    "kw",
    [dict(temperature=1.0), dict(temperature=0.7), dict(temperature=1.0, top_k=4)],
)
def test_empirical_distribution_matches_softmax(kw):
    torch.manual_seed(5)
    v = 3 * BLOCK + 40
    heavy = [3, 300, 301, 700, v - 1, v - 30]  # several blocks and the tail block
    logits = torch.randn(v) * 0.3
    logits[heavy] = torch.tensor([2.0, 1.5, 1.0, 2.5, 0.5, 1.8])
    p = SamplingParams(**kw)
    probs = torch.softmax(logits.double() / p.temperature, 0)
    if p.top_k:
        probs[~reference_allowed(logits, p)] = 0.0
        probs /= probs.sum()
    cat = categories(v, heavy)
    cat_probs = torch.zeros(len(heavy) + 1, dtype=torch.float64).index_add_(0, cat, probs)
    n_rows, rounds = 4000, 5
    counts = torch.zeros(len(heavy) + 1, dtype=torch.float64)
    batch = logits.expand(n_rows, v).contiguous()
    for _ in range(rounds):
        ids = sample([p] * n_rows, batch).sampled_token_ids
        counts += torch.bincount(cat[ids], minlength=len(heavy) + 1).double()
    keep = cat_probs > 0
    if p.top_k:
        assert counts[~keep].sum() == 0
    # 6-7 degrees of freedom: P(chi2 > 30) < 1e-4; seeds are fixed, so no flakes.
    assert chi_square(counts[keep], cat_probs[keep]) < 30.0


def test_tiny_vocabulary_distribution():
    """V < BLOCK: the whole vocabulary is one partial block."""
    torch.manual_seed(10)
    logits = torch.tensor([[0.5, -1.0, 2.0, 0.0, 1.0]]).expand(20000, 5).contiguous()
    ids = sample([SamplingParams(temperature=1.0)] * 20000, logits).sampled_token_ids
    counts = torch.bincount(ids, minlength=5).double()
    assert chi_square(counts, torch.softmax(logits[0].double(), 0)) < 25.0


# -- seeds --------------------------------------------------------------------


def test_same_seed_same_tokens_alone_or_in_batch():
    torch.manual_seed(6)
    v, steps = 2 * BLOCK + 77, 12
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)
    row_logits = [torch.randn(v) * 2 for _ in range(steps)]

    def run(batch_params, others_scale):
        gens = [
            torch.Generator().manual_seed(p.seed) if p.seed is not None else None
            for p in batch_params
        ]
        out = []
        for s in range(steps):
            logits = torch.randn(len(batch_params), v) * others_scale
            logits[0] = row_logits[s]
            ids = sample(batch_params, logits, gens=gens).sampled_token_ids
            out.append(int(ids[0]))
        return out

    alone = run([seeded], 1.0)
    others = [
        SamplingParams(temperature=0.7, seed=99),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_k=300),  # widens the prefilter
        SamplingParams(temperature=1.0, top_p=0.5, seed=7),
    ]
    crowded = run([seeded, *others], 0.3)  # flat rows: top-p fallback in the batch
    assert alone == crowded
    assert len(set(alone)) > 3  # it did sample, not collapse to argmax


def test_seed_reproducible_and_greedy_does_not_advance_generator():
    torch.manual_seed(7)
    logits = torch.randn(1, 500)
    p = SamplingParams(temperature=1.0, seed=5)

    def run(seed):
        g = torch.Generator().manual_seed(seed)
        return [int(sample([p], logits, gens=[g]).sampled_token_ids) for _ in range(8)]

    assert run(5) == run(5)
    assert run(5) != run(6)
    g = torch.Generator().manual_seed(5)
    state = g.get_state()
    sample([SamplingParams(temperature=0.0, seed=5)], logits, gens=[g])
    assert torch.equal(g.get_state(), state)


# -- penalties and min_tokens -----------------------------------------------------


def reference_penalties(row, prompt, output, p):
    row = row.clone().double()
    counts = [0] * row.shape[0]
    for t in output:
        counts[t] += 1
    for t in range(row.shape[0]):
        if t in prompt or counts[t] > 0:
            rp = p.repetition_penalty
            row[t] = row[t] / rp if row[t] > 0 else row[t] * rp
        row[t] -= p.frequency_penalty * counts[t]
        row[t] -= p.presence_penalty * (1.0 if counts[t] > 0 else 0.0)
    return row.float()


def test_penalties_match_reference_formula():
    torch.manual_seed(8)
    v = 300
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.3),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, frequency_penalty=0.7, presence_penalty=-0.4),
        SamplingParams(
            temperature=0.0, repetition_penalty=0.8, frequency_penalty=-1.1, presence_penalty=1.5
        ),
    ]
    prompts = [[1, 5, 5, 9], [3, 4], [7, 7, 8], [0, 299, 150]]
    outputs = [[5, 6, 6, 6, 10], [4, 4], [8, 8, 8, 11, 7], [150, 151, 151, 299]]
    logits = torch.randn(4, v) * 3
    meta = make_meta(params, logits, prompts=prompts, outputs=outputs)
    assert not meta.no_penalties
    assert set(meta.repetition_pairs[0].tolist()) == {0, 3}  # only rows that use it
    assert set(meta.output_pairs[0].tolist()) == {2, 3}
    got = Sampler._process_logits(logits, meta)
    for i, p in enumerate(params):
        ref = reference_penalties(logits[i], prompts[i], outputs[i], p)
        torch.testing.assert_close(got[i], ref)
    # Greedy then picks the argmax of the penalised logits.
    out = Sampler()(logits, meta).sampled_token_ids
    assert torch.equal(out, got.argmax(-1))


def test_no_penalties_builds_nothing():
    logits = torch.randn(3, 100)
    meta = make_meta([SamplingParams()] * 3, logits, outputs=[[1, 2]] * 3)
    assert meta.no_penalties and meta.output_pairs is None and meta.repetition_pairs is None
    assert meta.min_tokens_mask is None
    assert meta.top_k is None and meta.top_p is None and meta.min_p is None


def test_min_tokens_masks_every_eos_and_stop_token_ids():
    v = 50
    logits = torch.zeros(4, v)
    logits[:, EOS] = 100.0
    logits[:, 3] = 95.0  # a second end-of-generation id (<|endoftext|> beside <|im_end|>)
    logits[:, 7] = 90.0
    logits[:, 9] = 80.0
    params = [
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[7]),
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[7]),
        SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True),  # vLLM masks EOS too
        SamplingParams(temperature=1.0, min_tokens=2),
    ]
    outputs = [[1, 1], [1, 1, 1], [], [5]]
    out = sample(params, logits, outputs=outputs, eos=(EOS, 3)).sampled_token_ids.tolist()
    assert out[0] == 9  # both EOS ids and stop id 7 masked: 2 < 3 tokens so far
    assert out[1] == EOS  # min_tokens reached
    assert out[2] == 7
    assert out[3] == 7


def test_masked_tokens_weigh_exactly_zero_at_any_temperature(monkeypatch):
    """Logits are floored before exp (its denormal results are slow), so masked
    -inf entries must be zeroed again: a min_tokens EOS and a grammar-banned
    token stay at probability exactly 0 at low temperature, where most of the
    row sits below the floor."""
    seen = []
    race = sampler_mod._hierarchical_race
    monkeypatch.setattr(sampler_mod, "_hierarchical_race",
                        lambda w, g, d=None: seen.append(w.clone()) or race(w, g, d))
    v = 3 * BLOCK
    logits = torch.randn(2, v) * 20
    logits[:, EOS] = 500.0  # the best logit in both rows, and masked in both
    params = [SamplingParams(temperature=0.05, min_tokens=1),
              SamplingParams(temperature=0.05, top_p=0.9)]
    meta = make_meta(params, logits.clone())
    allow = torch.ones(1, v // 32, dtype=torch.int32) * -1  # every bit set: all allowed
    allow[0, 0] &= ~(1 << EOS)
    meta.grammar_mask = (torch.tensor([1]), allow)
    out = Sampler()(logits.clone(), meta).sampled_token_ids.tolist()
    weights = seen[0]
    assert (weights[:, EOS] == 0).all() and EOS not in out
    assert (weights.amax(-1) == 1).all()  # the best allowed token
    assert (weights[weights > 0] >= math.exp(sampler_mod.EXP_FLOOR) * 0.99).all()


# -- logprobs ---------------------------------------------------------------------


def test_logprobs_columns():
    torch.manual_seed(9)
    v = 1000
    logits = torch.randn(4, v) * 2
    params = [
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=1.0, logprobs=0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.0, logprobs=5, repetition_penalty=2.0),
    ]
    out = sample(params, logits, prompts=[[], [], [], [int(logits[3].argmax())]])
    assert out.logprobs.shape == (4, 6) and out.logprob_token_ids.shape == (4, 6)
    ref = torch.log_softmax(logits, -1)  # raw logits: before penalties and temperature
    for i in (0, 1, 3):
        tok = int(out.sampled_token_ids[i])
        assert out.logprob_token_ids[i, 0] == tok
        torch.testing.assert_close(out.logprobs[i, 0], ref[i, tok])
        top = torch.topk(ref[i], 5)
        assert torch.equal(out.logprob_token_ids[i, 1:], top.indices)
        torch.testing.assert_close(out.logprobs[i, 1:], top.values)
    assert torch.isnan(out.logprobs[2]).all() and (out.logprob_token_ids[2] == -1).all()
    assert out.sampled_token_ids[3] != logits[3].argmax()  # penalised, logprobs raw


def test_sampling_params_validation():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=-1)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=4)
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=-2)
    with pytest.raises(ValueError, match="min_p"):
        SamplingParams(min_p=1.5)
    with pytest.raises(ValueError, match="presence_penalty"):
        SamplingParams(presence_penalty=2.5)
    for rp in (0.0, 1e-300, 1e300):  # 1e-300 is 0 in the sampler's float32
        with pytest.raises(ValueError, match="repetition_penalty"):
            SamplingParams(repetition_penalty=rp)
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=["ok", ""])
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=1.5)
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=-1)
    with pytest.raises(ValueError, match="n must"):
        SamplingParams(n=0)
    p = SamplingParams(stop="x", stop_token_ids=None, max_tokens=None, temperature=0, top_k=5)
    assert p.stop == ["x"] and p.stop_token_ids == [] and p.greedy and p.top_k == 0
    assert not SamplingParams().greedy


@pytest.mark.parametrize("temperature", [1.0, 0.05])
def test_exp_weights_kernel_matches_torch_path(temperature, monkeypatch):
    """The CPU kernel and the torch path give the same race weights (float
    rounding apart), masked entries exactly 0, the same row maxima."""
    if not sampler_mod.custom_ops.available():
        pytest.skip("tandem's CPU kernels are not built")
    torch.manual_seed(5)
    logits = torch.randn(3, 1000 + 7) * 15
    logits[0, ::3] = -math.inf
    params = [SamplingParams(temperature=temperature, min_tokens=1)] * 3
    meta = make_meta(params, logits)
    w_kernel, m_kernel = sampler_mod.exp_weights(logits, meta)
    monkeypatch.setattr(sampler_mod.custom_ops, "available", lambda: False)
    w_torch, m_torch = sampler_mod.exp_weights(logits, meta)
    assert torch.equal(m_kernel, m_torch)
    assert torch.equal(w_kernel == 0, w_torch == 0) and bool((w_kernel[0, ::3] == 0).all())
    torch.testing.assert_close(w_kernel, w_torch, rtol=1e-5, atol=0)
