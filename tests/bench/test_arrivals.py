"""The arrival schedule: Gamma gaps (Poisson at burstiness 1), vLLM's rescaling, and a runner
that sends each request when the schedule says."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from tandem.entrypoints.cli import main
from tandem.tools.bench.runner import arrival_times
from tests.bench.conftest import FakePlan


def _gaps(times: np.ndarray) -> np.ndarray:
    return np.diff(np.concatenate([[0.0], times]))


def test_poisson_gaps_are_exponential():
    n, rate = 4000, 4.0
    gaps = _gaps(arrival_times(n, rate, 1.0, np.random.default_rng(7)))
    # Kolmogorov-Smirnov against Exp(rate): D < 1.63/sqrt(n) is the 1% critical value.
    x = np.sort(gaps)
    cdf = 1 - np.exp(-rate * x)
    d = max(np.max(np.arange(1, n + 1) / n - cdf), np.max(cdf - np.arange(n) / n))
    assert d < 1.63 / math.sqrt(n)
    # ...and not, say, uniform gaps of the same mean (the test can tell them apart).
    u = np.sort(np.random.default_rng(7).uniform(0, 2 / rate, n))
    cdf_u = 1 - np.exp(-rate * u)
    assert np.max(np.abs(np.arange(1, n + 1) / n - cdf_u)) > 1.63 / math.sqrt(n)


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_gamma_gaps_have_mean_one_over_rate_and_cv_one_over_sqrt_b(burstiness):
    n, rate = 4000, 2.5
    times = arrival_times(n, rate, burstiness, np.random.default_rng(11))
    gaps = _gaps(times)
    # vLLM rescales so the last request goes out at exactly n / rate.
    assert times[-1] == pytest.approx(n / rate)
    assert gaps.mean() == pytest.approx(1 / rate)
    cv = gaps.std() / gaps.mean()
    assert cv == pytest.approx(1 / math.sqrt(burstiness), rel=0.08)
    assert np.all(gaps >= 0)


def test_schedule_is_reproducible_per_seed_and_inf_means_all_at_once():
    a = arrival_times(50, 3.0, 1.0, np.random.default_rng(1))
    b = arrival_times(50, 3.0, 1.0, np.random.default_rng(1))
    c = arrival_times(50, 3.0, 1.0, np.random.default_rng(2))
    assert np.array_equal(a, b) and not np.allclose(a, c)
    assert np.array_equal(arrival_times(5, math.inf, 1.0, np.random.default_rng(0)),
                          np.zeros(5))
    assert np.allclose(_gaps(arrival_times(4, 2.0, math.inf, np.random.default_rng(0))), 0.5)
    for bad in (0.0, -1.0, math.nan):
        with pytest.raises(ValueError, match="request-rate"):
            arrival_times(3, bad, 1.0, np.random.default_rng(0))
    with pytest.raises(ValueError, match="burstiness"):
        arrival_times(3, 1.0, 0.0, np.random.default_rng(0))


def test_the_runner_sends_each_request_on_schedule(fake_server, tmp_path):
    """Start times in the saved result follow the seed's schedule to within a few ms."""
    url = fake_server(FakePlan(tokens=2))
    seed, n, rate = 5, 12, 25.0
    assert main(["bench", "serve", "--base-url", url, "--skip-tokenizer-init", "--num-prompts",
                 str(n), "--request-rate", str(rate), "--random-input-len", "4", "--output-len",
                 "2", "--seed", str(seed), "--disable-tqdm", "--save-result", "--save-detailed",
                 "--no-plots", "--result-dir", str(tmp_path), "--result-filename", "s.json"]) == 0
    result = json.loads((tmp_path / "s.json").read_text())
    expected = arrival_times(n, rate, 1.0, np.random.default_rng([seed, 1]))
    sent = np.asarray(result["start_times"])
    assert result["completed"] == n and result["request_rate"] == rate
    assert np.all(sent >= expected - 1e-3)  # never early
    assert np.max(sent - expected) < 0.05  # and on time (event loop latency only)
