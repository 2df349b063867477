"""``tandem plan --engine-check``: the planner's arithmetic against the pool tandem allocates.

The planner predicts KV bytes per token and cache tokens from a model's shape;
the engine derives its own from the tensors it allocates. Starting tandem's
engine on the same model, with the same memory budget, and putting the two
side by side catches any drift between the paper calculation and the real
allocation (a scale the formula forgot, a block rounding, a dtype that
differs) — so a user can trust the plan for models tandem never ran here.

Same budget for both: on CPU the engine's pool is exactly ``--kv-cache-memory``
bytes (tandem's default 2 GiB), and the planned cache tokens are the planner's
block arithmetic on that budget. On CUDA the engine sizes the pool from
``--gpu-memory-utilization`` after its own warm-up peak, and the planner's
full plan for that GPU (its memory total, the same fraction, its activation
estimate) is compared with it.
"""

from __future__ import annotations

import os
import textwrap
from dataclasses import asdict, dataclass, field
from typing import Any

from tandem.config import KV_CACHE_DTYPES
from tandem.tools.plan import arithmetic as ar
from tandem.tools.plan.capacity import plan
from tandem.tools.plan.devices import Device, GiB, MiB
from tandem.tools.plan.model_spec import ModelSpec
from tandem.tools.plan.presets import PRESETS
from tandem.tools.plan.readers import load_model

TOLERANCE = 0.05  # planned vs allocated cache tokens may differ by this fraction


@dataclass
class EngineCheck:
    """Planned vs allocated, for the same model, dtype, block size and memory budget."""

    model: str
    engine_device: str
    weight_dtype: str  # the planner's name for what the engine holds (fp32, bf16, int8, ...)
    kv_cache_dtype: str  # the planner's name for the engine's cache (fp32, bf16, fp16, int8)
    block_size: int
    budget_bytes: int | None  # the KV budget both sides use (None on CUDA: see budget_source)
    budget_source: str
    max_model_len: int
    planned_kv_bytes_per_token: float
    engine_kv_bytes_per_token: int
    planned_cache_tokens: int
    engine_cache_tokens: int
    planned_weight_bytes: int
    engine_weight_bytes: int
    planned_read_bytes: int
    engine_read_bytes: int
    kv_formula: str
    tolerance: float = TOLERANCE
    notes: list[str] = field(default_factory=list)

    @property
    def cache_deviation(self) -> float:
        """(planned - allocated) / allocated cache tokens."""
        return (self.planned_cache_tokens - self.engine_cache_tokens) / max(
            1, self.engine_cache_tokens
        )

    @property
    def same_kv_bytes(self) -> bool:
        """Exact to the byte (the planned figure is a float product: allow rounding)."""
        return abs(self.planned_kv_bytes_per_token - self.engine_kv_bytes_per_token) < 0.5

    @property
    def ok(self) -> bool:
        return self.same_kv_bytes and abs(self.cache_deviation) <= self.tolerance

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["cache_deviation"] = self.cache_deviation
        d["same_kv_bytes"] = self.same_kv_bytes
        d["ok"] = self.ok
        return d


def resolve_engine_model(ref: str | None) -> tuple[str | None, str, str]:
    """(EngineConfig.model, load_format, planner ref) for what the engine can start.

    A preset has no weights, so the engine cannot run it; a bare config.json
    runs with random weights (``--load-format dummy``), which allocates the
    same pool as the real weights would.
    """
    if ref is None or ref == "default":
        from tandem.paths import default_model_path

        path = str(default_model_path())
        return None, "auto", path
    if ref in PRESETS and not os.path.exists(ref):
        raise ValueError(
            f"--engine-check starts tandem's engine, which needs weights: {ref!r} is a preset "
            "(shape only). Give a GGUF file, an HF model directory, a config.json (random "
            "weights), or no model for tandem's default"
        )
    if os.path.isfile(ref) and ref.endswith(".json"):
        return ref, "dummy", ref
    if not os.path.exists(ref):
        raise ValueError(f"{ref}: no such file or directory")
    return ref, "auto", ref


def engine_settings(dtype: str, kv_cache_dtype: str) -> tuple[str, str, str]:
    """The planner's --dtype/--kv-cache-dtype as the engine's (dtype, quantization, kv dtype)."""
    if dtype == "file":
        raise ValueError(
            "--engine-check starts the engine with the weights as --dtype says (auto: as "
            "`tandem serve` holds them, a GGUF in its own formats), and tandem re-blocks a "
            "GGUF's K-quants, so --dtype file does not describe what it would hold; use auto, "
            "fp32, bf16, fp16, int8 or int4"
        )
    if dtype == "auto":  # what `tandem serve` loads: --quantization auto
        engine_dtype, quant = "auto", "auto"
    elif dtype in ("int8", "int4"):
        engine_dtype, quant = "auto", dtype
    elif dtype in ar.ENGINE_DTYPES:
        engine_dtype, quant = ar.ENGINE_DTYPES[dtype], "none"
    else:
        raise ValueError(f"--dtype {dtype!r}: choose from {', '.join(ar.WEIGHT_DTYPES)}")
    kv = kv_cache_dtype.lower()
    if kv in ("int8", "8bit"):
        engine_kv = "int8"
    elif kv in KV_CACHE_DTYPES:
        engine_kv = kv
    else:
        raise ValueError(
            f"--engine-check: tandem's cache is --kv-cache-dtype {', '.join(KV_CACHE_DTYPES)}, "
            f"not {kv_cache_dtype!r}"
        )
    return engine_dtype, quant, engine_kv


def check_engine(
    ref: str | None,
    *,
    dtype: str = "auto",
    kv_cache_dtype: str = "auto",
    kv_cache_memory: int | None = None,
    context: int | None = None,
    gpu_memory_utilization: float = ar.DEFAULT_GPU_UTILIZATION,
    block_size: int = ar.BLOCK_SIZE,
    device: str = "auto",
) -> EngineCheck:
    """Start tandem's engine on ``ref`` and compare its pool with the plan's numbers."""
    from tandem.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine

    model, load_format, planner_ref = resolve_engine_model(ref)
    engine_dtype, quant, engine_kv = engine_settings(dtype, kv_cache_dtype)
    spec = load_model(planner_ref)
    engine = LLMEngine(EngineConfig(
        model=model, load_format=load_format, dtype=engine_dtype, device=device,
        quantization=quant, kv_cache_dtype=engine_kv, block_size=block_size,
        kv_cache_memory=kv_cache_memory, max_model_len=context,
        gpu_memory_utilization=gpu_memory_utilization, skip_tokenizer_init=True,
    ))
    return compare(engine, spec, kv_cache_memory, gpu_memory_utilization)


def compare(
    engine: Any, spec: ModelSpec, kv_cache_memory: int | None, util: float
) -> EngineCheck:
    """Planned vs allocated for a started ``LLMEngine`` and the planner's view of its model."""
    import torch

    from tandem.engine.kv_sizing import DEFAULT_CPU_KV_BYTES

    c = engine.config
    quant = c.quantization
    gguf = quant == "auto" and spec.file_weight_bytes is not None  # held in its own formats
    if gguf:
        wdtype = "file"
    elif quant in ("int8", "int4"):
        wdtype = quant
    else:  # float weights, held in the engine's compute dtype
        wdtype = ar.PLANNER_DTYPES[str(engine.dtype).split(".")[-1]]
    kvname = engine.kv_cache_dtype  # what the engine really holds ("auto" resolved)
    elem = ar.kv_element_bytes(kvname, spec.head_dim)
    kv_tok = ar.kv_bytes_per_token(spec.num_layers, spec.num_kv_heads, spec.head_dim, elem)
    w = ar.weight_bytes(spec, wdtype)
    engine_tokens = engine.kv_pool_tokens
    notes: list[str] = []
    groups = ar.kv_groups(spec, engine.max_model_len,
                          not getattr(c, "disable_hybrid_kv_cache_manager", False))
    if groups.hybrid:
        notes.append(
            f"{len(groups.windows)} KV cache groups of {groups.group_size} layers (the "
            f"engine's: {len(engine.kv_groups.windows)} of {engine.kv_groups.group_size}): "
            "a block is one group's layers, and the windowed groups hold a request's last "
            f"{max(groups.windows):,} keys only; the cache tokens count every layer")
    if engine.device.type == "cuda" and kv_cache_memory is None:
        total = torch.cuda.mem_get_info()[1]
        gpu = Device("cuda", torch.cuda.get_device_name(), "gpu", int(total), 1e12)
        p = plan(
            spec, gpu, dtype=wdtype, kv_cache_dtype=kvname, context=engine.max_model_len,
            gpu_memory_utilization=util, reserve_bytes=0, block_size=c.block_size,
            explore=False,
        )
        planned_tokens, budget = p.cache_tokens, None
        source = (
            f"--gpu-memory-utilization {util:g} of {total / GiB:.2f} GiB: the engine subtracts "
            "its measured warm-up peak and memory outside torch, the plan its estimate of "
            "weights and activations"
        )
    else:
        budget = int(kv_cache_memory if kv_cache_memory is not None else DEFAULT_CPU_KV_BYTES)
        planned_tokens = ar.cache_blocks(budget, kv_tok, c.block_size, groups, spec.num_layers)[1]
        source = (
            "--kv-cache-memory" if kv_cache_memory is not None else "tandem's CPU default"
        ) + " (the engine's pool is exactly this many bytes)"
    if engine.model.nbytes != w.total:
        extra = engine.model.nbytes - w.total
        why = []
        if gguf:
            why.append("the plan counts the tensors as stored; tandem keeps the token "
                       "embedding in fp16 for the row lookup (beside a quantized LM head when "
                       "the two are tied), re-blocks K-quants (Q4_K as int4 with an fp16 scale "
                       "and minimum per group of 32, Q5_K and Q6_K as int8 groups of 32) and "
                       "widens float tensors to fp32")
        elif quant != "none" and spec.tie_word_embeddings:
            why.append("tandem keeps the tied embedding in float for the row lookup beside "
                       "its int8 LM head, the plan counts it once, quantized")
        if quant == "int4":
            why.append("tandem's LM head is int8 (the plan's: int4) and int4 scales/zeros "
                       "are fp32")
        notes.append(
            f"weights: the engine holds {extra / MiB:+,.1f} MiB vs the plan"
            + (": " + "; ".join(why) if why else "")
        )
    return EngineCheck(
        model=spec.name, engine_device=engine.device.type, weight_dtype=wdtype,
        kv_cache_dtype=kvname, block_size=c.block_size, budget_bytes=budget,
        budget_source=source, max_model_len=engine.max_model_len,
        planned_kv_bytes_per_token=kv_tok, engine_kv_bytes_per_token=engine.kv_bytes_per_token,
        planned_cache_tokens=planned_tokens, engine_cache_tokens=engine_tokens,
        planned_weight_bytes=w.total, engine_weight_bytes=engine.model.nbytes,
        planned_read_bytes=w.read_per_token, engine_read_bytes=engine.model.weight_bytes,
        kv_formula=(
            f"2 x {spec.num_layers} layers x {spec.num_kv_heads} KV heads x {spec.head_dim} x "
            f"{elem:g} B ({kvname})"
        ),
        notes=notes,
    )


def format_check(chk: EngineCheck) -> str:
    """The comparison as the plan report's last section."""

    def line(label: str, text: str) -> str:
        return textwrap.fill(text, 100, initial_indent=f"  {label:<20}",
                             subsequent_indent=" " * 22, break_on_hyphens=False)

    same_kv = chk.same_kv_bytes
    budget = (
        f"{chk.budget_bytes / GiB:,.3f} GiB from {chk.budget_source}"
        if chk.budget_bytes is not None else chk.budget_source
    )
    verdict = "within" if abs(chk.cache_deviation) <= chk.tolerance else "OUTSIDE"
    out = [
        textwrap.fill(
            f"Engine check: tandem's engine started on {chk.model} ({chk.engine_device}, "
            + ("weights in the file's own formats" if chk.weight_dtype == "file"
               else f"{chk.weight_dtype} weights")
            + f", {chk.kv_cache_dtype} KV cache, blocks of "
            f"{chk.block_size}, max_model_len {chk.max_model_len:,})", 100,
            subsequent_indent="  ", break_on_hyphens=False),
        line(
            "KV per token",
            f"planned {chk.kv_formula} = {chk.planned_kv_bytes_per_token:,.0f} B; engine "
            f"{chk.engine_kv_bytes_per_token:,} B" + (" (identical)" if same_kv else " (DIFFER)"),
        ),
        line("KV budget", budget),
        line(
            "cache tokens",
            f"planned {chk.planned_cache_tokens:,}, engine allocated "
            f"{chk.engine_cache_tokens:,}: {chk.cache_deviation * 100:+.2f}%, {verdict} "
            f"{chk.tolerance * 100:g}%",
        ),
        line(
            "weights held",
            f"planned {chk.planned_weight_bytes / MiB:,.1f} MiB, engine "
            f"{chk.engine_weight_bytes / MiB:,.1f} MiB",
        ),
        line(
            "read per token",
            f"planned {chk.planned_read_bytes / MiB:,.1f} MiB, engine "
            f"{chk.engine_read_bytes / MiB:,.1f} MiB (what the decode ceiling divides by)",
        ),
    ]
    out += [textwrap.fill(n, 100, initial_indent="  - ", subsequent_indent="    ",
                          break_on_hyphens=False) for n in chk.notes]
    out.append("  OK: the plan's cache arithmetic matches the engine" if chk.ok else
               "  MISMATCH: the plan's cache arithmetic does not match the engine")
    return "\n".join(out)
