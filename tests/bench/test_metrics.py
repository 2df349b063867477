"""vLLM's metric definitions on hand-made requests whose every number is known."""

from __future__ import annotations

import pytest

from tandem.tools.bench.client import RequestResult
from tandem.tools.bench.metrics import (
    calculate_metrics,
    in_flight_timeline,
    parse_goodput,
    parse_percentile_metrics,
    parse_percentiles,
    percentile_key,
)
from tandem.tools.bench.report import build_result, format_table, strip_detailed

# The keys `vllm bench serve` writes (benchmark() + main_async(); per-request lists only
# with --save-detailed), for --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 99.
VLLM_KEYS = {
    "date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts",
    "request_rate", "burstiness", "max_concurrency", "duration", "completed", "failed",
    "total_input_tokens", "total_output_tokens", "request_throughput", "request_goodput",
    "output_throughput", "total_token_throughput", "max_output_tokens_per_s",
    "max_concurrent_requests",
} | {f"{s}_{m}_ms" for s in ("mean", "median", "std", "p99")
     for m in ("ttft", "tpot", "itl", "e2el")}
VLLM_DETAILED_KEYS = {"input_lens", "output_lens", "ttfts", "itls", "latencies", "start_times",
                      "queue_times", "generated_texts", "errors"}


def _results() -> list[RequestResult]:
    return [
        # 4 tokens at 0.10, 0.15, 0.20, 0.30 s: TPOT = (0.3 - 0.1) / 3
        RequestResult("a", True, "", 10, 4, 0.10, [0.05, 0.05, 0.10], 0.30, 0.0),
        # 2 tokens at 0.75 and 1.25 s: TPOT = 0.5
        RequestResult("b", True, "", 20, 2, 0.25, [0.50], 0.75, 0.5),
        # 1 token at 1.05 s: no TPOT (0 for goodput, as in vLLM)
        RequestResult("c", True, "", 5, 1, 0.05, [], 0.05, 1.0),
        RequestResult("d", False, "HTTP 503: busy", 7, 0, 0.0, [], 0.0, 0.2),
    ]


def test_throughputs_latencies_and_peaks():
    m, out_lens = calculate_metrics(_results(), 2.0, [50, 99], {})
    assert (m.completed, m.failed, m.total_input, m.total_output) == (3, 1, 35, 7)
    assert out_lens == [4, 2, 1, 0]
    assert m.request_throughput == 1.5
    assert m.output_throughput == 3.5 and m.total_token_throughput == 21.0
    assert m.request_goodput == 0.0
    ttft = m.stats["ttft"]
    assert ttft["mean"] == pytest.approx(400 / 3) and ttft["median"] == pytest.approx(100)
    assert ttft["p99"] == pytest.approx(100 + 0.98 * 150)  # numpy's linear interpolation
    assert ttft["std"] == pytest.approx(((100 - 400 / 3) ** 2 + (250 - 400 / 3) ** 2
                                         + (50 - 400 / 3) ** 2) ** 0.5 / 3 ** 0.5)
    assert m.stats["tpot"]["mean"] == pytest.approx((200 / 3 + 500) / 2)  # c has no TPOT
    assert m.stats["itl"]["mean"] == pytest.approx(175) and m.stats["itl"]["median"] == 75
    assert m.stats["e2el"]["mean"] == pytest.approx(1100 / 3)
    # Token arrivals: 5 in the first second (a's 4 + b's first), 2 in the next.
    assert m.max_output_tokens_per_s == 5
    # a [0, 0.3), b [0.5, 1.25), c [1.0, 1.05): b and c overlap.
    assert m.max_concurrent_requests == 2


@pytest.mark.parametrize(("slos", "good"), [
    ({"ttft": 200}, 2),                 # a (100 ms) and c (50 ms)
    ({"ttft": 200, "tpot": 60}, 1),     # a's TPOT is 66.7 ms; c's counts as 0
    ({"tpot": 500}, 3),                 # b's is exactly 500: SLOs are inclusive
    ({"e2el": 300}, 2),                 # a (300 ms, inclusive) and c
    ({"ttft": 10}, 0),
])
def test_goodput_counts_requests_meeting_every_slo(slos, good):
    m, _ = calculate_metrics(_results(), 2.0, [99], slos)
    assert m.request_goodput == good / 2.0


def test_parsers_reject_bad_input_with_the_flag_name():
    assert parse_goodput(["ttft:500", "tpot:50.5"]) == {"ttft": 500.0, "tpot": 50.5}
    for bad in (["itl:5"], ["ttft=5"], ["ttft:-1"], ["ttft:x"]):
        with pytest.raises(ValueError, match="--goodput"):
            parse_goodput(bad)
    assert parse_percentiles("50, 95,99.9") == [50.0, 95.0, 99.9]
    with pytest.raises(ValueError, match="--metric-percentiles"):
        parse_percentiles("101")
    with pytest.raises(ValueError, match="--percentile-metrics"):
        parse_percentile_metrics("ttft,latency")
    assert [percentile_key(p) for p in (99, 99.9, 50.0)] == ["p99", "p99.9", "p50"]


def _result(percentile_metrics=("ttft", "tpot", "itl", "e2el")) -> dict:
    results = _results()
    m, out_lens = calculate_metrics(results, 2.0, [99], {"ttft": 200})
    config = {"backend": "openai", "model_id": "m", "num_prompts": 4, "request_rate": 4.0,
              "max_concurrency": 2}
    return build_result(config=config, results=results, duration=2.0, origin=0.0, metrics=m,
                        output_lens=out_lens, percentile_metrics=list(percentile_metrics),
                        goodput={"ttft": 200}, server=None)


def test_json_has_vllms_keys_and_strips_per_request_lists_like_vllm():
    result = _result()
    assert VLLM_KEYS | VLLM_DETAILED_KEYS <= set(result)
    assert result["request_rate"] == 4.0 and result["request_goodput"] == 1.0
    assert result["errors"] == ["", "", "", "HTTP 503: busy"]
    short = strip_detailed(result)
    assert VLLM_KEYS <= set(short) and not VLLM_DETAILED_KEYS & set(short)
    # Only the selected metrics get statistics (as vLLM's process_one_metric).
    assert "mean_e2el_ms" not in _result(["ttft"])


def test_table_uses_vllms_layout():
    lines = format_table(_result(), ["ttft", "e2el"], [99]).splitlines()
    assert lines[0] == "{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")
    assert "{:<40} {:<10}".format("Successful requests:", 3) in lines
    assert "{:<40} {:<10}".format("Failed requests:", 1) in lines
    assert "{:<40} {:<10}".format("Maximum request concurrency:", 2) in lines
    assert "{:<40} {:<10.2f}".format("Request goodput (req/s):", 1.0) in lines
    assert "{:<40} {:<10.2f}".format("Mean TTFT (ms):", 400 / 3) in lines
    assert "{s:{c}^{n}}".format(s="End-to-end Latency", n=50, c="-") in lines
    assert not any("TPOT" in line for line in lines)
    assert lines[-1] == "=" * 50


def test_in_flight_timeline_counts_failed_requests_too():
    rs = _results()
    for r in rs:
        r.end_time = r.start_time + max(r.latency, 0.1)
    t, n = in_flight_timeline(rs, 0.0)
    assert n.max() == 2 and n[-1] == 0 and len(t) == 8
