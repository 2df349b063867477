"""One self-contained HTML file per run: the table, the plots (inline PNGs), the errors.

Self-contained so it can be mailed, attached to an issue or opened from a
CI artifact without the PNGs next to it.
"""

from __future__ import annotations

import base64
import html
from pathlib import Path
from typing import Any

_CONFIG_KEYS = ("date", "base_url", "endpoint", "backend", "model_id", "dataset_name",
                "num_prompts", "request_rate", "burstiness", "max_concurrency", "seed",
                "tokenizer_id", "goodput_config")

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1050px; color: #222; }
pre { background: #f6f8fa; padding: 1em; overflow-x: auto; }
table { border-collapse: collapse; } td { padding: 2px 12px 2px 0; vertical-align: top; }
img { max-width: 100%; border: 1px solid #ddd; margin: 0.5em 0; }
.err { color: #b00; }
"""


def write_html(path: Path, title: str, result: dict[str, Any], table: str, pngs: list[Path],
               errors: list[str], notes: list[str] | None = None) -> Path:
    config = "".join(
        f"<tr><td>{html.escape(k)}</td><td>{html.escape(str(result.get(k)))}</td></tr>"
        for k in _CONFIG_KEYS if result.get(k) is not None)
    images = "".join(
        f'<img alt="{html.escape(p.stem)}" src="data:image/png;base64,'
        f'{base64.b64encode(p.read_bytes()).decode()}">' for p in pngs)
    errs = ""
    if errors:
        items = "".join(f"<li>{html.escape(e)}</li>" for e in errors)
        errs = f'<h2>Failed requests</h2><ul class="err">{items}</ul>'
    note = "".join(f"<p>{html.escape(n)}</p>" for n in notes or [])
    path.write_text(
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>{_STYLE}</style></head><body><h1>{html.escape(title)}</h1>{note}"
        f"<h2>Configuration</h2><table>{config}</table>"
        f"<h2>Result</h2><pre>{html.escape(table)}</pre>{errs}"
        f"<h2>Plots</h2>{images}</body></html>\n")
    return path
