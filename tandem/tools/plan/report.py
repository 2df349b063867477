"""The plan as a readable plain-text report: every number next to its formula."""

from __future__ import annotations

import shlex
import textwrap

from tandem.tools.plan.capacity import Plan
from tandem.tools.plan.devices import GB
from tandem.tools.plan.text import gb

WIDTH = 100
LABEL = 20


def _line(label: str, text: str) -> str:
    body = textwrap.wrap(text, WIDTH - LABEL - 2, break_long_words=False,
                         break_on_hyphens=False) or [""]
    first = f"  {label:<{LABEL}}{body[0]}"
    rest = [" " * (LABEL + 2) + b for b in body[1:]]
    return "\n".join([first, *rest])


def _command(label: str, words: list[str]) -> str:
    """A command line wrapped between its (shell-quoted) words with shell
    continuations, so it still runs when pasted: a quoted path is never split."""
    lines = [""]
    for word in words:
        if lines[-1] and len(lines[-1]) + 1 + len(word) > WIDTH - LABEL - 4:
            lines.append("")
        lines[-1] += (" " if lines[-1] else "") + word
    lines = [f"{x} \\" for x in lines[:-1]] + lines[-1:]
    return "\n".join([f"  {label:<{LABEL}}{lines[0]}", *(" " * (LABEL + 2) + x for x in lines[1:])])


def _bullets(mark: str, items: list[str]) -> list[str]:
    return [
        textwrap.fill(
            x, WIDTH, initial_indent=f"  {mark} ", subsequent_indent="    ",
            break_on_hyphens=False,
        )
        for x in items
    ]


def _model_ref(p: Plan) -> tuple[str, str, str]:
    """What to write for the model in tandem's, vLLM's and llama-server's
    command lines: a GGUF's path where the plan read one; a preset's Hub id for
    vLLM (tandem and llama-server read a local file: placeholders)."""
    src = p.model.source
    named = src[src.find("(") + 1 : -1]
    if src.startswith("gguf ("):
        return named, named, named
    return "MODEL", named if src.startswith("preset (") else "MODEL", "MODEL.gguf"


def format_report(p: Plan) -> str:
    s, d, f = p.model, p.device, p.formulas
    pc = s.param_counts()
    out: list[str] = []
    out.append(f"tandem plan: {s.name} on {d.id}")
    tied = "tied embeddings" if s.tie_word_embeddings else "untied embeddings"
    ctx = f", trained context {s.max_context:,}" if s.max_context else ""
    out.append(
        _line(
            "model",
            f"{s.source}: {s.num_layers} layers, hidden {s.hidden_size:,}, MLP "
            f"{s.intermediate_size:,}, {s.num_heads} heads / {s.num_kv_heads} KV heads x "
            f"{s.head_dim}, vocab {s.vocab_size:,}, {tied}{ctx}",
        )
    )
    out.append(
        _line(
            "parameters",
            f"{pc.total / 1e9:,.3f} B = embedding {pc.embedding / 1e9:.3f} B + attention "
            f"{pc.attention / 1e9:.3f} B + MLP {pc.mlp / 1e9:.3f} B + norms "
            f"{pc.norms / 1e6:.2f} M + LM head {pc.lm_head / 1e9:.3f} B"
            + (" (tied: the embedding)" if s.tie_word_embeddings else ""),
        )
    )
    peak = f", {d.peak_flops / 1e12:,.2f} TFLOP/s peak" if d.peak_flops else ""
    out.append(
        _line(
            "device",
            f"{d.name}, {d.kind}: {gb(d.memory_bytes)} memory, "
            f"{d.bandwidth_bytes_s / GB:,.1f} GB/s{peak}" + (f"; {d.note}" if d.note else ""),
        )
    )
    if p.streams is not None:
        wl = f"{p.streams} streams with no idle time (agents, batch jobs)"
    elif p.users is not None:
        wl = (
            f"{p.users:g} chat users, {p.gen_seconds:g} s generating per {p.turn_seconds:g} s "
            "turn"
        )
    else:
        wl = "one stream (no --users or --streams given)"
    out.append(
        _line(
            "workload",
            f"{wl}; {p.context:,}-token context; {p.dtype} weights, {p.kv_cache_dtype} KV cache",
        )
    )

    out += ["", "Memory"]
    out.append(_line("weights", f["weights"]))
    if "weights_read" in f:
        out.append(_line("read per step", f["weights_read"]))
    out.append(_line("KV per token", f["kv_per_token"]))
    out.append(_line("per conversation", f["kv_per_conversation"]))
    out.append(_line("left for the cache", f["cache_bytes"]))
    out.append(_line("cache tokens", f["cache_tokens"]))
    out.append(_line("conversations fit", f["conversations_fit"]))

    out += ["", "Speed"]
    out.append(_line("decode ceiling", f["decode_ceiling"] + " (one stream, weights only)"))
    out.append(_line("with the KV read", f["decode_ceiling_with_kv"]))
    out.append(_line(f"batch of {max(1, p.max_num_seqs)}", f["aggregate_decode"]))
    if "prefill" in f:
        out.append(_line("prefill", f["prefill"]))

    out += ["", "Concurrency"]
    out.append(_line("in flight", f["in_flight"]))
    out.append(_line("--max-num-seqs", f["max_num_seqs"]))
    if p.flags:
        out.append(_line("--max-queue", f"{p.max_queue}: {p.flags['max_queue_reason']}"))
        out.append(
            _line(
                "token budget",
                f"--max-num-batched-tokens {p.max_num_batched_tokens}: "
                f"{p.flags['max_num_batched_tokens_reason']}",
            )
        )
        tmodel, hf, gguf = _model_ref(p)
        out += ["", "Settings"]
        cmds = {
            "tandem": ["tandem", "serve", "--model", shlex.quote(tmodel)],
            "vLLM": ["vllm", "serve", shlex.quote(hf)],
            "llama-server": ["llama-server", "-m", shlex.quote(gguf)],
        }
        keys = {"tandem": "tandem", "vLLM": "vllm", "llama-server": "llama_server"}
        for label, cmd in cmds.items():
            flags = [w for flag in p.flags[keys[label]] for w in flag.split(" ")]
            out.append(_command(label, cmd + flags))
        env = " ".join(f"{k}={v}" for k, v in p.flags["ollama"].items())
        out.append(
            _line(
                "Ollama",
                f"{env} ollama serve (reserves {p.max_num_seqs} x {p.context:,} = "
                f"{p.flags['ollama_reserved_tokens']:,} tokens = "
                f"{gb(p.flags['ollama_reserved_bytes'])} of KV cache at load)",
            )
        )
    else:
        out.append(_line("settings", "none: nothing fits as asked, see the warnings"))

    if p.warnings:
        out += ["", "Warnings"]
        out += _bullets("!", p.warnings)
    if p.notes:
        out += ["", "Notes"]
        out += _bullets("-", p.notes)
    return "\n".join(out)
