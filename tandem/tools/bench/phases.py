"""``tandem bench phases``: the one-minute experiment that separates prefill from decode.

Send prompts of ~200 and ~2,000 tokens (``--input-lens``), the same output
length, one request at a time, a few repetitions each, every prompt fresh (a
prefix-cache hit would hide the prefill). Prefill reads the whole prompt in
one compute-bound pass, so TTFT grows with the prompt; decode reads the
weights once per token whatever the prompt, so the streaming speed barely
moves. The command prints both per prompt length and says whether this
server shows that — or what it shows instead.

Prefill and decode speeds come from the server's own phase timings when it
reports them (tandem's ``tandem`` object, Ollama's ``prompt_eval_*`` /
``eval_*`` counters); otherwise from the client's clock: prompt tokens ÷
TTFT (an underestimate: TTFT also holds the network and any queueing) and
1 ÷ TPOT. Decode speed is (output tokens - 1) ÷ decode time: the first token
belongs to prefill (for Ollama's own counters that is within one token of
eval_count ÷ eval_duration).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from tandem.tools.bench.client import REQUEST_FUNCS, RequestInput, RequestResult, send
from tandem.tools.bench.datasets import SampleRequest
from tandem.tools.bench.report import write_json
from tandem.tools.bench.runner import make_client
from tandem.tools.bench.target import Target, parse_headers, resolve_seed, resolve_target
from tandem.tools.bench.tokens import PromptBuilder, choose_tokenizer


@dataclass
class Measurement:
    """One request of the experiment, reduced to the phase numbers."""

    target_len: int
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    ttft_ms: float
    prefill_tok_s: float
    decode_tok_s: float
    itls_ms: list[float]
    server_timed: bool  # prefill/decode from the server's own timings


@dataclass
class PhaseRow:
    target_len: int
    prompt_tokens: float
    cached_tokens: float
    output_tokens: float
    ttft_ms: float
    prefill_tok_s: float
    decode_tok_s: float
    itl_p50_ms: float
    itl_p99_ms: float
    repetitions: int


def parse_lengths(text: str) -> list[int]:
    try:
        lens = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--input-lens: cannot read {text!r} (e.g. 200,2000)") from None
    if not lens or any(n < 1 for n in lens):
        raise ValueError(f"--input-lens must be positive token counts, got {text!r}")
    return sorted(set(lens))


def measure(target_len: int, r: RequestResult) -> Measurement:
    """Phase numbers of one successful request (server timings preferred)."""
    srv = r.server or {}
    cached = int(srv.get("cached_tokens", 0))
    prompt = r.prompt_len
    if "prompt_eval_count" in srv:  # Ollama: the counters are the source of truth
        computed = srv["prompt_eval_count"]
        prompt = max(prompt, int(computed))
    else:
        computed = prompt - cached
    decode_gaps = r.output_tokens - 1
    server_timed = srv.get("prefill_s", 0) > 0 and srv.get("decode_s", 0) > 0
    if server_timed:
        prefill = computed / srv["prefill_s"]
        decode = decode_gaps / srv["decode_s"] if decode_gaps > 0 else float("nan")
    else:
        prefill = prompt / r.ttft if r.ttft > 0 else float("nan")
        span = r.latency - r.ttft
        decode = decode_gaps / span if decode_gaps > 0 and span > 0 else float("nan")
    return Measurement(target_len, prompt, cached, r.output_tokens, r.ttft * 1000, prefill,
                       decode, [x * 1000 for x in r.itl], server_timed)


def aggregate(ms: list[Measurement]) -> list[PhaseRow]:
    """Medians per prompt length (ITL percentiles pooled over the repetitions)."""
    rows = []
    for n in sorted({m.target_len for m in ms}):
        group = [m for m in ms if m.target_len == n]
        itls = [x for m in group for x in m.itls_ms] or [float("nan")]
        rows.append(PhaseRow(
            target_len=n, prompt_tokens=statistics.median(m.prompt_tokens for m in group),
            cached_tokens=statistics.median(m.cached_tokens for m in group),
            output_tokens=statistics.median(m.output_tokens for m in group),
            ttft_ms=statistics.median(m.ttft_ms for m in group),
            prefill_tok_s=statistics.median(m.prefill_tok_s for m in group),
            decode_tok_s=statistics.median(m.decode_tok_s for m in group),
            itl_p50_ms=float(np.percentile(itls, 50)), itl_p99_ms=float(np.percentile(itls, 99)),
            repetitions=len(group)))
    return rows


def format_rows(rows: list[PhaseRow]) -> str:
    head = (f"{'prompt tokens':>13} {'TTFT ms':>9} {'prefill tok/s':>13} {'decode tok/s':>12} "
            f"{'ITL p50 ms':>10} {'ITL p99 ms':>10} {'output':>6} {'cached':>6}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.prompt_tokens:>13.0f} {r.ttft_ms:>9.1f} {r.prefill_tok_s:>13.1f} "
                     f"{r.decode_tok_s:>12.2f} {r.itl_p50_ms:>10.1f} {r.itl_p99_ms:>10.1f} "
                     f"{r.output_tokens:>6.0f} {r.cached_tokens:>6.0f}")
    return "\n".join(lines)


def conclusion(rows: list[PhaseRow]) -> list[str]:
    """What the shortest vs the longest prompt show, in prefill / decode terms."""
    if len(rows) < 2:
        return ["Give two or more --input-lens to compare prefill and decode."]
    short, long = rows[0], rows[-1]
    len_x = long.prompt_tokens / short.prompt_tokens
    ttft_x = long.ttft_ms / short.ttft_ms
    dec_x = long.decode_tok_s / short.decode_tok_s
    lines = [f"Prompt {len_x:.1f}x longer ({short.prompt_tokens:.0f} -> "
             f"{long.prompt_tokens:.0f} tokens): TTFT {ttft_x:.1f}x "
             f"({short.ttft_ms:.0f} -> {long.ttft_ms:.0f} ms), decode speed {dec_x:.2f}x "
             f"({(dec_x - 1) * 100:+.0f}%)."]
    if len_x < 2:
        return lines + ["The prompts are too close in length to separate the phases: use "
                        "lengths at least 4x apart (e.g. --input-lens 200,2000)."]
    if ttft_x < 1.5:
        return lines + [
            "TTFT barely grew with the prompt, so prefill is not what the first token waits "
            "for here: check for queueing (vllm:num_requests_waiting > 0), prefix-cache hits "
            "(the 'cached' column) or a fixed network/HTTP overhead."]
    prefill = ("Conclusion: TTFT grows with prompt length — the first token pays for reading "
               "the whole prompt (prefill, compute bound).")
    if abs(dec_x - 1) <= 0.15:
        return lines + [
            prefill + " The streaming speed barely moves — every later token costs one read "
            "of the weights (decode, memory-bandwidth bound), whatever the prompt.",
            "So a slow first token is a prefill (or queue) problem: shorter prompts, prefix "
            "caching, a larger --max-num-batched-tokens. Slow typing is a decode problem: "
            "quantize, or compare with the bandwidth ceiling (tandem plan)."]
    return lines + [
        prefill + f" Decode also changed by {(dec_x - 1) * 100:+.0f}%: at "
        f"{long.prompt_tokens:.0f} tokens of context, reading the KV cache is a visible part "
        "of each decode step — long context costs twice (more prefill, then more bytes per "
        "token)."]


async def _run(target: Target, samples: list[tuple[int, SampleRequest]],
               warmups: list[SampleRequest], sampling: dict[str, Any], timeout: float | None
               ) -> list[tuple[int, RequestResult]]:
    func = REQUEST_FUNCS[target.backend]
    ignore_eos = target.backend != "ollama"
    out = []
    async with make_client(1, target.headers) as client:
        for i, s in enumerate(warmups):
            await send(func, client, RequestInput(target.url, target.model, s, f"phases-w{i}",
                                                  ignore_eos, sampling), timeout)
        for i, (n, s) in enumerate(samples):
            r = await send(func, client, RequestInput(target.url, target.model, s,
                                                      f"phases-{n}-{i}", ignore_eos, sampling),
                           timeout)
            print(f"  {n:>6} tokens #{i // len({m for m, _ in samples}) + 1}: "
                  + (f"TTFT {r.ttft * 1000:.0f} ms, {r.output_tokens} tokens in "
                     f"{r.latency:.2f} s" if r.success else f"failed: {r.error}"))
            out.append((n, r))
    return out


def run_phases(a: argparse.Namespace) -> int:
    lens = parse_lengths(a.input_lens)
    if a.output_len < 2:
        raise ValueError(f"--output-len must be at least 2 (decode needs two tokens), "
                         f"got {a.output_len}")
    if a.repetitions < 1 or a.num_warmups < 0:
        raise ValueError("--repetitions must be positive and --num-warmups >= 0")
    a.seed = resolve_seed(a.seed)
    headers = parse_headers(a.header, a.api_key)
    with httpx.Client(headers=headers, timeout=60.0) as sync:
        target = resolve_target(a.base_url, a.host, a.port, a.backend, a.endpoint, a.model,
                                headers, sync)
        if target.max_model_len and max(lens) + a.output_len > target.max_model_len:
            raise ValueError(f"{max(lens)} prompt + {a.output_len} output tokens exceed the "
                             f"server's context window of {target.max_model_len}")
        tokenizer = choose_tokenizer(sync, target.base_url, target.model, a.tokenizer,
                                     a.skip_tokenizer_init)
        builder = PromptBuilder(tokenizer, np.random.default_rng(a.seed), a.vocab_size)

        def sample(n: int, out: int) -> SampleRequest:
            prompt = builder.ids(n) if builder.token_ids else builder.text(n)
            return SampleRequest(prompt, n, out)

        # Interleaved (short, long, short, long, ...) so slow drift hits both alike.
        samples = [(n, sample(n, a.output_len)) for _ in range(a.repetitions) for n in lens]
        warmups = [sample(16, 4) for _ in range(a.num_warmups)]
    sampling = {"temperature": a.temperature}
    print(f"Phase experiment: {target.url} (model {target.model}), prompts of {lens} tokens, "
          f"{a.output_len} output tokens, {a.repetitions} repetitions, one at a time, "
          f"seed {a.seed}")
    results = asyncio.run(_run(target, samples, warmups, sampling, a.request_timeout))
    failed = [r for _, r in results if not r.success]
    ms = [measure(n, r) for n, r in results if r.success]
    if not ms:
        raise ValueError(f"every request failed, e.g. {failed[0].error}")
    rows = aggregate(ms)
    server_timed = all(m.server_timed for m in ms)
    source = ("prefill/decode tok/s: the server's own phase timings "
              + ("(Ollama's prompt_eval_*/eval_* counters)" if target.backend == "ollama"
                 else "(the response's tandem object)") if server_timed
              else "prefill tok/s = prompt tokens / TTFT, decode tok/s = 1 / TPOT, both timed "
                   "here (the server reports no phase split)")
    text = conclusion(rows)
    print()
    print(format_rows(rows))
    print(f"({source}; TTFT and ITL timed here; medians of {a.repetitions})")
    if failed:
        print(f"{len(failed)} requests failed, e.g. {failed[0].error}")
    short_outputs = [r for r in rows if r.output_tokens < a.output_len / 2]
    if short_outputs:
        print(f"note: replies stopped early ({short_outputs[0].output_tokens:.0f} of "
              f"{a.output_len} tokens): decode numbers rest on few tokens")
    print()
    print("\n".join(text))
    if a.save_result or a.result_filename or a.result_dir:
        date = datetime.now().strftime("%Y%m%d-%H%M%S")
        name = a.result_filename or f"phases-{target.model.split('/')[-1]}-{date}.json"
        path = Path(a.result_dir or ".") / name
        write_json(path, {
            "date": date, "base_url": target.base_url, "endpoint": target.endpoint,
            "backend": target.backend, "model_id": target.model, "output_len": a.output_len,
            "seed": a.seed,
            "repetitions": a.repetitions, "phase_source": source,
            "rows": [asdict(r) for r in rows], "requests": [asdict(m) for m in ms],
            "failed": [r.error for r in failed], "conclusion": text})
        print(f"saved {path}")
    return 0 if not failed else 1
