"""``bench serve --sweep``: the same workload at several concurrencies or rates.

Throughput rises with concurrency while p99 latency stays flat — until the
batch step becomes compute bound, the KV pool fills or requests queue; then
latency turns up and throughput stops growing. That knee is the server's
capacity for this workload, and the number to plan with.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
from pathlib import Path

from tandem.tools.bench.metrics import PERCENTILE_METRICS
from tandem.tools.bench.report import format_table, strip_detailed, write_json
from tandem.tools.bench.serve import Settings, parse_sweep, run_once
from tandem.tools.bench.target import Target
from tandem.tools.bench.tokens import TextTokenizer

_HEADER = (f"{'value':>8} {'ok':>5} {'failed':>6} {'req/s':>8} {'out tok/s':>10} "
           f"{'p50 TTFT':>9} {'p99 TTFT':>9} {'p50 ITL':>8} {'p99 ITL':>8}")


def sweep_row(value: float, r: dict) -> str:
    def ms(key: str) -> str:
        v = r.get(key)
        return f"{v:.0f}" if isinstance(v, (int, float)) else "n/a"

    return (f"{value:>8g} {r['completed']:>5} {r['failed']:>6} {r['request_throughput']:>8.2f} "
            f"{r['output_throughput']:>10.1f} {ms('p50_ttft_ms'):>9} {ms('p99_ttft_ms'):>9} "
            f"{ms('p50_itl_ms'):>8} {ms('p99_itl_ms'):>8}")


def sweep_table(param: str, points: list[tuple[float, dict]]) -> str:
    title = f" Sweep over {param} (latencies in ms) "
    return "\n".join(["{s:{c}^{n}}".format(s=title, n=len(_HEADER), c="="), _HEADER]
                     + [sweep_row(v, r) for v, r in points] + ["=" * len(_HEADER)])


def run_sweep(a: argparse.Namespace, s: Settings, target: Target,
              tokenizer: TextTokenizer | None) -> int:
    attr, values = parse_sweep(a.sweep)
    # The sweep table and plot need p50/p99 of TTFT and ITL, whatever else was asked for.
    wanted = set(s.percentile_metrics) | {"ttft", "itl"}
    s = dataclasses.replace(s, percentiles=sorted(set(s.percentiles) | {50.0, 99.0}),
                            percentile_metrics=[m for m in PERCENTILE_METRICS if m in wanted])
    points: list[tuple[float, dict]] = []
    for i, value in enumerate(values):
        point = copy.copy(a)
        setattr(point, attr, int(value) if attr == "max_concurrency" else value)
        point.seed = a.seed + i  # fresh prompts: no point answers from the last one's cache
        print(f"\n--- sweep point {i + 1}/{len(values)}: {attr} = {value:g} ---")
        result, _ = run_once(point, s, target, tokenizer)
        print(format_table(result, s.percentile_metrics, s.percentiles))
        points.append((value, result))
    param = attr.replace("_", "-")
    table = sweep_table(param, points)
    print("\n" + table)
    if a.save_result or a.result_filename or a.result_dir:
        label = a.label or target.backend
        date = points[0][1]["date"]
        name = a.result_filename or f"{label}-sweep-{param}-{target.model.split('/')[-1]}-" \
                                    f"{date}.json"
        path = Path(a.result_dir or ".") / name
        write_json(path, {"sweep": param, "values": values,
                          "results": [r if a.save_detailed else strip_detailed(r)
                                      for _, r in points]})
        print(f"saved {path}")
        if not a.no_plots:
            from tandem.tools.bench.html import write_html
            from tandem.tools.bench.plots import plot_sweep

            png = plot_sweep(param, points, Path(f"{path.with_suffix('')}-sweep.png"))
            html = write_html(Path(f"{path.with_suffix('')}.html"),
                              f"tandem bench serve --sweep {a.sweep}", points[0][1], table,
                              [png], [])
            print(f"saved {png}\nsaved {html}")
    return 0 if any(r["completed"] for _, r in points) else 1
