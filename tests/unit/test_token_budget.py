"""The CPU token budget from measured step costs (cpu_token_budgets), run on
scripted costs: a model whose n-token step takes t1 + c (n - 1), quiet or
beside a neighbour's bursts."""

from __future__ import annotations

import itertools

import pytest

from tandem.engine.token_budget import (
    CHUNK_MIN,
    CPU_BUDGET_RANGE,
    ITL_BOUND,
    PREFILL_READ_SHARE,
    ChunkTuner,
    cpu_token_budgets,
)

T1, C = 0.020, 0.0015  # a 1B model on 2 cores: weights 20 ms, 1.5 ms a further token
CHUNK = 26  # (ITL_BOUND - 1) x T1 / C: a chunk adds at most 2 single-stream steps


def model(n: int) -> float:
    return T1 + C * (n - 1)


def test_a_quiet_machine_measures_the_model():
    total, chunk, t1, c = cpu_token_budgets(model, max_num_seqs=16)
    assert t1 == T1 and abs(c - C) < 1e-12 and chunk == CHUNK
    assert total == int(1 + PREFILL_READ_SHARE * T1 / C) == 107


def test_a_neighbour_on_every_step_scales_both_costs_alike():
    total, chunk, t1, c = cpu_token_budgets(lambda n: 2 * model(n), max_num_seqs=16)
    assert t1 == 2 * T1 and chunk == CHUNK and total == 107


def test_a_burst_over_the_first_probes_is_outrun():
    """Both sizes alternate: a burst over the first probes slows each size's
    first runs only, and each keeps its quickest."""
    calls = itertools.count()
    total, chunk, t1, _ = cpu_token_budgets(
        lambda n: model(n) * (20 if next(calls) < 6 else 1), max_num_seqs=16)
    assert (t1, chunk, total) == (T1, CHUNK, 107)


def test_slowed_one_token_probes_cannot_make_prompts_free():
    """Every 1-token probe slowed 20x while the longer ones ran quiet read c as
    0 and gave the largest chunk: 2,048 tokens, 3 s of compute that every
    running stream waited through. A 1-token step is never taken as slower
    than a longer one, and the chunk found, run once, corrects c."""
    _, chunk, t1, c = cpu_token_budgets(lambda n: model(n) * (20 if n == 1 else 1), 16)
    assert t1 == model(32) and c > 0.9 * C
    assert chunk < CPU_BUDGET_RANGE[1] and chunk * C < 0.25


def test_a_cheap_chunk_keeps_the_largest_budget():
    """Where compute is cheap beside reading the weights, the largest chunk
    costs less than its bound, and its check leaves it."""
    _, chunk, _, _ = cpu_token_budgets(lambda n: T1 + 1e-5 * (n - 1), 16)
    assert chunk == CPU_BUDGET_RANGE[1]


def test_the_chunk_check_stays_within_the_models_positions():
    def cost(n: int) -> float:
        assert n <= 100, "past the model's positions"
        return model(n) * (20 if n == 1 else 1)

    _, chunk, _, c = cpu_token_budgets(cost, 16, max_tokens=100)
    assert c > 0.5 * C and chunk * C < 0.25


def test_the_tuner_keeps_mixed_steps_to_the_bound_as_the_prompt_deepens():
    """A decode step of 24 ms beside a 3,000-token prompt whose tokens cost
    1.5 ms each plus their attention to the keys before them: once the decode
    steps have been timed, every mixed step stays within ITL_BOUND decode steps
    (10% slack), though the chunk's price rises as the prompt deepens."""
    d, c, a = 0.024, 0.0015, 2e-7  # a decode step, a prompt token, a key it attends to
    tuner = ChunkTuner(cap=16, decode_s=0.040, most=2048)  # the probe's per-op 1-token step
    for _ in range(20):
        tuner.observe(d, decodes=1, prompt_tokens=0)
    assert abs(tuner.decode_s[1] - d) < 0.001
    pos, worst, caps = 0, 0.0, []
    while pos < 3000:
        n = tuner.cap
        step = d + n * (c + a * (pos + n / 2))
        tuner.observe(step, decodes=1, prompt_tokens=n)
        pos += n
        caps.append(n)
        if len(caps) > 4:  # settled
            worst = max(worst, step / d)
    assert 2.5 < worst <= ITL_BOUND * 1.1
    assert caps[4] > caps[-1] >= CHUNK_MIN  # deeper in the prompt, a chunk costs more


def test_a_prompts_last_tokens_do_not_read_as_free():
    """A step whose prompt part is a token or two costs about what the decodes
    do; read as a price it allowed ~10^4 tokens and sent the cap to the whole
    budget. Such steps price nothing, and the cap at most doubles a step."""
    tuner = ChunkTuner(cap=26, decode_s=0.024, most=1024)
    tuner.observe(0.024, decodes=4, prompt_tokens=0)
    assert tuner.observe(0.0235, decodes=4, prompt_tokens=2) == 26
    assert tuner.observe(0.024, decodes=4, prompt_tokens=13) <= 52  # half the cap, cheap


def test_decodes_are_priced_by_their_own_count():
    """A mixed step with 8 decodes is compared with decode-only steps of 8, not
    of 1: the 7 more decodes are not the prompt's cost."""
    tuner = ChunkTuner(cap=16, decode_s=0.030, most=2048)
    for _ in range(30):
        tuner.observe(0.020, decodes=1, prompt_tokens=0)
        tuner.observe(0.060, decodes=8, prompt_tokens=0)
    for _ in range(10):  # 16 prompt tokens at 2 ms beside 8 decodes: within the bound
        tuner.observe(0.060 + tuner.cap * 0.002, decodes=8, prompt_tokens=tuner.cap)
    assert tuner.cap >= 50  # 2 x 60 ms / 2 ms = 60 allowed; against 1 decode's 20 ms: 4


@pytest.mark.parametrize("timed_alone", [(), (12,), (1,)])
def test_decodes_never_timed_alone_are_priced_from_the_probe(timed_alone):
    """Under a steady load of 16 streams a prompt is always waiting: no step runs
    16 decodes alone. Priced as the probe's 1-token step, the 16 decodes read as
    the prompt's cost and the cap fell to ~5 tokens; priced from the probe's
    per-token cost (scaled to a count timed, if any), mixed steps settle near the
    bound."""
    def alone(d: int) -> float:  # the one-call decode step: a bit under the probe's price
        return 0.018 + (d - 1) * 0.002
    tuner = ChunkTuner(cap=18, decode_s=0.020, most=512, per_token=0.0021)
    for d in timed_alone:
        for _ in range(5):
            tuner.observe(alone(d), decodes=d, prompt_tokens=0)
    for _ in range(15):  # 16 decodes (on the per-op path: 4 ms more) and a chunk at 2 ms a token
        step = alone(16) + 0.004 + 0.002 * tuner.cap
        tuner.observe(step, decodes=16, prompt_tokens=tuner.cap)
    assert tuner.cap >= 35  # was 5
    assert 2.5 < step / alone(16) <= ITL_BOUND * 1.1


def test_the_tuner_keeps_a_floor_and_leaves_prompt_only_steps_alone():
    tuner = ChunkTuner(cap=16, decode_s=0.01, most=64)
    assert tuner.observe(5.0, decodes=0, prompt_tokens=64) == 16  # nobody was waiting
    for _ in range(10):  # even the smallest chunk costs more than the bound allows
        tuner.observe(0.5, decodes=2, prompt_tokens=tuner.cap)
    assert tuner.cap == CHUNK_MIN
    tuner.observe(0.01, decodes=2, prompt_tokens=0)
    for _ in range(20):  # cheap again: back up to the budget, not past it
        tuner.observe(0.011, decodes=2, prompt_tokens=tuner.cap)
    assert tuner.cap == 64
