"""tandem doctor: every rule on synthetic measurements (triggered and not), then the whole
command against real tandem servers (healthy, one sequence, a tiny KV pool), a fake Ollama
with NUM_PARALLEL=1 and 2, and the errors a user can run into."""

from __future__ import annotations

import dataclasses
import json
import re
import socket

import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route

from tandem.diagnosis.findings import Finding, verdict
from tandem.diagnosis.measurements import Measurements, MetricsSample, Probe
from tandem.diagnosis.probe_rules import decode_ceiling, diagnose, prefill_rate
from tandem.entrypoints.cli import main
from tandem.tools.doctor.probe import normalize_url
from tandem.tools.doctor.report import format_report
from tests.plan.conftest import MODEL_SIZE
from tests.serving import serve_app


# ------------------------------------------------------------ synthetic inputs
def probe(name: str, prompt: int, out: int, ttft: float, itl: float = 0.05,
          sent: float = 0.0, **kw) -> Probe:
    """A successful request with evenly spaced tokens."""
    return Probe(name, prompt_tokens=prompt, output_tokens=out, sent_s=sent, ttft_s=ttft,
                 e2e_s=ttft + itl * (out - 1), itl_s=[itl] * (out - 1), **kw)


def healthy(**changes) -> Measurements:
    """A batching server with room to spare: 20 tok/s, TTFT 0.1 -> 0.4 s, no queue.

    The pair: a 48-token stream from t=0 (tokens 0.10 .. 2.45 s) and a 1,024-token
    prompt sent at 0.25 s that gets its first token at 0.70 s, while the stream runs.
    """
    m = Measurements(
        "http://127.0.0.1:1", "tandem", "m",
        warmup=probe("first request", 8, 2, 0.08),
        short=probe("short", 64, 16, 0.10),
        long=probe("long", 1024, 16, 0.40),
        stream=probe("stream", 64, 48, 0.10),
        pair_first=probe("pair first", 64, 48, 0.10),
        pair_second=probe("pair second", 1024, 4, 0.45, sent=0.25),
        metrics_before=MetricsSample(0, 0, 0.0, 0),
        metrics_after=MetricsSample(0, 0, 0.01, 0),
        metrics_peak=MetricsSample(1, 2, 0.05, 0),
        pair_metrics_peak=MetricsSample(0, 2, 0.05, 0),
    )
    return dataclasses.replace(m, **changes)


def rules(m: Measurements) -> dict[str, Finding]:
    return {f.rule: f for f in diagnose(m)}


def serialized_pair(**kw) -> dict:
    """The second request's first token comes after the first's last (2.45 s) + its 0.4 s."""
    return {"pair_second": probe("pair second", 1024, 4, 2.45 - 0.25 + 0.40, sent=0.25, **kw)}


# --------------------------------------------------------------------- rules
def test_healthy_server_has_no_findings():
    m = healthy()
    assert diagnose(m) == []
    assert verdict([]).startswith("Healthy")
    text = format_report(m, [])
    assert "nothing out of line" in text and "Verdict: Healthy" in text


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
    text = format_report(m, found)
    assert "! [queue]" in text and "turn first:" in text and "because:" in text
    assert "never streamed at the same time" in text


def test_url_normalisation():
    assert normalize_url("127.0.0.1:8000/v1/") == "http://127.0.0.1:8000"
    assert normalize_url("https://x.example") == "https://x.example"
    with pytest.raises(ValueError):
        normalize_url("ftp://x")


# ------------------------------------------------------- against real servers
ARGS = ["--short-len", "16", "--output-len", "32", "--seed", "1", "--json"]


def doctor_json(url: str, capsys, *extra: str) -> dict:
    """Run the command with --json; the output must be strict JSON (no NaN)."""
    assert main(["doctor", url, *ARGS, *extra]) == 0

    def no_constants(name: str):
        raise AssertionError(f"{name} in the JSON output")

    return json.loads(capsys.readouterr().out, parse_constant=no_constants)


def problems(report: dict) -> set[str]:
    return {f["rule"] for f in report["findings"] if f["severity"] == "problem"}


def test_healthy_tandem_server(healthy_server, capsys):
    r = doctor_json(healthy_server.url, capsys, "--long-len", "200")
    m = r["measurements"]
    assert m["kind"] == "tandem" and m["model"] == "tiny"
    assert "the tandem object in responses" in m["detected_from"]
    assert m["short"]["prompt_tokens"] == 16 and m["long"]["prompt_tokens"] == 200
    assert m["stream"]["output_tokens"] == 32 and m["stream"]["server_prefill_s"] > 0
    assert "random token ids" in " ".join(m["notes"])  # the tiny model has no tokenizer
    assert problems(r) == set(), r["findings"]
    assert r["verdict"].startswith(("Healthy", "No outright problem"))


def test_default_model_text_prompts_and_the_ceiling(real_server, capsys):
    r = doctor_json(real_server.url, capsys, "--api-key", real_server.api_key,
                    "--long-len", "256", "--output-len", "12",
                    "--model", "smollm2-135m", "--dtype", "fp32", "--bandwidth", "20")
    m = r["measurements"]
    assert m["kind"] == "tandem" and m["model"] == "smollm2" and m["max_model_len"] == 1024
    # Text prompts of exact lengths, counted with the server's own /tokenize.
    assert m["short"]["prompt_tokens"] == 16 and m["long"]["prompt_tokens"] == 256
    assert m["notes"] == [] and m["short"]["cached_tokens"] == 0
    assert m["model_bytes_source"].startswith("smollm2-135m at fp32")
    ceiling = next(f for f in r["findings"] if f["rule"] in ("at_ceiling", "below_ceiling",
                                                           "ceiling_wrong"))
    assert ceiling["values"]["ceiling_tok_s"] == pytest.approx(20e9 / m["model_bytes"])
    assert ceiling["values"]["decode_tok_s"] == pytest.approx(
        (m["stream"]["output_tokens"] - 1) / m["stream"]["server_decode_s"])


def test_tandem_with_one_sequence_queues(one_seq_server, capsys):
    r = doctor_json(one_seq_server.url, capsys, "--long-len", "200")
    found = {f["rule"]: f for f in r["findings"]}
    assert "one_at_a_time" in found and "kv_cache_full" not in found
    f = found["one_at_a_time"]
    assert f["values"]["overlap_s"] <= 0 and f["values"]["extra_wait_s"] > 0.2
    assert "the server says it queued" in f["evidence"]
    assert r["measurements"]["pair_metrics_peak"]["waiting"] >= 1
    assert r["verdict"].startswith("The time goes to waiting in a queue")


def test_tandem_with_a_tiny_kv_pool_runs_out_of_cache(small_pool_server, capsys):
    r = doctor_json(small_pool_server.url, capsys)  # the long prompt fills the 256-token pool
    found = {f["rule"]: f for f in r["findings"]}
    assert "kv_cache_full" in found and "one_at_a_time" not in found
    assert found["kv_cache_full"]["values"]["kv_usage_peak"] >= 0.9
    assert r["measurements"]["long"]["prompt_tokens"] == 256 - 16 - 8  # capped by the window


@pytest.mark.parametrize("parallel", [1, 2])
def test_fake_ollama_num_parallel(fake_ollama, capsys, parallel):
    url = fake_ollama(parallel)
    assert main(["doctor", url, "--short-len", "32", "--long-len", "400", "--output-len", "40",
                 "--bandwidth", "100"]) == 0
    text = " ".join(capsys.readouterr().out.split())  # the report wraps lines
    assert f"{url} is Ollama, model llama3.2:latest, context 4,096" in text
    assert ("OLLAMA_NUM_PARALLEL=1" in text) == (parallel == 1)
    # The ceiling from the server's size: 100 GB/s / 2 GB = 50 tok/s (the fake decodes ~50).
    assert f"100 GB/s (--bandwidth) / {MODEL_SIZE / 1e9:.2f} GB" in text and "50.0 tok/s" in text
    # The counters are read: the server's own queue and prefill split of the long prompt.
    assert re.search(r"400 prompt tokens: TTFT [\d,]+ ms \(server: queue \d+ ms, "
                     r"prefill \d+ ms = [\d,]+ tok/s\)", text)


def test_fake_ollama_json_reads_the_counters(fake_ollama, capsys):
    r = doctor_json(fake_ollama(1), capsys, "--long-len", "400")
    m = r["measurements"]
    assert m["kind"] == "ollama" and m["long"]["computed_prompt_tokens"] == 400
    assert m["long"]["server_prefill_s"] == pytest.approx(400 * 0.0003, abs=0.05)
    second = m["pair_second"]
    assert second["server_queue_s"] > 0.3  # it waited for the one slot
    f = next(f for f in r["findings"] if f["rule"] == "one_at_a_time")
    assert "OLLAMA_NUM_PARALLEL=N" in f["knobs"][0]


# ----------------------------------------------------------------------- errors
def test_unreachable_url_is_one_line_and_exit_2(capsys):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    assert main(["doctor", f"http://127.0.0.1:{port}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tandem doctor: error: cannot reach") and err.count("\n") == 1


def test_non_llm_server_and_missing_key_are_one_line(capsys):
    plain = Starlette(routes=[Route("/", lambda r: PlainTextResponse("hello"))])
    url, stop = serve_app(plain)
    locked = Starlette(routes=[Route("/v1/models", lambda r: JSONResponse({}, 401))])
    url2, stop2 = serve_app(locked)
    try:
        assert main(["doctor", url]) == 2
        err = capsys.readouterr().err
        assert "does not look like an LLM server" in err and err.count("\n") == 1
        assert main(["doctor", url2]) == 2
        assert "pass --api-key" in capsys.readouterr().err
    finally:
        stop()
        stop2()


def test_bad_flags_fail_before_any_request(capsys):
    assert main(["doctor", "http://127.0.0.1:9", "--short-len", "64", "--long-len", "32"]) == 2
    assert "--long-len must be longer" in capsys.readouterr().err
    assert main(["doctor", "http://127.0.0.1:9", "--device", "rtx4090",
                 "--bandwidth", "900"]) == 2
    assert "not both" in capsys.readouterr().err
    assert main(["doctor", "http://127.0.0.1:9", "--model", "no-such-model"]) == 2
    assert "unknown model" in capsys.readouterr().err
