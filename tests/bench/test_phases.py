"""``bench phases``: TTFT grows with the prompt, decode speed barely moves — measured on the
default model, read from tandem's phase split or Ollama's counters."""

from __future__ import annotations

import json
import math

import pytest

from tandem.entrypoints.cli import main
from tandem.tools.bench.client import RequestResult
from tandem.tools.bench.phases import PhaseRow, conclusion, measure
from tests.bench.conftest import API_KEY


def test_openai_phases_on_the_default_model(real_server, tmp_path, capsys):
    assert main(["bench", "phases", "--base-url", real_server.url, "--api-key", API_KEY,
                 "--input-lens", "16,320", "--output-len", "6", "--repetitions", "2",
                 "--seed", "5", "--save-result", "--result-dir", str(tmp_path),
                 "--result-filename", "p.json"]) == 0
    data = json.loads((tmp_path / "p.json").read_text())
    short, long = data["rows"]
    assert short["prompt_tokens"] == pytest.approx(16, abs=2)
    assert long["prompt_tokens"] == pytest.approx(320, abs=2)
    # Every prompt was fresh: no prefix-cache hit hides the prefill.
    assert all(m["cached_tokens"] == 0 for m in data["requests"])
    assert all(m["server_timed"] and m["output_tokens"] == 6 for m in data["requests"])
    assert long["ttft_ms"] > 2 * short["ttft_ms"]  # 20x the prompt: prefill dominates
    assert short["decode_tok_s"] > 0 and long["decode_tok_s"] > 0
    assert data["conclusion"][1].startswith("Conclusion: TTFT grows with prompt length")
    assert "tandem object" in data["phase_source"]
    out = capsys.readouterr().out
    assert "prompt tokens   TTFT ms prefill tok/s decode tok/s" in out
    assert data["conclusion"][0] in out


def test_ollama_phases_read_the_counters(real_server, recording_proxy, tmp_path):
    proxy = recording_proxy(real_server.url)
    assert main(["bench", "phases", "--base-url", proxy.url, "--api-key", API_KEY,
                 "--backend", "ollama", "--input-lens", "16,128", "--output-len", "4",
                 "--repetitions", "1", "--num-warmups", "0", "--seed", "2", "--save-result",
                 "--result-dir", str(tmp_path), "--result-filename", "o.json"]) == 0
    data = json.loads((tmp_path / "o.json").read_text())
    assert "Ollama's prompt_eval_*/eval_* counters" in data["phase_source"]
    for i, (n, m) in enumerate(zip((16, 128), data["requests"])):
        done = proxy.exchanges[f"phases-{n}-{i}"].final()
        assert m["prefill_tok_s"] == pytest.approx(
            done["prompt_eval_count"] / (done["prompt_eval_duration"] / 1e9))
        if done["eval_count"] > 1:
            assert m["decode_tok_s"] == pytest.approx(
                (done["eval_count"] - 1) / (done["eval_duration"] / 1e9))


def test_measure_prefers_server_timings_and_falls_back_to_the_clock():
    tandem_split = {"prefill_s": 0.5, "decode_s": 1.0, "cached_tokens": 100.0}
    r = RequestResult(success=True, prompt_len=300, output_tokens=11, ttft=0.6,
                      itl=[0.1] * 10, latency=1.6, server=tandem_split)
    m = measure(300, r)
    assert m.server_timed and m.prefill_tok_s == 400.0  # (300 - 100 cached) / 0.5
    assert m.decode_tok_s == 10.0 and m.cached_tokens == 100
    r.server = None
    m = measure(300, r)
    assert not m.server_timed
    assert m.prefill_tok_s == pytest.approx(500.0)  # 300 / TTFT
    assert m.decode_tok_s == pytest.approx(10.0)  # 10 gaps in 1.0 s
    r.server = {"prefill_s": 0.2, "decode_s": 2.0, "prompt_eval_count": 40.0}
    m = measure(300, r)
    assert m.prefill_tok_s == 200.0 and m.decode_tok_s == 5.0  # Ollama's counters


def _row(prompt: float, ttft: float, decode: float) -> PhaseRow:
    return PhaseRow(int(prompt), prompt, 0, 64, ttft, prompt / ttft * 1000, decode, 50, 60, 3)


@pytest.mark.parametrize(("rows", "verdict"), [
    ([_row(200, 100, 20.0), _row(2000, 900, 19.0)], "barely moves"),
    ([_row(200, 100, 20.0), _row(2000, 900, 14.0)], "Decode also changed by -30%"),
    ([_row(200, 100, 20.0), _row(2000, 120, 19.0)], "TTFT barely grew"),
    ([_row(200, 100, 20.0), _row(300, 150, 19.0)], "too close in length"),
])
def test_conclusion_says_what_the_numbers_show(rows, verdict):
    text = " ".join(conclusion(rows))
    assert verdict in text
    assert text.startswith(f"Prompt {rows[1].prompt_tokens / rows[0].prompt_tokens:.1f}x longer")


def test_measure_with_a_single_token_has_no_decode_speed():
    m = measure(10, RequestResult(success=True, prompt_len=10, output_tokens=1, ttft=0.1,
                                  latency=0.1))
    assert math.isnan(m.decode_tok_s)
