"""Every rule on synthetic numbers, triggered and not: the doctor's over probe
measurements (tandem.diagnosis.probe_rules.diagnose), the dashboard's over a server's
live figures (tandem.diagnosis.live_rules.diagnose_live) and the histogram quantiles
they are fed; and the package's purity."""

from __future__ import annotations

import ast
import dataclasses
import math
from pathlib import Path

import pytest

import tandem.diagnosis
from tandem.diagnosis.findings import Finding, verdict
from tandem.diagnosis.live_rules import LiveFigures, diagnose_live
from tandem.diagnosis.measurements import Measurements, MetricsSample, Probe
from tandem.diagnosis.probe_rules import decode_ceiling, diagnose, prefill_rate
from tandem.entrypoints.server.dashboard import histogram_quantile
from tests.measurements import healthy, probe, serialized_pair


def rules(m: Measurements) -> dict[str, Finding]:
    """The doctor's findings by rule."""
    return {f.rule: f for f in diagnose(m)}


def figures(**kw) -> LiveFigures:
    base = dict(window_s=60, waiting=0, peak_running=8, max_num_seqs=8, oldest_wait_s=0.0,
                kv_usage=0.1, preemptions=0,
                rejections=0, prefill_tokens=500, queue_p95_s=0.0, ttft_p95_s=0.1,
                itl_p50_s=0.025, itl_p99_s=0.05)
    base.update(kw)
    if "ttft_p95_s" not in kw:  # a first token comes after its queue, as on a server
        base["ttft_p95_s"] = (base["queue_p95_s"] or 0.0) + 0.1
    return LiveFigures(**base)


def live(**kw) -> dict[str, Finding]:
    """The live findings by rule."""
    return {f.rule: f for f in diagnose_live(figures(**kw))}


def test_a_healthy_server_has_no_findings():
    assert diagnose(healthy()) == []
    assert diagnose_live(figures()) == []
    assert verdict([]).startswith("Healthy")
    idle = figures(queue_p95_s=None, ttft_p95_s=None, itl_p50_s=None, itl_p99_s=None)
    assert diagnose_live(idle) == []


# ---------------------------------------------------------- probe measurements
def test_one_at_a_time_triggered_with_its_numbers():
    f = rules(healthy(**serialized_pair(server_queue_s=2.2)))["one_at_a_time"]
    assert f.severity == "problem" and f.phase == "queue"
    assert f.values["extra_wait_s"] == pytest.approx(2.2)
    assert f.values["first_remaining_s"] == pytest.approx(2.2)
    assert f.values["overlap_s"] < 0
    assert "2.20 s more than alone" in f.evidence and "queued 2.20 s" in f.evidence
    assert f.knobs[0].startswith("let requests share the batch: --max-num-seqs")
    assert "one_at_a_time" not in rules(healthy())


def test_one_at_a_time_speaks_ollama():
    f = rules(healthy(kind="ollama", **serialized_pair()))["one_at_a_time"]
    assert "OLLAMA_NUM_PARALLEL=1" in f.title and "OLLAMA_NUM_PARALLEL=N" in f.knobs[0]
    assert "OLLAMA_MAX_QUEUE" in f.knobs[1]


def test_a_prefill_longer_than_the_first_stream_is_not_a_queue():
    # The long prompt alone takes 3 s: its first token comes after the stream ended, but
    # only because prefill takes that long (it lost nothing to the first request).
    m = healthy(long=probe("long", 1024, 16, 3.0),
                pair_second=probe("pair second", 1024, 4, 3.0, sent=0.25))
    assert "one_at_a_time" not in rules(m)


def test_a_second_request_the_server_did_not_queue_is_not_one_at_a_time():
    # tandem caps prompt tokens beside a decoding stream: the second prompt's prefill
    # outlasts the first stream although the server queued it for no time.
    assert "one_at_a_time" not in rules(healthy(**serialized_pair(server_queue_s=0.01)))


def test_waiting_for_kv_blocks_is_the_cache_finding_not_a_slot_one():
    m = healthy(metrics_after=MetricsSample(0, 0, 0.2, 3), **serialized_pair())
    found = rules(m)
    assert "one_at_a_time" not in found
    assert found["kv_cache_full"].values["preemptions"] == 3


def test_queue_waiting_from_metrics_and_from_the_server_split():
    f = rules(healthy(metrics_before=MetricsSample(3, 8, 0.5, 0)))["queue_waiting"]
    assert "vllm:num_requests_waiting was 3" in f.evidence and f.values["waiting_before"] == 3
    g = rules(healthy(short=probe("short", 64, 16, 0.8, server_queue_s=0.6)))["queue_waiting"]
    assert "waited 0.60 s for a slot" in g.evidence
    assert "queue_waiting" not in rules(healthy(short=probe("short", 64, 16, 0.1,
                                                            server_queue_s=0.01)))


def test_kv_cache_full_from_preemptions_usage_or_the_request_counts():
    by_counter = rules(healthy(metrics_after=MetricsSample(0, 0, 0.3, 2)))["kv_cache_full"]
    assert "rose by 2" in by_counter.evidence
    by_usage = rules(healthy(metrics_peak=MetricsSample(1, 2, 0.97, 0)))["kv_cache_full"]
    assert "reached 97%" in by_usage.evidence and by_usage.values["kv_usage_peak"] == 0.97
    by_request = rules(healthy(metrics_before=None, metrics_after=None, metrics_peak=None,
                               stream=probe("stream", 64, 48, 0.1, preemptions=1)))
    assert by_request["kv_cache_full"].values["preemptions"] == 1
    assert "--kv-cache-dtype int8" in by_usage.knobs[1]
    assert "kv_cache_full" not in rules(healthy(metrics_peak=MetricsSample(1, 2, 0.89, 0)))


def test_slow_prefill_names_the_rate_and_the_knobs():
    m = healthy(short=probe("short", 64, 16, 0.2), long=probe("long", 1024, 16, 3.0))
    f = rules(m)["slow_prefill"]
    assert f.phase == "prefill"
    rate = (1024 - 64) / (3.0 - 0.2)
    assert f.values["prefill_tok_s"] == pytest.approx(rate)
    assert f"{rate:,.0f} tok/s" in f.evidence and "(15.0x)" in f.evidence
    assert f.knobs[0].startswith("shorter prompts") and "prefix" in f.knobs[1]
    assert "--max-num-batched-tokens" in f.knobs[2]
    # Below the target: not slow, however it grows.
    assert "slow_prefill" not in rules(healthy(long=probe("long", 1024, 16, 0.9)))
    # Above the target but flat: not prefill (the overhead rule says so instead).
    flat = rules(healthy(short=probe("short", 64, 16, 1.5), long=probe("long", 1024, 16, 1.6)))
    assert "slow_prefill" not in flat and "ttft_overhead" in flat


def test_queue_time_is_not_read_as_prefill():
    """An operator's trial: TTFT 1.555 -> 2.359 s (1.5x), of which the server said
    1.453 and 1.585 s were queue: the queue's finding, not a slow prefill."""
    queued = healthy(short=probe("short", 64, 16, 1.555, server_queue_s=1.453),
                     long=probe("long", 328, 16, 2.359, server_queue_s=1.585))
    assert "slow_prefill" not in rules(queued)
    slow = healthy(short=probe("short", 64, 16, 1.6, server_queue_s=1.4),
                   long=probe("long", 1024, 16, 4.4, server_queue_s=1.4))
    assert "slow_prefill" in rules(slow)  # 0.2 -> 3.0 s once the queue is taken out


def test_a_server_refusing_the_first_request_is_the_rejected_finding():
    """The doctor stopped with an error on an overloaded server (--max-queue full);
    the refusal, still there after its retries, is what it reports."""
    refused = Probe("first request", prompt_tokens=8, output_tokens=0, ok=False,
                    error="HTTP 503: server overloaded: 2 requests are already waiting")
    found = diagnose(Measurements("http://127.0.0.1:1", "tandem", "m", warmup=refused))
    assert [f.rule for f in found] == ["rejected"]
    assert "--max-queue" in verdict(found) or "--max-num-seqs" in verdict(found)


def test_prefill_rate_prefers_the_servers_split():
    m = healthy(long=probe("long", 1024, 16, 0.4, server_prefill_s=0.25,
                           computed_prompt_tokens=1000))
    rate, how = prefill_rate(m)
    assert rate == 4000 and "server" in how
    assert prefill_rate(healthy())[0] == pytest.approx(960 / 0.3)


def test_ttft_overhead_only_without_a_queue():
    slow_flat = {"short": probe("short", 64, 16, 1.5), "long": probe("long", 1024, 16, 1.6)}
    f = rules(healthy(**slow_flat))["ttft_overhead"]
    assert f.phase == "startup" and f.values["growth"] == pytest.approx(1.6 / 1.5)
    queued = healthy(metrics_before=MetricsSample(2, 8, 0.4, 0), **slow_flat)
    assert "ttft_overhead" not in rules(queued) and "queue_waiting" in rules(queued)
    assert "ttft_overhead" not in rules(healthy())


def test_cold_start_from_load_duration_or_the_first_ttft():
    by_load = rules(healthy(kind="ollama",
                            warmup=probe("first request", 8, 2, 3.2, load_s=3.0)))
    assert by_load["cold_start"].values["cold_start_s"] == 3.0
    assert "OLLAMA_KEEP_ALIVE=-1" in by_load["cold_start"].knobs[0]
    by_ttft = rules(healthy(warmup=probe("first request", 8, 2, 4.0)))
    assert "4.00 s" in by_ttft["cold_start"].evidence
    assert "cold_start" not in rules(healthy(warmup=probe("first request", 8, 2, 0.25)))
    # A first request that queued behind others' (the server says so) was no cold start.
    queued = probe("first request", 8, 2, 3.85, server_queue_s=3.57)
    assert "cold_start" not in rules(healthy(warmup=queued))


def test_a_wait_with_the_cache_full_is_not_a_slots_finding():
    """Requests queue because the KV pool is full: more slots would preempt more."""
    full = healthy(metrics_before=MetricsSample(2, 4, 1.0, 0))
    found = rules(full)
    assert "kv_cache_full" in found and "queue_waiting" not in found
    assert "queue_waiting" in rules(healthy(metrics_before=MetricsSample(2, 4, 0.4, 0)))
    # Waiting while slots are free: the prompt budget, not the slots (as the live rules say).
    free = rules(healthy(metrics_before=MetricsSample(2, 4, 0.4, 0), slots=64))
    assert "queue_waiting" not in free and "at most 4 of 64 sequence slots" in \
        free["prefill_queue"].evidence
    assert "queue_waiting" in rules(healthy(metrics_before=MetricsSample(2, 4, 0.4, 0),
                                            slots=4))


def test_slow_decode_and_the_ceiling():
    slow = healthy(stream=probe("stream", 64, 48, 0.1, itl=0.2),
                   bandwidth_bytes_s=15e9, model_bytes=0.538e9, model_bytes_source="test")
    found = rules(slow)
    assert found["slow_decode"].values["decode_tok_s"] == pytest.approx(5.0)
    assert "ceiling is 27.9 tok/s" in found["slow_decode"].evidence
    assert found["slow_decode"].knobs[0].startswith("quantize the weights")
    below = found["below_ceiling"]
    assert below.severity == "warning" and below.values["share"] == pytest.approx(5 / 27.88,
                                                                                  rel=1e-3)
    assert "18% of the ceiling" in below.evidence
    fast = rules(healthy(bandwidth_bytes_s=15e9, model_bytes=0.538e9))
    assert "slow_decode" not in fast and "below_ceiling" not in fast
    assert fast["at_ceiling"].severity == "ok"  # 20 tok/s of 27.9: only fewer bytes help
    assert decode_ceiling(healthy()) is None and "at_ceiling" not in rules(healthy())
    # Twice what the ceiling allows: its bytes (e.g. --dtype fp32 for a Q4 server) are wrong.
    wrong = rules(healthy(bandwidth_bytes_s=15e9, model_bytes=1.5e9))
    assert "at_ceiling" not in wrong and wrong["ceiling_wrong"].severity == "warning"
    assert "--model / --dtype" in wrong["ceiling_wrong"].knobs[0]


@pytest.mark.parametrize("level,advice", [
    (None, "bytes read per token): --quantization int8"),
    ("F16", "bytes read per token): --quantization int8"),
    ("Q8_0", "4-bit weights: --quantization int4"), ("INT8", "4-bit weights"),
    ("Q4_1", "already Q4_1 (4 bits): a smaller model"), ("Q4_K_M", "already Q4_K_M")])
def test_at_the_ceiling_the_advice_follows_what_the_weights_are(level, advice):
    """A model already at 8 or 4 bits is not told to quantize to int8 (more bytes for 4)."""
    found = rules(healthy(bandwidth_bytes_s=15e9, model_bytes=0.538e9,
                          quantization_level=level))
    assert advice in found["at_ceiling"].knobs[0], found["at_ceiling"].knobs


def test_a_long_prompt_stalling_the_stream():
    # The stream's 6th gap (1.0 s) falls while the long prompt (sent at 0.25 s) prefills.
    itl = [0.05] * 47
    itl[3] = 1.0
    stalled = probe("pair first", 64, 48, 0.10)
    stalled.itl_s, stalled.e2e_s = itl, 0.10 + sum(itl)
    m = healthy(pair_first=stalled, pair_second=probe("pair second", 1024, 4, 1.2, sent=0.25))
    f = rules(m)["prefill_stalls_decode"]
    assert f.values["stall_s"] == pytest.approx(1.0) and "--max-num-batched-tokens" in f.knobs[0]
    # The same gap outside the prefill window is someone else's business.
    late = healthy(pair_first=dataclasses.replace(stalled, itl_s=[0.05] * 40 + [1.0] + [0.05] * 6))
    assert "prefill_stalls_decode" not in rules(late)


def test_long_context_slows_decode():
    m = healthy(long=probe("long", 1024, 16, 0.4, itl=0.1))
    f = rules(m)["long_context_decode"]
    assert f.values["decode_long_tok_s"] == pytest.approx(10.0) and "-50%" in f.evidence
    assert "long_context_decode" not in rules(healthy(long=probe("long", 1024, 16, 0.4,
                                                                 itl=0.06)))


def test_offloaded_layers():
    assert rules(healthy(kind="ollama", gpu_share=0.6))["offloaded"].values["gpu_share"] == 0.6
    for share in (None, 0.0, 1.0):
        assert "offloaded" not in rules(healthy(gpu_share=share))


def test_rejected_requests():
    bad = Probe("pair second", ok=False, error="HTTP 503: server overloaded, retry later")
    f = rules(healthy(pair_second=bad))["rejected"]
    assert f.phase == "queue" and "HTTP 503" in f.evidence
    assert "rejected" not in rules(healthy(pair_second=Probe("pair second", ok=False,
                                                             error="HTTP 400: bad")))


def test_order_and_verdict_lead_with_the_queue():
    m = healthy(stream=probe("stream", 64, 48, 0.1, itl=0.2), **serialized_pair())
    found = diagnose(m)
    assert [f.rule for f in found][:2] == ["one_at_a_time", "slow_decode"]
    v = verdict(found)
    assert v.startswith("The time goes to waiting in a queue") and "--max-num-seqs" in v


# ----------------------------------------------------------------- live figures
BOUNDS = [0.1, 0.5, 1.0, math.inf]


def test_histogram_quantile_is_prometheus_interpolation():
    counts = [10, 30, 40, 40]  # cumulative: 10 <= 0.1 s, 20 in (0.1, 0.5], 10 in (0.5, 1]
    assert histogram_quantile(0.5, BOUNDS, counts) == pytest.approx(0.1 + 0.4 * 10 / 20)
    assert histogram_quantile(0.25, BOUNDS, counts) == pytest.approx(0.1)
    assert histogram_quantile(0.1, BOUNDS, counts) == pytest.approx(0.04)  # from 0
    assert histogram_quantile(0.99, BOUNDS, counts) == pytest.approx(0.5 + 0.5 * 9.6 / 10)
    # The lower bound: what the quantile is known to reach.
    assert histogram_quantile(0.5, BOUNDS, counts, lower=True) == 0.1
    assert histogram_quantile(0.1, BOUNDS, counts, lower=True) == 0.0
    # In the +Inf bucket: the highest finite bound, as Prometheus answers.
    assert histogram_quantile(0.99, BOUNDS, [0, 0, 1, 5]) == 1.0
    assert histogram_quantile(0.5, BOUNDS, [0, 0, 0, 0]) is None
    assert histogram_quantile(0.5, [], []) is None


def test_a_building_queue_is_the_verdict_with_the_slots_knob():
    # No request has started yet, so no queue time is observed: the oldest wait says it.
    found = diagnose_live(figures(waiting=5, oldest_wait_s=3.2, queue_p95_s=None))
    assert found[0].rule == "queue_waiting"
    assert "requests wait 3.2 s" in found[0].evidence and "5 waiting now" in found[0].evidence
    assert "--max-num-seqs" in verdict(found)
    assert "queue_waiting" in live(queue_p95_s=1.0)
    assert "queue_waiting" not in live(queue_p95_s=0.0, oldest_wait_s=0.1)


def test_a_queue_with_free_slots_waits_for_the_token_budget():
    found = diagnose_live(figures(queue_p95_s=0.5, ttft_p95_s=1.2, peak_running=16,
                                  max_num_seqs=64))
    assert [f.rule for f in found] == ["prefill_queue"]
    assert "at most 16 of 64 sequence slots in use" in found[0].evidence
    assert "--max-num-batched-tokens" in verdict(found)
    # Not knowing the slots, the doctor's reading: a queue.
    assert "queue_waiting" in live(queue_p95_s=0.5, ttft_p95_s=1.2, peak_running=16,
                                   max_num_seqs=None)


def test_a_wait_the_first_token_absorbs_within_its_target_is_no_finding():
    """Requests waited 0.5 s while TTFT p95 stayed at 0.65 s of a 1 s target: the
    verdict said "the first token is slow" (an operator's trial). A request waiting
    past the target now still counts, whatever the finished ones' TTFT."""
    assert diagnose_live(figures(queue_p95_s=0.5, ttft_p95_s=0.65, peak_running=4)) == []
    assert "prefill_queue" in live(queue_p95_s=0.5, ttft_p95_s=0.65, peak_running=4,
                                   oldest_wait_s=1.5)
    assert "prefill_queue" in live(queue_p95_s=0.5, ttft_p95_s=1.2, peak_running=4)


def test_a_wait_with_the_cache_full_is_the_cache_finding():
    """Slots free because the KV pool is full: neither more slots nor a larger token
    budget, the cache (a trial's 2 of 4 slots with the pool at 100% was told the budget)."""
    for full in ({"kv_usage": 1.0}, {"preemptions": 5}):
        found = diagnose_live(figures(queue_p95_s=3.5, peak_running=2, max_num_seqs=4, **full))
        assert [f.rule for f in found] == ["kv_cache_full"]
        assert found[0].evidence.startswith("requests wait 3.5 s to start")


def test_rejections_and_cache_pressure():
    assert live(rejections=3)["rejected"].evidence.startswith("3 requests were refused")
    assert live(preemptions=2)["kv_cache_full"].values["preemptions"] == 2
    assert "KV cache usage is 95%" in live(kv_usage=0.95)["kv_cache_full"].evidence
    assert "kv_cache_full" not in live(kv_usage=0.85)


def test_slow_first_token_is_prefill_only_without_a_queue():
    assert "slow_prefill" in live(ttft_p95_s=2.5)
    assert "slow_prefill" not in live(ttft_p95_s=2.5, queue_p95_s=2.0)  # the queue's doing
    assert "slow_prefill" not in live(ttft_p95_s=0.5)
    # A --slo-ttft-ms target replaces the doctor's one second.
    assert "slow_prefill" in {f.rule for f in diagnose_live(figures(ttft_p95_s=0.5,
                                                                    ttft_target_s=0.25))}


def test_decode_slow_or_stuttering():
    slow = live(itl_p50_s=0.15, itl_p99_s=0.3)["slow_decode"]
    assert "at most 6.7 tok/s per stream" in slow.evidence
    assert "--quantization" in slow.knobs[0]
    stall = live(itl_p50_s=0.025, itl_p99_s=0.75)
    assert "prefill_stalls_decode" in stall and "--max-num-batched-tokens" in \
        stall["prefill_stalls_decode"].knobs[0]
    assert "prefill_stalls_decode" not in live(itl_p50_s=0.025, itl_p99_s=0.75,
                                               prefill_tokens=0)  # no prompt to blame
    assert "slow_decode" not in {f.rule for f in diagnose_live(
        figures(itl_p50_s=0.15, itl_target_s=0.2))}
    # Weights already at 4 bits are not told to quantize to 8 (it reads more).
    four = live(itl_p50_s=0.15, quantization_level="Q4_0")["slow_decode"]
    assert four.knobs[0].startswith("the weights are already Q4_0 (4 bits): a smaller model")
    assert live(itl_p50_s=0.15, quantization_level="Q8_0")["slow_decode"].knobs[0] \
        .startswith("4-bit weights: --quantization int4")


def test_findings_are_ordered_like_the_doctors():
    found = diagnose_live(figures(rejections=1, preemptions=1, itl_p50_s=0.2, waiting=2,
                                  oldest_wait_s=1.0))
    # (the wait, with a preemption in the window, is the cache's finding)
    assert [f.phase for f in found] == ["queue", "cache", "decode"]


def test_the_shared_rules_import_nothing_but_the_standard_library():
    """The server imports this package: it must not pull in tools, HTTP or the engine."""
    for path in Path(tandem.diagnosis.__file__).parent.glob("*.py"):
        tree = ast.parse(path.read_text())
        mods = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        mods |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        mods = {m for m in mods if not m.startswith("tandem.diagnosis.")}
        assert mods <= {"__future__", "dataclasses", "math", "re", "statistics", "typing"}, \
            (path.name, mods)
