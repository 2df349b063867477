"""``bench compare``: side by side, ratios against the first file, better/worse per metric."""

from __future__ import annotations

import json

import pytest

from tandem.entrypoints.cli import main
from tandem.tools.bench.compare import compare_table, ratio_text


def _write(path, label: str, **values) -> str:
    base = {"label": label, "backend": "openai", "model_id": "m", "completed": 100,
            "failed": 0, "duration": 50.0, "request_throughput": 2.0,
            "output_throughput": 200.0, "mean_ttft_ms": 400.0, "p99_ttft_ms": 900.0,
            "p95_itl_ms": 60.0, "request_rate": "inf", "max_concurrency": 8}
    base.update(values)
    path.write_text(json.dumps(base))
    return str(path)


def test_ratios_and_verdicts(tmp_path, capsys):
    a = _write(tmp_path / "a.json", "vllm")
    b = _write(tmp_path / "b.json", "tandem", output_throughput=300.0, mean_ttft_ms=200.0,
               p99_ttft_ms=909.0, server_metrics={"num_preemptions": 3})
    assert main(["bench", "compare", a, b]) == 0
    lines = {line.split("  ")[0]: line for line in capsys.readouterr().out.splitlines()}
    assert lines["Output token throughput (tok/s)"].split()[-3:] == ["300.00", "1.50x", "better"]
    assert lines["Mean TTFT (ms)"].split()[-2:] == ["0.50x", "better"]
    assert lines["P99 TTFT (ms)"].split()[-1] == "1.01x"  # within 2%: no verdict
    assert lines["P95 ITL (ms)"].split()[-1] == "1.00x"
    assert lines["Max concurrency"].split()[-2:] == ["8", "1.00x"]
    assert "Server preemptions" in lines  # one file has it: shown, n/a for the other
    assert lines["metric"].split()[1:] == ["vllm", "tandem", "tandem/vllm"]


def test_verdict_direction():
    assert ratio_text(100, 50, higher_is_better=False) == "0.50x better"
    assert ratio_text(100, 50, higher_is_better=True) == "0.50x worse"
    assert ratio_text(100, 150, higher_is_better=None) == "1.50x"
    assert ratio_text(0, 5, higher_is_better=True) == "n/a"
    assert ratio_text("inf", 4.0, higher_is_better=None) == ""


def test_bad_inputs(tmp_path):
    a = _write(tmp_path / "a.json", "x")
    with pytest.raises(ValueError, match="at least two results"):
        compare_table([a])
    (tmp_path / "junk.json").write_text('{"hello": 1}')
    with pytest.raises(ValueError, match="not a `bench serve`"):
        compare_table([a, str(tmp_path / "junk.json")])
    with pytest.raises(ValueError, match="no such file"):
        compare_table([a, str(tmp_path / "missing.json")])


def test_same_labels_fall_back_to_file_names(tmp_path):
    a = _write(tmp_path / "run1.json", "same")
    b = _write(tmp_path / "run2.json", "same")
    assert compare_table([a, b]).splitlines()[0].split()[1:] == ["same", "run2", "run2/same"]


def test_a_sweep_file_is_one_column_per_point(tmp_path):
    a = json.loads(open(_write(tmp_path / "a.json", "x")).read())
    b = dict(a, output_throughput=500.0)
    (tmp_path / "sweep.json").write_text(json.dumps(
        {"sweep": "max-concurrency", "values": [1, 8], "results": [a, b]}))
    lines = compare_table([str(tmp_path / "sweep.json")]).splitlines()
    assert lines[0].split()[1:] == ["max-concurrency=1", "max-concurrency=8",
                                    "max-concurrency=8/max-concurrency=1"]
    row = next(x for x in lines if x.startswith("Output token throughput"))
    assert row.split()[-2:] == ["2.50x", "better"]
