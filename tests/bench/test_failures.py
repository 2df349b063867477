"""A 503, a dropped connection, an error event or a cut stream is a failed request, recorded
with its error; the run still completes, reports and saves."""

from __future__ import annotations

import json

import pytest

from tandem.entrypoints.cli import main
from tests.bench.conftest import FakePlan


def _bench(url: str, tmp_path, *extra: str) -> int:
    return main(["bench", "serve", "--base-url", url, "--skip-tokenizer-init",
                 "--random-input-len", "8", "--output-len", "4", "--seed", "3",
                 "--request-id-prefix", "r-", "--disable-tqdm", "--save-result",
                 "--save-detailed", "--result-dir", str(tmp_path), "--result-filename",
                 "out.json", *extra])


def test_every_kind_of_failure_is_recorded_and_the_run_reports(fake_server, tmp_path, capsys):
    url = fake_server(FakePlan(plan=["ok", "503", "drop", "error", "truncated"],
                               token_delay=0.005, tokens=4))
    assert _bench(url, tmp_path, "--num-prompts", "10", "--max-concurrency", "3") == 0
    result = json.loads((tmp_path / "out.json").read_text())
    assert result["completed"] == 2 and result["failed"] == 8
    errors = result["errors"]
    for i, err in enumerate(errors):  # request i got plan[i % 5]
        kind = ["ok", "503", "drop", "error", "truncated"][i % 5]
        if kind == "ok":
            assert err == ""
        elif kind == "503":
            assert err.startswith("HTTP 503: server overloaded")
        elif kind == "drop":
            assert "RemoteProtocolError" in err
        elif kind == "error":
            assert err == "error in stream: engine exploded"
        else:
            assert err == "the stream ended before its final event"
    # Failed requests count for nothing else: tokens and latencies are the two good ones'.
    assert result["output_lens"] == [4 if i % 5 == 0 else 0 for i in range(10)]
    assert result["total_output_tokens"] == 8
    assert result["request_throughput"] == pytest.approx(2 / result["duration"])
    out = capsys.readouterr()
    assert "Failed requests:                         8" in out.out
    assert "2 x HTTP 503: server overloaded: try later" in out.err
    html = (tmp_path / "out.html").read_text()
    assert "engine exploded" in html and "data:image/png;base64," in html


def test_all_failed_still_reports_and_exits_1(fake_server, tmp_path, capsys):
    url = fake_server(FakePlan(plan=["503"]))
    assert _bench(url, tmp_path, "--num-prompts", "3", "--no-plots") == 1
    result = json.loads((tmp_path / "out.json").read_text())
    assert result["completed"] == 0 and result["failed"] == 3
    assert result["mean_ttft_ms"] == 0.0  # vLLM's convention for "no data"
    assert "All requests failed" in capsys.readouterr().err


def test_unreachable_server_is_one_clear_error(capsys):
    assert main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--num-prompts", "1",
                 "--skip-tokenizer-init"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tandem bench: error: cannot reach http://127.0.0.1:9")


def test_tandem_queue_503s_are_failures_and_match_its_rejection_counter(tiny_server, tmp_path):
    """tandem with one slot and no queue: a burst of 6 runs one, rejects the rest at once."""
    assert _bench(tiny_server.url, tmp_path, "--num-prompts", "6", "--output-len", "20",
                  "--vocab-size", "128", "--no-plots") == 0
    result = json.loads((tmp_path / "out.json").read_text())
    server = result["server_metrics"]
    rejected = [e for e in result["errors"] if e]
    assert result["failed"] == len(rejected) == server["queue_rejections"] >= 1
    assert all(e.startswith("HTTP 503: server overloaded") for e in rejected)
    assert result["completed"] == server["num_ttft_observations"] == 6 - len(rejected)


def test_a_server_still_loading_says_so_not_pass_model():
    """While a model loads, /v1/models lists nothing and /health is a 503 "Loading
    model": bench and doctor told the operator to pass --model."""
    import httpx

    from tandem.tools.bench.target import resolve_target

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(503, json={"error": {"message": "Loading model"}})
        return httpx.Response(503, json={"error": {"message": "Loading model"}})

    with httpx.Client(transport=httpx.MockTransport(answer)) as client:
        with pytest.raises(ValueError, match="still loading its model"):
            resolve_target(None, "127.0.0.1", 1, "openai", None, None, {}, client)
