"""``bench serve`` against a real tandem server on the default model, checked against what a
recording proxy saw on the wire (timestamps the benchmark's code never touches)."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from tandem.entrypoints.cli import main
from tests.bench.conftest import API_KEY
from tests.bench.test_metrics import VLLM_DETAILED_KEYS, VLLM_KEYS

# The proxy forwards each event a moment before the benchmark reads it; both share
# this process's 2 cores with the engine, so allow for scheduling noise.
TOL_S = 0.06


@pytest.fixture(scope="module")
def openai_run(real_server, recording_proxy_module, tmp_path_factory):
    """6 random prompts, 2 at a time, one warm-up; the detailed JSON and the proxy's log.
    The server's gauges are polled every 20 ms: the run can take under 0.2 s, and a
    peak is only seen by a poll while a request runs (at 0.2 s a CI run saw none)."""
    proxy = recording_proxy_module(real_server.url)
    out = tmp_path_factory.mktemp("serve")
    t0 = time.perf_counter()
    rc = main(["bench", "serve", "--base-url", proxy.url, "--api-key", API_KEY,
               "--num-prompts", "6", "--max-concurrency", "2", "--num-warmups", "1",
               "--random-input-len", "48", "--random-range-ratio", "0.5", "--output-len", "6",
               "--seed", "11", "--request-id-prefix", "t-", "--temperature", "0",
               "--goodput", "ttft:400", "tpot:150", "--metrics-interval", "0.02",
               "--disable-tqdm", "--save-result", "--save-detailed", "--result-dir", str(out),
               "--result-filename", "run.json"])
    wall = time.perf_counter() - t0
    assert rc == 0
    return json.loads((out / "run.json").read_text()), proxy, wall, out


def test_per_request_metrics_match_the_wire(openai_run):
    result, proxy, _, _ = openai_run
    assert result["completed"] == 6 and result["failed"] == 0
    for i in range(6):
        ex = proxy.exchanges[f"t-{i}"]
        tokens = ex.token_events()
        usage = ex.final()["usage"]
        # One chunk per token on tandem: counts are exact (6 +- 50%: the range ratio).
        assert result["output_lens"][i] == usage["completion_tokens"] == len(tokens)
        assert 3 <= len(tokens) <= 9
        assert result["input_lens"][i] == usage["prompt_tokens"]
        assert len(result["itls"][i]) == len(tokens) - 1
        # TTFT: to the first chunk with a token (not the response headers, not a role chunk).
        wire_ttft = tokens[0][0] - ex.t_request
        assert -0.01 < result["ttfts"][i] - wire_ttft < TOL_S
        wire_itl = np.diff([t for t, _ in tokens])
        assert np.abs(np.asarray(result["itls"][i]) - wire_itl).max() < TOL_S
        # E2EL ends at the last token chunk, not at the usage chunk or [DONE].
        assert -0.01 < result["latencies"][i] - (tokens[-1][0] - ex.t_request) < TOL_S
        # The server's own phase split rides along (tandem's extension object).
        assert result["server_phases"][i]["prefill_s"] > 0
    # Warm-ups ran (and are not in the numbers).
    assert "t-warmup-0" in proxy.exchanges and len(result["ttfts"]) == 6


def test_aggregates_are_vllms_definitions_of_the_per_request_values(openai_run):
    r, _, wall, _ = openai_run
    ttft = np.asarray(r["ttfts"])
    e2el = np.asarray(r["latencies"])
    out = np.asarray(r["output_lens"])
    tpot = (e2el - ttft) / (out - 1)
    itl = np.concatenate(r["itls"])
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2el", e2el)):
        ms = values * 1000
        assert r[f"mean_{name}_ms"] == pytest.approx(ms.mean())
        assert r[f"median_{name}_ms"] == pytest.approx(np.median(ms))
        assert r[f"std_{name}_ms"] == pytest.approx(ms.std())
        for p in (50, 95, 99):
            assert r[f"p{p}_{name}_ms"] == pytest.approx(np.percentile(ms, p))
    d = r["duration"]
    assert 0 < d < wall
    assert r["request_throughput"] == pytest.approx(6 / d)
    assert r["output_throughput"] == pytest.approx(out.sum() / d)
    assert r["total_token_throughput"] == pytest.approx((out.sum() + sum(r["input_lens"])) / d)
    good = sum(1 for a, b in zip(ttft, tpot) if a <= 0.4 and b <= 0.15)
    assert r["request_goodput"] == pytest.approx(good / d)
    starts = np.asarray(r["start_times"])
    token_times = np.concatenate([s + t + np.concatenate([[0], np.cumsum(i)])
                                  for s, t, i in zip(starts, ttft, r["itls"])])
    buckets = np.bincount(np.floor(token_times - starts.min()).astype(int))
    assert r["max_output_tokens_per_s"] == buckets.max()


def test_max_concurrency_is_never_exceeded(openai_run):
    r, proxy, _, _ = openai_run
    assert r["max_concurrency"] == 2
    assert proxy.max_active == 2  # the server never saw a third request in flight
    assert r["max_concurrent_requests"] == 2
    # Waiting for a slot is the client's queue, reported apart from TTFT.
    assert max(r["queue_times"]) > 0


def test_json_keys_plots_html_and_server_metrics(openai_run):
    r, _, _, out = openai_run
    assert VLLM_KEYS | VLLM_DETAILED_KEYS <= set(r)
    assert r["model_id"] == "smollm2" and r["tokenizer_id"].endswith("/tokenize")
    for suffix in ("-latency.png", "-timeline.png"):
        assert (out / f"run{suffix}").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    html = (out / "run.html").read_text()
    assert html.count("data:image/png;base64,") == 2 and "Serving Benchmark Result" in html
    s = r["server_metrics"]
    # Differenced around the measured run: the warm-up is not in there.
    assert s["num_ttft_observations"] == 6
    assert s["generation_tokens"] == sum(r["output_lens"])
    assert s["prompt_tokens"] == sum(r["input_lens"])
    # The server's TTFT excludes the HTTP round trip: never above the client's.
    assert s["mean_ttft_ms"] <= r["mean_ttft_ms"] + 1
    assert s["num_preemptions"] == 0 and 0 < s["peak_kv_cache_usage"] < 1
    assert 1 <= s["peak_num_requests_running"] <= 2


def test_ollama_backend_reads_the_phase_counters(real_server, recording_proxy_module,
                                                 tmp_path):
    proxy = recording_proxy_module(real_server.url)
    assert main(["bench", "serve", "--base-url", proxy.url, "--api-key", API_KEY,
                 "--backend", "ollama", "--num-prompts", "2", "--random-input-len", "32",
                 "--output-len", "5", "--temperature", "0", "--seed", "4",
                 "--request-id-prefix", "o-", "--disable-tqdm", "--save-result",
                 "--save-detailed", "--no-plots", "--result-dir", str(tmp_path),
                 "--result-filename", "o.json"]) == 0
    r = json.loads((tmp_path / "o.json").read_text())
    assert r["completed"] == 2 and r["endpoint"] == "/api/generate"
    for i in range(2):
        ex = proxy.exchanges[f"o-{i}"]
        done = ex.final()
        phases = r["server_phases"][i]
        assert phases["prefill_s"] == pytest.approx(done["prompt_eval_duration"] / 1e9)
        assert phases["decode_s"] == pytest.approx(done["eval_duration"] / 1e9)
        assert phases["prompt_eval_count"] == done["prompt_eval_count"]
        assert r["output_lens"][i] == done["eval_count"] == len(ex.token_events())
        assert len(r["itls"][i]) == done["eval_count"] - 1
