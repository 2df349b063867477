"""tandem plan --engine-check: the planner's KV arithmetic against the pool the engine allocates
(the default model as `tandem serve` holds it, the tiny model with an int8 cache), and a
mismatch that is reported."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch

from tandem.config import resolve_kv_cache_dtype
from tandem.entrypoints.cli import main
from tandem.model.kv_cache import Fp16KVCache, Fp32KVCache, Int8KVCache
from tandem.tools.plan import capacity as cap
from tandem.tools.plan.engine_check import check_engine, compare, format_check
from tandem.tools.plan.readers import load_model


@pytest.mark.parametrize("head_dim", [64, 128, 96])
def test_planner_int8_is_the_engines_int8_layout(head_dim):
    layers, kv_heads = 30, 3
    planned = cap.kv_bytes_per_token(layers, kv_heads, head_dim,
                                     cap.kv_element_bytes("int8", head_dim))
    engine = layers * Int8KVCache.bytes_per_token_layer(kv_heads, head_dim)
    assert planned == pytest.approx(engine, abs=1e-6)
    fp32 = layers * Fp32KVCache.bytes_per_token_layer(kv_heads, head_dim)
    assert cap.kv_bytes_per_token(layers, kv_heads, head_dim,
                                  cap.kv_element_bytes("fp32", head_dim)) == fp32
    fp16 = layers * Fp16KVCache.bytes_per_token_layer(kv_heads, head_dim)
    assert cap.kv_bytes_per_token(layers, kv_heads, head_dim,
                                  cap.kv_element_bytes("fp16", head_dim)) == fp16 == fp32 / 2


def test_default_model_planned_equals_allocated(capsys):
    code = main(["plan", "--engine-check", "--kv-cache-memory", "64MiB", "--context", "1024",
                 "--json"])
    chk = json.loads(capsys.readouterr().out)["engine_check"]
    assert code == 0 and chk["ok"]
    # SmolLM2-135M's cache in 16 bits (CPU's auto): 2 x 30 layers x 3 KV heads x 64 x 2 B
    # = 23,040 B per token.
    assert chk["kv_cache_dtype"] == resolve_kv_cache_dtype("auto", "cpu", "fp32")
    assert chk["planned_kv_bytes_per_token"] == chk["engine_kv_bytes_per_token"] == 23_040
    assert chk["budget_bytes"] == 64 * 2**20 and chk["max_model_len"] == 1024
    assert chk["engine_cache_tokens"] == 64 * 2**20 // (23_040 * 16) * 16
    assert abs(chk["cache_deviation"]) <= 0.05
    # Its weights as `tandem serve` holds them (the file's Q4_1 as int4), not dequantized:
    # a decode step reads what the file stores; the fp16 embedding for the row lookup,
    # beside the tied LM head, is named as the difference in what is held.
    assert chk["weight_dtype"] == "file"
    assert chk["engine_read_bytes"] == pytest.approx(chk["planned_read_bytes"], rel=0.01)
    assert chk["engine_weight_bytes"] > chk["planned_weight_bytes"]
    assert any(n.startswith("weights:") and "embedding in fp16" in n for n in chk["notes"])


def test_kv_cache_memory_reads_as_serve_reads_it(tiny_config_path, capsys):
    """The engine's flag, one parser: a bare number is bytes (as serve reads it), not GB."""
    code = main(["plan", tiny_config_path, "--engine-check", "--kv-cache-memory",
                 str(2**20), "--json"])
    assert code == 0
    assert json.loads(capsys.readouterr().out)["engine_check"]["budget_bytes"] == 2**20
    assert main(["plan", tiny_config_path, "--engine-check", "--kv-cache-memory", "abc"]) == 2
    assert "--kv-cache-memory: cannot parse memory size 'abc'" in capsys.readouterr().err


def test_fp16_cache_planned_equals_allocated(tiny_config_path, capsys):
    code = main(["plan", tiny_config_path, "--engine-check", "--kv-cache-dtype", "fp16",
                 "--kv-cache-memory", "1MiB", "--json"])
    chk = json.loads(capsys.readouterr().out)["engine_check"]
    # 2 layers x 2 KV heads x 8 x 2 B x 2 (K and V) = 128 B per token.
    assert code == 0 and chk["ok"] and chk["kv_cache_dtype"] == "fp16"
    assert chk["planned_kv_bytes_per_token"] == chk["engine_kv_bytes_per_token"] == 128
    # Float weights stay float (fp32 on CPU), byte for byte what the plan counts.
    assert chk["weight_dtype"] == "fp32"
    assert chk["engine_weight_bytes"] == chk["planned_weight_bytes"]
    assert not any(n.startswith("weights:") for n in chk["notes"])


def test_int8_cache_on_the_tiny_model_with_the_plan(tiny_config_path, capsys):
    code = main(["plan", tiny_config_path, "--engine-check", "--kv-cache-dtype", "int8",
                 "--kv-cache-memory", "1MiB", "--device", "cpu-ddr5", "--streams", "2"])
    raw = capsys.readouterr().out
    out = " ".join(raw.split())  # the report wraps long lines
    assert code == 0
    # 2 layers x 2 KV heads x (8 + 4) B x 2 (K and V) = 96 B per token.
    assert "planned 2 x 2 layers x 2 KV heads x 8 x 1.5 B (int8) = 96 B; engine 96 B" in out
    assert "(identical)" in out and "OK: the plan's cache arithmetic matches" in out
    tokens = 2**20 // (96 * 16) * 16
    assert f"planned {tokens:,}, engine allocated {tokens:,}: +0.00%, within 5%" in out
    # The plan came first, in the engine's dtypes (fp32 weights, int8 cache).
    assert raw.startswith("tandem plan: config on cpu-ddr5")
    assert "fp32 weights, int8 KV cache" in out


def test_a_mismatch_is_reported_and_fails(tiny_config_path):
    chk = check_engine(tiny_config_path, kv_cache_memory=2**20)
    assert chk.ok
    engine = SimpleNamespace(
        config=SimpleNamespace(quantization="none", kv_cache_dtype="auto", block_size=16),
        dtype=torch.float32, device=torch.device("cpu"), kv_cache_dtype="fp16",
        kv_pool_tokens=chk.engine_cache_tokens * 9 // 10, kv_groups=SimpleNamespace(hybrid=False),
        kv_bytes_per_token=chk.engine_kv_bytes_per_token + 8, max_model_len=256,
        model=SimpleNamespace(nbytes=chk.engine_weight_bytes, weight_bytes=chk.engine_read_bytes,
                              embed=torch.zeros(1)),
    )
    bad = compare(engine, load_model(tiny_config_path), 2**20, 0.92)
    assert not bad.ok and not bad.same_kv_bytes and bad.cache_deviation > 0.05
    text = format_check(bad)
    assert "(DIFFER)" in text and "OUTSIDE 5%" in text and "MISMATCH" in text
    assert dataclasses.asdict(bad)["engine_cache_tokens"] < chk.engine_cache_tokens


def test_engine_check_refuses_what_it_cannot_start(capsys):
    assert main(["plan", "llama-3.1-8b", "--engine-check"]) == 2
    assert "is a preset" in capsys.readouterr().err
    assert main(["plan", "--engine-check", "--kv-cache-dtype", "fp8"]) == 2
    assert "--kv-cache-dtype auto, fp32, fp16, bf16, int8, not 'fp8'" in capsys.readouterr().err
    assert main(["plan", "llama-3.1-8b", "--device", "h100-sxm", "--kv-cache-memory", "1GiB"]) == 2
    assert "--kv-cache-memory goes with --engine-check" in capsys.readouterr().err
