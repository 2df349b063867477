"""The command line: help, one-line errors for bad flags, --sweep, and datasets end to end."""

from __future__ import annotations

import json

import pytest

from tandem.entrypoints.cli import main
from tandem.tools.bench.serve import parse_sweep
from tests.bench.conftest import API_KEY, FakePlan


def test_help_lists_the_three_commands(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert all(cmd in out for cmd in ("serve", "phases", "compare"))


@pytest.mark.parametrize(("args", "message"), [
    (["--goodput", "latency:5"], "--goodput 'latency:5'"),
    (["--metric-percentiles", "abc"], "--metric-percentiles"),
    (["--backend", "openai", "--endpoint", "/v1/chat/completions"], "does not fit"),
    (["--backend", "ollama", "--endpoint", "/v1/completions"], "does not fit"),
    (["--header", "novalue"], "--header 'novalue'"),
    (["--extra-body", "{nope"], "--extra-body is not JSON"),
    (["--max-concurrency", "0", "--skip-tokenizer-init"], "--max-concurrency"),
    (["--request-rate", "0", "--skip-tokenizer-init"], "--request-rate"),
    (["--request-rate", "-1"], "--request-rate must be positive"),
    (["--burstiness", "0"], "--burstiness must be positive"),
    (["--backend", "openai-chat", "--skip-tokenizer-init"], "use --backend openai"),
    (["--sweep", "batch=1,2", "--skip-tokenizer-init"], "--sweep 'batch=1,2'"),
    (["--random-input-len", "4000", "--skip-tokenizer-init"], "context window of 4096"),
    (["--save-result", "--result-dir", "/proc/nope"], "--result-dir /proc/nope"),
])
def test_bad_flags_are_one_line_errors(fake_server, capsys, args, message):
    url = fake_server(FakePlan())
    assert main(["bench", "serve", "--base-url", url, "--num-prompts", "2", *args]) == 2
    out, err = capsys.readouterr()
    assert err.strip().startswith("tandem bench: error:") and message in err
    assert "\n" not in err.strip() and "Traffic request rate" not in out  # nothing ran


def test_parse_sweep():
    assert parse_sweep("concurrency=1,2,8") == ("max_concurrency", [1.0, 2.0, 8.0])
    assert parse_sweep("rate=0.5,inf") == ("request_rate", [0.5, float("inf")])
    for bad in ("concurrency=1.5", "rate=0", "rate=", "concurrency=inf"):
        with pytest.raises(ValueError, match="--sweep"):
            parse_sweep(bad)


def test_sweep_over_concurrency(tiny_batch_server, recording_proxy, tmp_path, capsys):
    proxy = recording_proxy(tiny_batch_server.url)
    assert main(["bench", "serve", "--base-url", proxy.url, "--skip-tokenizer-init",
                 "--vocab-size", "128", "--num-prompts", "6", "--random-input-len", "8",
                 "--output-len", "8", "--sweep", "concurrency=1,3", "--seed", "1",
                 "--disable-tqdm", "--save-result", "--result-dir", str(tmp_path),
                 "--result-filename", "sweep.json"]) == 0
    data = json.loads((tmp_path / "sweep.json").read_text())
    assert data["sweep"] == "max-concurrency" and data["values"] == [1, 3]
    one, three = data["results"]
    assert (one["max_concurrency"], three["max_concurrency"]) == (1, 3)
    assert one["max_concurrent_requests"] == 1 and three["max_concurrent_requests"] == 3
    assert one["completed"] == three["completed"] == 6
    assert proxy.max_active == 3
    assert (tmp_path / "sweep-sweep.png").read_bytes()[:4] == b"\x89PNG"
    table = capsys.readouterr().out.split("Sweep over max-concurrency")[1].splitlines()
    assert [line.split()[0] for line in table[2:4]] == ["1", "3"]


@pytest.mark.parametrize("dataset", ["shared-prefix", "chat"])
def test_datasets_end_to_end_on_the_default_model(real_server, tmp_path, dataset):
    """shared-prefix really hits the prefix cache; chat's messages pass the real template."""
    assert main(["bench", "serve", "--base-url", real_server.url, "--api-key", API_KEY,
                 "--backend", "openai-chat", "--dataset-name", dataset,
                 "--shared-prefix-len", "96", "--shared-prefix-question-len", "8",
                 "--num-prompts", "3", "--max-concurrency", "1", "--output-len", "2",
                 "--seed", "8", "--disable-tqdm", "--save-result", "--no-plots",
                 "--result-dir", str(tmp_path), "--result-filename", "d.json"]) == 0
    r = json.loads((tmp_path / "d.json").read_text())
    assert r["completed"] == 3 and r["dataset_name"] == dataset
    if dataset == "shared-prefix":
        # The 2nd and 3rd requests reuse the 96-token system prompt's full blocks.
        assert r["server_metrics"]["prefix_cache_hits"] >= 2 * 80


def test_without_a_tokenize_endpoint_a_local_tokenizer_counts_prompts(fake_server, tmp_path,
                                                                      caplog):
    url = fake_server(FakePlan())
    assert main(["bench", "serve", "--base-url", url, "--num-prompts", "3",
                 "--random-input-len", "20", "--output-len", "4", "--disable-tqdm",
                 "--save-result", "--save-detailed", "--no-plots", "--result-dir",
                 str(tmp_path), "--result-filename", "l.json"]) == 0
    r = json.loads((tmp_path / "l.json").read_text())
    assert r["tokenizer_id"].startswith("local tokenizer")
    assert r["input_lens"] == [20, 20, 20]  # the fake reports no prompt_tokens for text
    assert "has no /tokenize" in caplog.text
