"""The doctor's report: the measurements, the findings with their knobs, the verdict.

The rules are ``tandem.diagnosis.probe_rules``; this only lays out what they
found, as text wrapped for a terminal (``--json`` prints the same as data).
"""

from __future__ import annotations

import math
import textwrap

from tandem.diagnosis.findings import Finding, gb, ms, verdict
from tandem.diagnosis.measurements import Measurements, MetricsSample, Probe
from tandem.diagnosis.probe_rules import decode_ceiling, pair_overlap, prefill_rate

KINDS = ("tandem", "vllm", "llama-server", "ollama", "openai")
KIND_NAMES = {
    "tandem": "tandem", "vllm": "vLLM", "llama-server": "llama-server", "ollama": "Ollama",
    "openai": "an OpenAI-compatible server",
}


def _fmt(x: float | None, unit: str = "", digits: int = 0) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return f"{x:,.{digits}f}{unit}"


def _probe_line(p: Probe) -> str:
    if not p.ok:
        return f"failed: {p.error}"
    s = f"{p.prompt_tokens:,} prompt tokens: TTFT {ms(p.ttft_s)}"
    split = []
    if p.server_queue_s is not None:
        split.append(f"queue {ms(p.server_queue_s)}")
    if p.server_prefill_s is not None:
        rate = p.prefill_tok_s
        split.append(f"prefill {ms(p.server_prefill_s)}"
                     + (f" = {rate:,.0f} tok/s" if not math.isnan(rate) else ""))
    if p.cached_tokens:
        split.append(f"{p.cached_tokens} cached")
    if split:
        s += " (server: " + ", ".join(split) + ")"
    if p.output_tokens > 1:
        s += f"; {p.output_tokens} tokens at {_fmt(p.decode_tok_s, ' tok/s', 1)}"
    return s


def _fill(text: str, width: int, first: str, rest: str) -> str:
    """Wrap without splitting flags like --max-num-batched-tokens at their hyphens."""
    return textwrap.fill(text, width, initial_indent=first, subsequent_indent=rest,
                         break_on_hyphens=False)


def format_report(m: Measurements, findings: list[Finding]) -> str:
    width = 100
    out = [f"tandem doctor: {m.url} is {KIND_NAMES.get(m.kind, m.kind)}, model {m.model}"
           + (f", context {m.max_model_len:,}" if m.max_model_len else "")]
    if m.detected_from:
        out.append(_fill(f"(detected from {', '.join(m.detected_from)})", width, "  ", "   "))
    out += ["", "Measurements"]

    def line(label: str, text: str) -> None:
        body = textwrap.wrap(text, width - 22, break_on_hyphens=False) or [""]
        out.append(f"  {label:<20}{body[0]}")
        out.extend(" " * 22 + b for b in body[1:])

    if m.warmup is not None:
        line("first request", _probe_line(m.warmup))
    if m.short is not None:
        line("short prompt", _probe_line(m.short))
    if m.long is not None:
        line("long prompt", _probe_line(m.long))
    rate, how = prefill_rate(m)
    if not math.isnan(rate):
        line("prefill rate", f"{rate:,.0f} tok/s ({how})")
    if m.stream is not None:
        s = m.stream
        line("decode, 1 stream", f"failed: {s.error}" if not s.ok else
             f"{s.output_tokens} tokens at {_fmt(s.decode_tok_s, ' tok/s', 1)}; ITL p50 "
             f"{ms(s.itl_p50_s)}, p99 {ms(s.itl_p99_s)}")
    a, b = m.pair_first, m.pair_second
    if a is not None and b is not None:
        if not (a.ok and b.ok):
            line("two at once", f"failed: {a.error or b.error}")
        else:
            ov = pair_overlap(m)
            assert ov is not None
            overlap, extra, _ = ov
            line("two at once",
                 f"a {b.prompt_tokens:,}-token prompt sent {b.sent_s:.2f} s into a stream got "
                 f"its first token after {b.ttft_s:.2f} s ({extra:+.2f} s vs alone); the two "
                 + (f"streamed together for {overlap:.2f} s" if overlap > 0 else
                    "never streamed at the same time"))
    if m.metrics_before is not None:
        bf, af, pk = m.metrics_before, m.metrics_after or MetricsSample(), m.metrics_peak
        pk = pk or MetricsSample()
        pre = (
            f", preemptions {_fmt((af.preemptions or 0) - (bf.preemptions or 0), '', 0)} "
            "during the probes" if bf.preemptions is not None else ""
        )
        line("/metrics",
             f"before: {_fmt(bf.running)} running, {_fmt(bf.waiting)} waiting, KV "
             f"{_fmt(None if bf.kv_usage is None else bf.kv_usage * 100, '%', 1)}; during: peak "
             f"{_fmt(pk.running)} running, {_fmt(pk.waiting)} waiting, KV "
             f"{_fmt(None if pk.kv_usage is None else pk.kv_usage * 100, '%', 1)}{pre}")
    ceiling = decode_ceiling(m)
    if ceiling is not None:
        line("decode ceiling",
             f"{m.bandwidth_bytes_s / 1e9:,.0f} GB/s ({m.bandwidth_source}) / "
             f"{gb(m.model_bytes)} ({m.model_bytes_source}) = {ceiling:,.1f} tok/s")
    elif m.model_bytes:
        line("decode ceiling",
             f"model {gb(m.model_bytes)} ({m.model_bytes_source}); give --bandwidth "
             "or --device to compare decode with bandwidth / bytes")
    for n in m.notes:
        line("note", n)

    out += ["", "Findings"]
    marks = {"problem": "!", "warning": "~", "ok": "+"}
    if not findings:
        out.append("  + nothing out of line: the probes found no queue, no cache pressure, "
                   "and TTFT and decode within their targets")
    for f in findings:
        out.append(_fill(f"{marks[f.severity]} [{f.phase}] {f.title}", width, "  ", "      "))
        out.append(_fill(f"because: {f.evidence}", width, "      ", "        "))
        for i, k in enumerate(f.knobs):
            label = "turn first:" if i == 0 else "then:"
            out.append(_fill(f"{label} {k}", width, "      ", "        "))
    out += ["", _fill("Verdict: " + verdict(findings), width, "", "")]
    return "\n".join(out)
