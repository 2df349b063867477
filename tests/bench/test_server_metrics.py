"""/metrics parsing, before/after deltas and Prometheus-style histogram quantiles."""

from __future__ import annotations

import math

import pytest

from tandem.tools.bench.server_metrics import Histogram, Snapshot, summarize

BEFORE = """\
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="m"} 1.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.5",model_name="m"} 2.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="m"} 2.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 2.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 0.35
vllm:num_preemptions_total{engine="0",model_name="m"} 3.0
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 100.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 10.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.0
vllm:num_requests_running{engine="0",model_name="m"} 0.0
"""

AFTER = """\
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="m"} 1.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.5",model_name="m"} 6.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="m"} 12.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 12.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 10.35
vllm:num_preemptions_total{engine="0",model_name="m"} 5.0
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 300.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 160.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.1
vllm:num_requests_running{engine="0",model_name="m"} 1.0
"""


def _poll(kv: float, running: float, t: float) -> Snapshot:
    return Snapshot.parse(f'vllm:kv_cache_usage_perc{{model_name="m"}} {kv}\n'
                          f'vllm:num_requests_running{{model_name="m"}} {running}\n', t)


def test_deltas_rates_and_peaks():
    before, after = Snapshot.parse(BEFORE, 10.0), Snapshot.parse(AFTER, 20.0)
    polls = [_poll(0.2, 3, 11.0), _poll(0.7, 8, 12.0), after]
    s = summarize(before, after, polls, origin=10.0, percentiles=[50, 99])
    assert s["num_ttft_observations"] == 10
    assert s["mean_ttft_ms"] == pytest.approx(1000.0)  # (10.35 - 0.35) / 10 s
    # 10 new observations: 0 in (0, 0.1], 4 in (0.1, 0.5], 6 above 0.5 (+Inf).
    assert s["p50_ttft_ms"] == pytest.approx(500.0)  # rank 5 > 4: the +Inf bucket -> 0.5
    assert s["num_preemptions"] == 2
    assert (s["prefix_cache_queries"], s["prefix_cache_hits"]) == (200, 150)
    assert s["prefix_cache_hit_rate"] == 0.75
    assert s["peak_kv_cache_usage"] == 0.7 and s["peak_num_requests_running"] == 8
    assert s["timeline"]["t"] == [1.0, 2.0, 10.0]
    assert "mean_itl_ms" not in s  # absent in the scrape: not reported, not invented


def test_histogram_quantile_interpolates_within_the_bucket():
    h = Histogram([(0.1, 2.0), (0.2, 6.0), (0.4, 10.0), (math.inf, 10.0)], 1.5, 10.0)
    assert h.quantile(0.1) == pytest.approx(0.05)  # rank 1 of 2 in (0, 0.1]
    assert h.quantile(0.5) == pytest.approx(0.175)  # rank 5: 3 of 4 into (0.1, 0.2]
    assert h.quantile(1.0) == pytest.approx(0.4)
    assert math.isnan(Histogram([(math.inf, 0.0)], 0.0, 0.0).quantile(0.5))


def test_older_vllm_names_and_targets_without_vllm_names():
    old = Snapshot.parse('vllm:gpu_cache_usage_perc{model_name="m"} 0.25\n'
                         'vllm:time_per_output_token_seconds_count{model_name="m"} 4\n'
                         'vllm:time_per_output_token_seconds_sum{model_name="m"} 0.2\n')
    s = summarize(Snapshot(), old, [old], 0.0, [99])
    assert s["peak_kv_cache_usage"] == 0.25
    assert s["mean_itl_ms"] == pytest.approx(50.0)
    assert not Snapshot.parse("process_cpu_seconds_total 3.5\n").has_vllm_names
