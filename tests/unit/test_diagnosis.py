"""The doctor's rules over a server's live figures (tandem.diagnosis.diagnose_live),
the histogram quantiles they are fed, and the shared module's purity."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest

import tandem.diagnosis
from tandem.diagnosis.findings import verdict
from tandem.diagnosis.live_rules import LiveFigures, diagnose_live
from tandem.entrypoints.server.dashboard import histogram_quantile

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


def figures(**kw) -> LiveFigures:
    base = dict(window_s=60, waiting=0, peak_running=8, max_num_seqs=8, oldest_wait_s=0.0,
                kv_usage=0.1, preemptions=0,
                rejections=0, prefill_tokens=500, queue_p95_s=0.0, ttft_p95_s=0.1,
                itl_p50_s=0.025, itl_p99_s=0.05)
    base.update(kw)
    if "ttft_p95_s" not in kw:  # a first token comes after its queue, as on a server
        base["ttft_p95_s"] = (base["queue_p95_s"] or 0.0) + 0.1
    return LiveFigures(**base)


def rules(**kw) -> dict[str, object]:
    return {f.rule: f for f in diagnose_live(figures(**kw))}


def test_a_quiet_server_is_healthy():
    assert diagnose_live(figures()) == []
    assert verdict([]).startswith("Healthy")
    idle = figures(queue_p95_s=None, ttft_p95_s=None, itl_p50_s=None, itl_p99_s=None)
    assert diagnose_live(idle) == []


def test_a_building_queue_is_the_verdict_with_the_slots_knob():
    # No request has started yet, so no queue time is observed: the oldest wait says it.
    found = diagnose_live(figures(waiting=5, oldest_wait_s=3.2, queue_p95_s=None))
    assert found[0].rule == "queue_waiting"
    assert "requests wait 3.2 s" in found[0].evidence and "5 waiting now" in found[0].evidence
    assert "--max-num-seqs" in verdict(found)
    assert "queue_waiting" in rules(queue_p95_s=1.0)
    assert "queue_waiting" not in rules(queue_p95_s=0.0, oldest_wait_s=0.1)


def test_a_queue_with_free_slots_waits_for_the_token_budget():
    found = diagnose_live(figures(queue_p95_s=0.5, ttft_p95_s=1.2, peak_running=16,
                                  max_num_seqs=64))
    assert [f.rule for f in found] == ["prefill_queue"]
    assert "at most 16 of 64 sequence slots in use" in found[0].evidence
    assert "--max-num-batched-tokens" in verdict(found)
    # Not knowing the slots, the doctor's reading: a queue.
    assert "queue_waiting" in rules(queue_p95_s=0.5, ttft_p95_s=1.2, peak_running=16,
                                    max_num_seqs=None)


def test_a_wait_the_first_token_absorbs_within_its_target_is_no_finding():
    """Requests waited 0.5 s while TTFT p95 stayed at 0.65 s of a 1 s target: the
    verdict said "the first token is slow" (an operator's trial). A request waiting
    past the target now still counts, whatever the finished ones' TTFT."""
    assert diagnose_live(figures(queue_p95_s=0.5, ttft_p95_s=0.65, peak_running=4)) == []
    assert "prefill_queue" in rules(queue_p95_s=0.5, ttft_p95_s=0.65, peak_running=4,
                                    oldest_wait_s=1.5)
    assert "prefill_queue" in rules(queue_p95_s=0.5, ttft_p95_s=1.2, peak_running=4)


def test_a_wait_with_the_cache_full_is_the_cache_finding():
    """Slots free because the KV pool is full: neither more slots nor a larger token
    budget, the cache (a trial's 2 of 4 slots with the pool at 100% was told the budget)."""
    for full in ({"kv_usage": 1.0}, {"preemptions": 5}):
        found = diagnose_live(figures(queue_p95_s=3.5, peak_running=2, max_num_seqs=4, **full))
        assert [f.rule for f in found] == ["kv_cache_full"]
        assert found[0].evidence.startswith("requests wait 3.5 s to start")


def test_rejections_and_cache_pressure():
    assert rules(rejections=3)["rejected"].evidence.startswith("3 requests were refused")
    assert rules(preemptions=2)["kv_cache_full"].values["preemptions"] == 2
    assert "KV cache usage is 95%" in rules(kv_usage=0.95)["kv_cache_full"].evidence
    assert "kv_cache_full" not in rules(kv_usage=0.85)


def test_slow_first_token_is_prefill_only_without_a_queue():
    assert "slow_prefill" in rules(ttft_p95_s=2.5)
    assert "slow_prefill" not in rules(ttft_p95_s=2.5, queue_p95_s=2.0)  # the queue's doing
    assert "slow_prefill" not in rules(ttft_p95_s=0.5)
    # A --slo-ttft-ms target replaces the doctor's one second.
    assert "slow_prefill" in {f.rule for f in diagnose_live(figures(ttft_p95_s=0.5,
                                                                    ttft_target_s=0.25))}


def test_decode_slow_or_stuttering():
    slow = rules(itl_p50_s=0.15, itl_p99_s=0.3)["slow_decode"]
    assert "at most 6.7 tok/s per stream" in slow.evidence
    assert "--quantization" in slow.knobs[0]
    stall = rules(itl_p50_s=0.025, itl_p99_s=0.75)
    assert "prefill_stalls_decode" in stall and "--max-num-batched-tokens" in \
        stall["prefill_stalls_decode"].knobs[0]
    assert "prefill_stalls_decode" not in rules(itl_p50_s=0.025, itl_p99_s=0.75,
                                                prefill_tokens=0)  # no prompt to blame
    assert "slow_decode" not in {f.rule for f in diagnose_live(
        figures(itl_p50_s=0.15, itl_target_s=0.2))}
    # Weights already at 4 bits are not told to quantize to 8 (it reads more).
    four = rules(itl_p50_s=0.15, quantization_level="Q4_0")["slow_decode"]
    assert four.knobs[0].startswith("the weights are already Q4_0 (4 bits): a smaller model")
    assert rules(itl_p50_s=0.15, quantization_level="Q8_0")["slow_decode"].knobs[0] \
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
