"""The doctor's rules, shared: thresholds, findings, knobs and the verdict.

``tandem doctor`` (tandem.tools.doctor) measures a server with probes from
outside; the server's dashboard (tandem.entrypoints.server.dashboard) reads
live figures from inside. Both turn what they see into the same ``Finding``s
with the builders here, so a problem reads the same, with the same knob first,
whichever found it. Pure functions of numbers, no HTTP and no engine: the
server may import it, and every rule is tested on synthetic numbers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

# Thresholds: each is the line between "fine" and "a user notices".
TTFT_TARGET_S = 1.0  # a first token within about a second feels responsive in a chat
READABLE_TOK_S = 10.0  # below this, text types out slower than people read
GROWTH = 1.5  # TTFT "grows with the prompt" when the long prompt's is this many times the short's
QUEUE_S = 0.25  # a lone request that waited this long for a slot was queued behind others
KV_FULL = 0.9  # KV cache usage at or above this: the next request preempts or waits
STALL_S = 0.5  # a gap in a running stream this long is a visible stutter ...
STALL_FACTOR = 3.0  # ... when it is also this many times the stream's usual gap
CEILING_LOW = 0.5  # decode below this fraction of the bandwidth ceiling: time goes elsewhere
CEILING_HIGH = 1.3  # decode above this fraction of it: the ceiling's inputs are wrong
CONTEXT_DROP = 0.25  # decode this much slower at the long prompt: the KV read is visible
COLD_START_S = 1.0  # the first request paid this much more than later ones: a model load


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

# The same knob in each server's words.
KNOBS: dict[str, dict[str, str]] = {
    "tandem": {
        "slots": "--max-num-seqs N",
        "queue": "--max-queue N",
        "kv_memory": "--kv-cache-memory (CPU) / --gpu-memory-utilization (GPU)",
        "kv_8bit": "--kv-cache-dtype int8",
        "quantize": "--quantization int8 (int4: fewer bytes still)",
        "budget": "--max-num-batched-tokens",
        "prefix": "prefix caching (on unless --no-enable-prefix-caching): keep shared "
                  "prompt prefixes byte-identical",
        "context": "--max-model-len",
        "keep_alive": "a warm-up request after start (the first pays for lazy "
                      "initialisation; tandem never unloads the model)",
        "size_plan": "tandem plan MODEL --device ... --users N",
    },
    "vllm": {
        "slots": "--max-num-seqs N",
        "queue": "a queue bound in the proxy in front (vLLM has none)",
        "kv_memory": "--gpu-memory-utilization",
        "kv_8bit": "--kv-cache-dtype fp8",
        "quantize": "a quantized checkpoint (AWQ/GPTQ) or --quantization fp8",
        "budget": "--max-num-batched-tokens",
        "prefix": "--enable-prefix-caching, with shared prompt prefixes byte-identical",
        "context": "--max-model-len",
        "keep_alive": "a warm-up request after start (vLLM never unloads the model; the "
                      "first request pays for compilation and CUDA graphs)",
        "size_plan": "tandem plan MODEL --device ... --users N",
    },
    "llama-server": {
        "slots": "-np N, with -c N x the context per conversation (-c is split across slots)",
        "queue": "a queue bound in the proxy in front (llama-server has none)",
        "kv_memory": "-c (total KV tokens over all slots), and -ngl so every layer is on the GPU",
        "kv_8bit": "--cache-type-k q8_0 --cache-type-v q8_0 -fa on",
        "quantize": "a smaller GGUF (Q8_0, Q4_K_M)",
        "budget": "-b / -ub (the logical and physical batch)",
        "prefix": "cache_prompt (on by default) and --cache-reuse 256, with shared prefixes "
                  "byte-identical",
        "context": "-c",
        "keep_alive": "a warm-up request after start (llama-server never unloads the model)",
        "size_plan": "tandem plan MODEL.gguf --device ... --users N",
    },
    "ollama": {
        "slots": "OLLAMA_NUM_PARALLEL=N (Ollama reserves NUM_PARALLEL x OLLAMA_CONTEXT_LENGTH "
                 "tokens of KV: check they fit)",
        "queue": "OLLAMA_MAX_QUEUE",
        "kv_memory": "a smaller OLLAMA_NUM_PARALLEL x OLLAMA_CONTEXT_LENGTH, or more GPU memory",
        "kv_8bit": "OLLAMA_KV_CACHE_TYPE=q8_0 with OLLAMA_FLASH_ATTENTION=1",
        "quantize": "a smaller quantization tag (q4_K_M, q8_0)",
        "budget": "the num_batch option",
        "prefix": "keep each conversation's earlier turns byte-identical (Ollama reuses a "
                  "slot's cached prompt)",
        "context": "OLLAMA_CONTEXT_LENGTH (or num_ctx per request)",
        "keep_alive": "OLLAMA_KEEP_ALIVE=-1 (or keep_alive: -1 per request)",
        "size_plan": "tandem plan MODEL --device ... --users N",
    },
}
KNOBS["openai"] = {
    k: v.replace("--", "the server's --", 1) if v.startswith("--") else v
    for k, v in KNOBS["vllm"].items()
}


def knob(kind: str, name: str) -> str:
    return KNOBS.get(kind, KNOBS["openai"])[name]


def _less_prompt(kind: str) -> list[str]:
    """Advice shared by the prefill findings: fewer prompt tokens to compute."""
    return ["shorter prompts: trim the system prompt, the retrieved context and old turns",
            f"reuse shared prefixes instead of recomputing them: {knob(kind, 'prefix')}"]


def ms(s: float) -> str:
    return f"{s * 1e3:,.0f} ms"


# ------------------------------------------------------------------- findings
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


def weight_bits(level: str | None) -> int | None:
    """Bits a weight of the server's named format (F16, Q8_0, INT8, Q4_K_M...), if known."""
    name = (level or "").upper()
    if name in ("F32", "FP32"):
        return 32
    if name in ("F16", "BF16", "FP16"):
        return 16
    digits = re.match(r"(?:Q|INT|IQ)(\d)", name)
    return int(digits.group(1)) if digits else None


def fewer_bytes(kind: str, level: str | None) -> str:
    """The advice for fewer bytes a token, from what the weights are already (the
    server's quantization level): a model served as Q8_0 is told int4, one at 4
    bits a smaller model (int8 would read more)."""
    bits = weight_bits(level)
    if bits is None or bits > 8:
        return f"quantize the weights (8 bit halves the bytes read per token): " \
               f"{knob(kind, 'quantize')}"
    if bits == 8 and kind == "tandem":
        return "4-bit weights: --quantization int4, or a Q4_0 / Q4_K_M file"
    if bits == 8:
        return f"a 4-bit quantization: {knob(kind, 'quantize')}"
    return f"the weights are already {level} ({bits} bits): a smaller model reads fewer bytes"


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


# ----------------------------------------------------------------- live rules
@dataclass
class LiveFigures:
    """A running server's figures over a recent window, from its own counters.

    Latencies are quantiles of the window's histogram observations, each the
    lower bound of the bucket it falls in: a value the quantile is known to
    reach (None when nothing was observed); counts are what the window added.
    """

    window_s: float
    waiting: int
    peak_running: int  # the most requests running at once in the window
    max_num_seqs: int | None  # the server's sequence slots (None: not known)
    oldest_wait_s: float  # the longest wait of a request not yet started (0: none waits)
    kv_usage: float  # 0..1, now
    preemptions: int
    rejections: int
    prefill_tokens: int  # prompt tokens computed in the window
    queue_p95_s: float | None = None
    ttft_p95_s: float | None = None
    itl_p50_s: float | None = None
    itl_p99_s: float | None = None
    ttft_target_s: float | None = None  # the server's --slo-ttft-ms; None: TTFT_TARGET_S
    itl_target_s: float | None = None  # --slo-itl-ms; None: reading speed, 1 / READABLE_TOK_S
    quantization_level: str | None = None  # the weights' format, as /api/tags names it


def diagnose_live(f: LiveFigures, kind: str = "tandem") -> list[Finding]:
    """The doctor's rules over live figures: every finding they support, most urgent first."""
    w = f"over the last {f.window_s:g} s"
    ttft_target = f.ttft_target_s or TTFT_TARGET_S
    itl_target = f.itl_target_s or 1 / READABLE_TOK_S
    found: list[Finding | None] = []
    if f.rejections:
        found.append(rejected_finding(
            kind, f"{f.rejections} requests were refused with 503 {w}"))
    queue_s = f.queue_p95_s or 0.0
    wait = max(queue_s, f.oldest_wait_s)
    cache_full = bool(f.preemptions) or f.kv_usage >= KV_FULL
    # A wait the first token absorbs within its target is no problem: the verdict
    # said "the first token is slow" at TTFT p95 0.65 s against a 1 s target.
    within_target = (f.ttft_p95_s is not None and f.ttft_p95_s < ttft_target
                     and f.oldest_wait_s < ttft_target)
    # a full cache's wait is the cache's finding
    if wait >= QUEUE_S and not cache_full and not within_target:
        ev = f"requests wait {wait:.1f} s before they start ({f.waiting} waiting now"
        ev += f"; queue time p95 at least {ms(queue_s)} {w})" if queue_s else ")"
        values = {"wait_s": wait, "waiting": f.waiting, "peak_running": f.peak_running}
        if f.max_num_seqs is not None and f.peak_running < f.max_num_seqs:
            found.append(budget_wait_finding(
                kind, f"{ev}, with at most {f.peak_running} of {f.max_num_seqs} sequence slots "
                "in use", values))
        else:
            found.append(queue_finding(kind, ev, values))
    parts = [f"requests wait {wait:.1f} s to start"] if wait >= QUEUE_S and cache_full else []
    if f.preemptions:
        parts.append(f"{f.preemptions} preemptions {w}")
    if f.kv_usage >= KV_FULL:
        parts.append(f"KV cache usage is {f.kv_usage:.0%}")
    if parts:
        found.append(cache_finding(kind, "; ".join(parts),
                                   {"preemptions": f.preemptions, "kv_usage": f.kv_usage}))
    if f.ttft_p95_s is not None and f.ttft_p95_s >= ttft_target and wait < QUEUE_S:
        found.append(prefill_finding(
            kind, "TTFT is over its target while requests barely queue",
            f"TTFT p95 at least {ms(f.ttft_p95_s)} {w} (target {ms(ttft_target)}) while "
            "requests barely queue: the time is prefill",
            {"ttft_p95_s": f.ttft_p95_s, "queue_p95_s": queue_s}))
    if f.itl_p50_s is not None and f.itl_p50_s >= itl_target:
        found.append(slow_decode_finding(
            kind, f"inter-token latency p50 at least {ms(f.itl_p50_s)} {w}, over the "
            f"{ms(itl_target)} target: at most {1 / f.itl_p50_s:.1f} tok/s per stream",
            {"itl_p50_s": f.itl_p50_s}, "tandem doctor --device or --bandwidth",
            f.quantization_level))
    elif (f.itl_p50_s is not None and f.itl_p99_s is not None and f.prefill_tokens
          and f.itl_p99_s >= STALL_S and f.itl_p99_s >= STALL_FACTOR * f.itl_p50_s):
        found.append(stall_finding(
            kind, f"inter-token latency p99 at least {ms(f.itl_p99_s)} against a p50 of "
            f"{ms(f.itl_p50_s)} {w}, while {f.prefill_tokens:,} prompt tokens were prefilled",
            {"itl_p99_s": f.itl_p99_s, "itl_p50_s": f.itl_p50_s}))
    return sort_findings(found)
