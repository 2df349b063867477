"""``Finding``, the builders of the findings both rule sets share, and the verdict.

A finding the doctor's probes and the live figures can both support is built
here once, so it reads the same, with the same knobs in the same order,
whichever found it; only the evidence differs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.diagnosis.knobs import fewer_bytes, knob


@dataclass
class Finding:
    """One diagnosis: the phase it concerns, the evidence, and the knobs in order."""

    rule: str
    severity: str  # "problem" | "warning" | "ok"
    phase: str  # "queue" | "cache" | "prefill" | "decode" | "startup"
    title: str
    evidence: str
    knobs: list[str] = field(default_factory=list)
    values: dict[str, float] = field(default_factory=dict)


SEVERITY_ORDER = {"problem": 0, "warning": 1, "ok": 2}
PHASE_ORDER = {"queue": 0, "cache": 1, "startup": 2, "prefill": 3, "decode": 4}


def _less_prompt(kind: str) -> list[str]:
    """Advice shared by the prefill findings: fewer prompt tokens to compute."""
    return ["shorter prompts: trim the system prompt, the retrieved context and old turns",
            f"reuse shared prefixes instead of recomputing them: {knob(kind, 'prefix')}"]


def ms(s: float) -> str:
    return f"{s * 1e3:,.0f} ms"


def gb(n: float) -> str:
    """Bytes as GB (1e9, as bandwidths are quoted), or MB below one GB."""
    return f"{n / 1e9:,.2f} GB" if n >= 1e9 else f"{n / 1e6:,.1f} MB"


def queue_finding(kind: str, evidence: str, values: dict[str, float]) -> Finding:
    return Finding(
        "queue_waiting", "problem", "queue",
        "Requests wait in a queue before they start: TTFT includes time doing nothing",
        evidence,
        [
            f"more slots if memory allows: {knob(kind, 'slots')}",
            "else fewer users per server (another replica): the queue only moves the wait",
            f"and a short queue bound: {knob(kind, 'queue')}",
        ],
        values,
    )


def budget_wait_finding(kind: str, evidence: str, values: dict[str, float]) -> Finding:
    """Requests queue with sequence slots free: what they wait for is prefill budget."""
    return Finding(
        "prefill_queue", "problem", "prefill",
        "Requests wait to start while sequence slots are free: prompts are prefilled a few "
        "at a time, within the per-step token budget",
        evidence,
        [
            f"a larger per-step token budget, so waiting prompts start sooner: "
            f"{knob(kind, 'budget')} (it costs running streams smoothness)",
            *_less_prompt(kind),
        ],
        values,
    )


def rejected_finding(kind: str, evidence: str) -> Finding:
    return Finding(
        "rejected", "problem", "queue",
        "The server refused a request as overloaded: its queue is full",
        evidence,
        [f"more slots: {knob(kind, 'slots')}", f"a longer queue: {knob(kind, 'queue')}",
         "or more servers: at this load requests cannot all be served"],
    )


def cache_finding(kind: str, evidence: str, values: dict[str, float]) -> Finding:
    return Finding(
        "kv_cache_full", "problem", "cache",
        "The KV cache is full: requests are preempted (recomputed) or wait for blocks, so "
        "concurrency stops at what the cache holds",
        evidence,
        [
            f"give the cache more memory: {knob(kind, 'kv_memory')}",
            f"store it in 8 bits: {knob(kind, 'kv_8bit')}",
            f"a shorter context per conversation: {knob(kind, 'context')}",
            f"or fewer slots, so those that run fit: {knob(kind, 'slots')}; size it with "
            f"{knob(kind, 'size_plan')}",
        ],
        values,
    )


def prefill_finding(kind: str, why: str, evidence: str, values: dict[str, float]) -> Finding:
    return Finding(
        "slow_prefill", "problem", "prefill",
        f"The first token is slow because of prefill: {why}",
        evidence,
        [
            *_less_prompt(kind),
            f"a larger per-step token budget so a prompt prefills in fewer steps: "
            f"{knob(kind, 'budget')} (it costs running streams smoothness)",
            "prefill is compute bound: beyond that, only faster compute (a GPU) helps",
        ],
        values,
    )



def slow_decode_finding(kind: str, evidence: str, values: dict[str, float],
                        how_to_compare: str, level: str | None = None) -> Finding:
    """``how_to_compare``: where the reader finds the bandwidth ceiling to compare with;
    ``level``: the weights' format where the server names it (a 4-bit model is not
    told to quantize)."""
    return Finding(
        "slow_decode", "problem", "decode",
        "The text types out slowly: decode, which is memory-bandwidth bound",
        evidence,
        [
            fewer_bytes(kind, level),
            f"compare with the bandwidth ceiling ({how_to_compare})",
            f"lower the per-step token budget if long prompts run alongside: "
            f"{knob(kind, 'budget')}",
            f"keep the context short (every step also reads the KV cache): "
            f"{knob(kind, 'context')}",
        ],
        values,
    )


def stall_finding(kind: str, evidence: str, values: dict[str, float]) -> Finding:
    return Finding(
        "prefill_stalls_decode", "problem", "decode",
        "Running streams stutter when someone else's long prompt arrives: its prefill holds "
        "the batch up",
        evidence,
        [
            f"lower the per-step token budget so prefill runs in small chunks between decode "
            f"steps: {knob(kind, 'budget')}",
            "prefill is compute bound: on a busy CPU expect it; a GPU shrinks the chunks' cost",
        ],
        values,
    )


def sort_findings(found: list[Finding | None]) -> list[Finding]:
    """The findings that fired, the most urgent first."""
    out = [f for f in found if f is not None]
    out.sort(key=lambda f: (SEVERITY_ORDER[f.severity], PHASE_ORDER[f.phase]))
    return out


def verdict(findings: list[Finding]) -> str:
    """One sentence: which phase is slow and the first knob to turn."""
    problems = [f for f in findings if f.severity == "problem"]
    if not problems:
        warn = [f for f in findings if f.severity == "warning"]
        if warn:
            return f"No outright problem; worth a look: {warn[0].title.split(':')[0].lower()}."
        return ("Healthy: no queue, no cache pressure, the first token and the decode speed "
                "are within their targets.")
    f = problems[0]
    what = {
        "queue": "the time goes to waiting in a queue, not to the model",
        "cache": "the KV cache is too small for the load",
        "startup": "the first token waits for something other than prefill",
        "prefill": "the first token is slow: prefill (the prompts' compute, or the "
                   "per-step budget it gets)",
        "decode": "the typing speed is slow: decode",
    }[f.phase]
    return f"{what[0].upper()}{what[1:]}. First knob: {f.knobs[0]}."

