"""The CPU token budget from measured step costs (cpu_token_budgets), run on
scripted costs: a model whose n-token step takes t1 + c (n - 1), quiet or
beside a neighbour's bursts."""

from __future__ import annotations

import itertools

from tandem.engine.llm_engine import CPU_BUDGET_RANGE, PREFILL_READ_SHARE, cpu_token_budgets

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
