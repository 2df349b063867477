"""The one-call C++ decode step against the per-op forward on the same batches."""

from __future__ import annotations

import pytest
import torch

from tandem.config import EngineConfig
from tandem.core.scheduler import SchedulerOutput
from tandem.engine.llm_engine import LLMEngine
from tandem.sampling_params import SamplingParams
from tandem.worker.decode_step import DecodeStep

from .test_architectures import hf_model


class CheckedStep:
    """Runs LlamaModel.forward, then the decode step, on every decode batch and
    compares their logits (the step rewrites the same K/V slots)."""

    def __init__(self, engine: LLMEngine, tol: float = 1e-4) -> None:
        self.runner, self.step = engine.runner, engine.runner.decode_step
        self.tol = tol
        self.max_batch = self.step.max_batch
        self.batches: list[int] = []
        self.reqs: list = []
        inputs = self.runner._decode_step_inputs

        def recorded(reqs):
            self.reqs = reqs
            return inputs(reqs)

        self.runner._decode_step_inputs = recorded

    def __call__(self, tokens, block_table):
        reqs = self.reqs
        out = SchedulerOutput(list(reqs), [1] * len(reqs))
        input_ids, positions, metas, *_ = self.runner.prepare(out)
        rows = torch.arange(len(reqs))
        want = self.runner.model.forward(input_ids, positions, self.runner.kv_caches, metas, rows)
        got, argmax = self.step(tokens, block_table)
        torch.testing.assert_close(got, want, atol=self.tol, rtol=self.tol)
        assert argmax.tolist() == got.argmax(-1).tolist()
        self.batches.append(len(reqs))
        return got, argmax


@pytest.mark.parametrize(("quantization", "kv_cache_dtype"),
                         [("none", "fp32"), ("none", "auto"), ("none", "bf16"), ("none", "int8"),
                          ("int8", "auto"), ("int4", "int8")])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_decode_step_matches_forward(arch, quantization, kv_cache_dtype, tmp_path):
    hf_model(arch, max_position_embeddings=1024).save_pretrained(tmp_path)
    engine = LLMEngine(EngineConfig(model=str(tmp_path), skip_tokenizer_init=True,
                                    kv_cache_memory="8MiB", kv_cache_dtype=kv_cache_dtype,
                                    quantization=quantization, max_num_batched_tokens=1024))
    # A bf16 cache rounds queries to bf16: a last-bit difference between the two
    # paths' fp32 queries (Qwen's bias, norms) can move one by 2^-8 of itself.
    checked = CheckedStep(engine, tol=5e-3 if engine.kv_cache_dtype == "bf16" else 1e-4)
    assert checked.step is not None
    engine.runner.decode_step = checked
    # Seven sequences finishing one step apart: decode batches of 7 down to 1
    # (whole-sequence and per-head attention items); one context long enough
    # for the attention to split it across threads.
    lens = [3, 17, 40, 64, 5, 90, 600]
    for i, n in enumerate(lens):
        prompt = [(7 * i + j) % 90 + 3 for j in range(n)]
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=i + 2,
                                                   ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert set(checked.batches) == set(range(1, min(7, checked.max_batch) + 1))


def test_decode_step_rejects_out_of_range_inputs(tmp_path):
    hf_model("llama").save_pretrained(tmp_path)
    engine = LLMEngine(EngineConfig(model=str(tmp_path), skip_tokenizer_init=True,
                                    kv_cache_memory="8MiB"))
    step = engine.runner.decode_step._step
    table = torch.zeros(1, 1, 1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="out of range"):  # token id
        step.forward(torch.tensor([[10**6, 0, 0]]), table)
    with pytest.raises(RuntimeError, match="out of range"):  # position past the block table
        step.forward(torch.tensor([[5, 99, 0]]), table)
    with pytest.raises(RuntimeError, match="out of range"):  # block id
        step.forward(torch.tensor([[5, 0, 0]]), torch.tensor([[[10**6]]], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="int64"):
        step.forward(torch.tensor([[5, 0, 0]], dtype=torch.int32), table)


def test_unsupported_shapes_and_refusals_fall_back_to_the_per_op_path(tmp_path, monkeypatch,
                                                                      caplog):
    # int8 tiles are 16 outputs: an intermediate size of 120 cannot be split by them.
    hf_model("llama", intermediate_size=120).save_pretrained(tmp_path)
    cfg = EngineConfig(model=str(tmp_path), skip_tokenizer_init=True, kv_cache_memory="8MiB",
                       quantization="int8")
    assert LLMEngine(cfg).runner.decode_step is None
    assert "multiples of 16" in caplog.text
    # Whatever else the C++ side refuses: one warning, then the per-op path.
    def refuse(*args, **kwargs):
        raise RuntimeError("DecodeStep: refused\ndetails")

    monkeypatch.setattr(DecodeStep, "__init__", refuse)
    engine = LLMEngine(EngineConfig(model=str(tmp_path), skip_tokenizer_init=True,
                                    kv_cache_memory="8MiB"))
    assert engine.runner.decode_step is None
    assert "decode step is off: DecodeStep: refused" in caplog.text
    req = engine.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=4,
                                                       ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert len(req.output_token_ids) == 4


def test_the_cpp_step_refuses_what_it_does_not_implement(tmp_path):
    """Each part is checked as it is added: a RoPE narrower than the head (partial
    rotary), a cache of other KV heads, a Q norm without a K norm, an unknown
    weight kind, a step before the layers."""
    hf_model("qwen3").save_pretrained(tmp_path)
    engine = LLMEngine(EngineConfig(model=str(tmp_path), skip_tokenizer_init=True,
                                    kv_cache_memory="8MiB"))
    model, cfg = engine.model, engine.model.cfg
    layer, (cache, scale) = model.layers[0], engine.kv_caches[0].kernel_args
    args = [lin.step_args for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    kinds, tensors = [int(k) for k, _ in args], [t for _, ts in args for t in ts]

    def new(cos=model.cos, sin=model.sin):
        return torch.classes.tandem.DecodeStep(model.embed, model.norm, cos, sin, model.h,
                                               cfg.head_dim, cfg.intermediate_size, 16,
                                               model.eps)

    with pytest.raises(RuntimeError, match="cos"):
        new(model.cos[:, : cfg.head_dim // 2].contiguous(), model.sin)
    step = new()
    with pytest.raises(RuntimeError, match="before the first step"):
        step.forward(torch.tensor([[5, 0, 0]]), torch.zeros(1, 1, 1, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="local RoPE needs set_variant"):
        step.add_layer(layer.input_norm, layer.post_norm, kinds, tensors, None, layer.q_norm,
                       layer.k_norm, cache, scale, 0, None, None, True, 0)
    with pytest.raises(RuntimeError, match="output norms go together"):
        step.add_layer(layer.input_norm, layer.post_norm, kinds, tensors, None, layer.q_norm,
                       layer.k_norm, cache, scale, 0, layer.input_norm, None, False, 0)
    step.add_layer(layer.input_norm, layer.post_norm, kinds, tensors, None, layer.q_norm,
                   layer.k_norm, cache, scale, 0, None, None, False, 0)  # the model's: accepted
    with pytest.raises(RuntimeError, match="set_variant before add_layer"):
        step.set_variant(1, 2.0, 0.25, model.cos, model.sin, 0.0)
    step.add_layer(layer.input_norm, layer.post_norm, kinds, tensors, None, layer.q_norm,
                   layer.k_norm, cache, scale, 8, None, None, False, 0)  # a window of 8 keys
    with pytest.raises(RuntimeError, match="KV cache group is 0-63"):
        step.add_layer(layer.input_norm, layer.post_norm, kinds, tensors, None, layer.q_norm,
                       layer.k_norm, cache, scale, 0, None, None, False, -1)
    with pytest.raises(RuntimeError, match="share one window"):
        step.add_layer(layer.input_norm, layer.post_norm, kinds, tensors, None, layer.q_norm,
                       layer.k_norm, cache, scale, 9, None, None, False, 0)
    with pytest.raises(RuntimeError, match="kv heads"):
        step.add_layer(layer.input_norm, layer.post_norm, kinds, tensors, None, layer.q_norm,
                       layer.k_norm, cache[:, :, :1].contiguous(), scale, 0, None, None, False, 0)
    with pytest.raises(RuntimeError, match="Q and K norms"):
        step.add_layer(layer.input_norm, layer.post_norm, kinds, tensors, None, layer.q_norm,
                       None, cache, scale, 0, None, None, False, 0)
    with pytest.raises(RuntimeError, match="unknown weight kind"):
        step.add_layer(layer.input_norm, layer.post_norm, [7, *kinds[1:]], tensors, None,
                       layer.q_norm, layer.k_norm, cache, scale, 0, None, None, False, 0)


def test_a_saturated_final_soft_cap_ties_as_in_hf():
    """Gemma 2's output cap: past ~9x the cap fp32's tanh saturates and the capped
    logits tie; the greedy token is then the first of them (HF's argmax), not the
    raw logits' argmax the C++ step takes."""
    class Raw:
        def forward(self, tokens, tables):
            return torch.tensor([[0.5, 20.0, 12.0, -3.0]]), torch.tensor([1])

    step = DecodeStep.__new__(DecodeStep)
    step._step, step.final_softcap = Raw(), 0.05
    logits, argmax = step(torch.zeros(1, 3, dtype=torch.long), torch.zeros(1, 1, 1))
    assert torch.equal(logits[0, :3], torch.full((3,), 0.05)) and argmax.tolist() == [0]
    step.final_softcap = None  # no cap: the step's own argmax
    assert step(torch.zeros(1, 3, dtype=torch.long), torch.zeros(1, 1, 1))[1].tolist() == [1]
