"""tandem doctor: its report on synthetic measurements, then the whole command against
real tandem servers (healthy, one sequence, a tiny KV pool), a fake Ollama with
NUM_PARALLEL=1 and 2, and the errors a user can run into. The rules it applies are
tested in tests/unit/test_diagnosis.py."""

from __future__ import annotations

import json
import re
import socket

import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route

from tandem.diagnosis.probe_rules import diagnose
from tandem.entrypoints.cli import main
from tandem.tools.doctor.probe import normalize_url
from tandem.tools.doctor.report import format_report
from tests.measurements import healthy, probe, serialized_pair
from tests.plan.conftest import MODEL_SIZE
from tests.serving import serve_app


# --------------------------------------------------------------------- report
def test_a_healthy_report_says_nothing_is_out_of_line():
    text = format_report(healthy(), [])
    assert "nothing out of line" in text and "Verdict: Healthy" in text


def test_the_report_marks_each_finding_and_says_how_the_pair_ran():
    m = healthy(stream=probe("stream", 64, 48, 0.1, itl=0.2), **serialized_pair())
    text = format_report(m, diagnose(m))
    assert "! [queue]" in text and "turn first:" in text and "because:" in text
    assert "never streamed at the same time" in text


# -------------------------------------------------------------------- probing
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
