"""Bad input: a clear ValueError in the library, a one-line error (exit 2) from the CLI."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tandem import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm():
    return LLM(kv_cache_memory="64MiB", max_model_len=256)


def test_empty_prompt(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate("")
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]])


def test_prompt_longer_than_context_is_an_error_not_truncated(llm):
    long = "word " * 400
    with pytest.raises(ValueError, match="maximum context length is 256"):
        llm.generate(long, SamplingParams(max_tokens=4))


def test_vllm_prompt_dicts_and_numpy_ids(llm):
    """{"prompt": ...} and {"prompt_token_ids": ...} (vLLM's TextPrompt and
    TokensPrompt) were iterated as sequences: the key names became the prompts."""
    import numpy as np

    tok = llm.get_tokenizer()
    ids = tok.encode("The capital of France is")
    greedy = SamplingParams(temperature=0, max_tokens=4)
    want = llm.generate(ids, greedy)[0]
    outs = llm.generate([{"prompt_token_ids": ids}, {"prompt": "The capital of France is"},
                         [np.int64(t) for t in ids]], greedy)
    assert all(o.prompt_token_ids == want.prompt_token_ids for o in outs)
    assert all(o.outputs[0].token_ids == want.outputs[0].token_ids for o in outs)
    assert llm.generate({"prompt_token_ids": ids}, greedy)[0].prompt_token_ids == ids


@pytest.mark.parametrize("prompts,needle", [
    ({"prompt": "hi", "multi_modal_data": {"image": 1}}, "multi_modal_data"),
    ({"text": "hi"}, "prompt_token_ids"),
    (b"Hello", "bytes"),
    (5, "int"),
    ([b"Hello"], "bytes"),
])
def test_prompts_of_other_shapes_are_value_errors(llm, prompts, needle):
    with pytest.raises(ValueError, match=needle):
        llm.generate(prompts, SamplingParams(max_tokens=2))
    assert not llm.engine.requests


def test_params_of_other_types_and_ranges_are_value_errors(llm):
    with pytest.raises(ValueError, match="SamplingParams"):
        llm.generate("Hi", {"max_tokens": 3})
    for kwargs, field in (({"seed": 2**70}, "seed"), ({"logprobs": 100000}, "logprobs"),
                          ({"ignore_eos": "yes"}, "ignore_eos"),
                          ({"skip_special_tokens": None}, "skip_special_tokens")):
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kwargs)


def test_an_interrupted_generate_leaves_nothing_in_the_engine(llm, monkeypatch):
    """Ctrl-C (or any exception) inside generate aborts its requests: they ran
    before the next call's, to the end of their context (a 4-token call took
    346 s), and one that raised in every step broke every later call."""
    engine = llm.engine
    calls = 0
    step = engine.step

    def interrupted():
        nonlocal calls
        calls += 1
        if calls == 3:
            raise KeyboardInterrupt
        return step()

    monkeypatch.setattr(engine, "step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(["Once upon a time"] * 4, SamplingParams(max_tokens=None, ignore_eos=True))
    monkeypatch.undo()
    assert not engine.requests and not engine.has_unfinished_requests()
    assert engine.kv_manager.usage == 0
    out = llm.generate("Hi", SamplingParams(max_tokens=4, temperature=0))[0]
    assert out.outputs[0].finish_reason == "length"


def test_n_sequences_each_as_its_seed_alone(llm):
    """n > 1 (was a ValueError): outputs[i] is sequence i, sampled with seed + i."""
    hot = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=11, n=3)
    out = llm.generate(["Once upon a time", "The sea"], hot)
    assert [len(o.outputs) for o in out] == [3, 3]
    for i, seq in enumerate(out[0].outputs):
        alone = llm.generate("Once upon a time", SamplingParams(
            temperature=1.0, max_tokens=8, ignore_eos=True, seed=11 + i))[0].outputs[0]
        assert seq.index == i and seq.token_ids == alone.token_ids
    assert len({tuple(s.token_ids) for s in out[0].outputs}) > 1
    assert out[1].prompt_token_ids != out[0].prompt_token_ids


def test_chat_takes_vllms_options(llm):
    conv = [{"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "The colour is"}]
    tok = llm.get_tokenizer()
    greedy = SamplingParams(temperature=0, max_tokens=3)
    out = llm.chat(conv, greedy, add_generation_prompt=False, continue_final_message=True)[0]
    assert out.prompt_token_ids == tok.apply_chat_template(conv, False, continue_final=True)
    assert tok.decode(out.prompt_token_ids).rstrip().endswith("The colour is")
    with pytest.raises(ValueError, match="continue_final_message"):
        llm.chat(conv, greedy, continue_final_message=True)
    kw = llm.chat(conv[:1], greedy, chat_template_kwargs={"enable_thinking": False})[0]
    assert kw.prompt_token_ids == tok.apply_chat_template(conv[:1])


@pytest.mark.parametrize("kwargs,field", [
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": -3}, "max_tokens"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
])
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_unknown_model_path():
    with pytest.raises(ValueError, match="does not exist"):
        LLM(model="/nonexistent/model.gguf")


def test_corrupt_gguf(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + bytes(range(256)) * 8)
    with pytest.raises(ValueError, match="not a valid GGUF"):
        LLM(model=str(bad))


@pytest.fixture
def unloadable(tmp_path, monkeypatch) -> str:
    """A bare config.json (no tokenizer, a 128-token window) whose weights must not load:
    what is wrong with it must be found before."""
    import json

    from tandem.engine import llm_engine

    path = tmp_path / "config.json"
    path.write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 256, "max_position_embeddings": 128}))

    def no_load(*args, **kwargs):
        raise AssertionError("the weights were loaded before the error was found")

    monkeypatch.setattr(llm_engine, "load_model", no_load)
    return str(path)


def test_missing_tokenizer_fails_before_the_weights_load(unloadable):
    with pytest.raises(ValueError, match="no tokenizer.json"):
        LLM(model=unloadable, load_format="dummy")


def test_a_window_beyond_the_models_fails_before_the_weights_load(unloadable):
    with pytest.raises(ValueError, match=r"--max-model-len 512 exceeds the model's context "
                                         r"window \(128\)"):
        LLM(model=unloadable, load_format="dummy", max_model_len=512, skip_tokenizer_init=True)


def test_a_model_beyond_memory_stops_loading_at_its_first_layer(tiny_config_path, monkeypatch):
    """The engine's load: the weights measured as they are built, the KV pool
    beside them; exact at the end, projected from the first layer on."""
    from tandem.model import loader

    built = []
    check = loader.MemoryGuard.check

    def counting(self):
        built.append(len(self.layer_bytes))
        check(self)

    monkeypatch.setattr(loader.MemoryGuard, "check", counting)
    kv = 64 << 10
    kwargs = dict(model=tiny_config_path, load_format="dummy", skip_tokenizer_init=True,
                  kv_cache_memory=kv)
    weights = LLM(**kwargs).engine.model.nbytes
    built.clear()
    monkeypatch.setattr(loader, "host_memory", lambda: (1 << 40, weights + kv))
    LLM(**kwargs)  # fits exactly
    assert built == [0, 1, 2]
    for available, checks in ((weights + kv - 1, [0, 1, 2]), (weights * 3 // 4 + kv, [0, 1])):
        built.clear()
        monkeypatch.setattr(loader, "host_memory", lambda a=available: (1 << 40, a))
        with pytest.raises(ValueError, match=r"does not fit in memory.*\(float32\) beside the "
                                             r"64.0 KiB KV cache pool.*lower --kv-cache-memory "
                                             r"to about"):
            LLM(**kwargs)
        assert built == checks


@pytest.mark.parametrize("kwargs,message", [
    ({"kv_cache_memory": "1KiB"}, r"\(1.00 KiB\) holds no block of 4.00 KiB; raise "
                                  r"--kv-cache-memory$"),
    ({"kv_cache_memory": 0.5}, r"memory size must be at least 1 byte, got 0.5"),
    # 2 layers x 2 KV heads of 16 at 2 bytes: 4 KiB a 16-token block
    ({"kv_cache_memory": "16KiB", "max_model_len": 128},
     r"a 128-token context needs 8 KV blocks but the pool holds 4 \(64 tokens\)"),
])
def test_a_pool_too_small_fails_before_the_weights_load(unloadable, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(model=unloadable, load_format="dummy", skip_tokenizer_init=True, **kwargs)


def test_engine_flags_validated():
    with pytest.raises(ValueError, match="max-num-seqs"):
        LLM(max_num_seqs=0)
    with pytest.raises(ValueError, match="memory size"):
        LLM(kv_cache_memory="lots")


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "tandem.entrypoints.cli", *args],
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("args,needle", [
    (["generate", "hi", "--model", "/nope.gguf"], "does not exist"),
    (["generate", "hi", "--max-tokens", "0"], "max_tokens"),
    (["generate", "hi", "--temperature", "-1"], "temperature"),
    (["generate", "hi", "--top-p", "2"], "top_p"),
    (["generate", "", "--max-tokens", "2"], "empty"),
    (["generate", "hi", "--kv-cache-memory", "1KiB"], "KV cache"),
    (["generate", "hi", "--kv-cache-memory", "100000GiB"], "lower --kv-cache-memory"),
    (["generate", "hi", "--kv-cache-memory", "1e3"], "holds no block of"),  # 1000 bytes
])
def test_cli_errors_are_one_line(args, needle):
    r = run_cli(*args)
    assert r.returncode == 2
    assert needle in r.stderr
    assert "Traceback" not in r.stderr


def test_cli_corrupt_gguf(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"not a gguf at all")
    r = run_cli("generate", "hi", "--model", str(bad))
    assert r.returncode == 2 and "not a valid GGUF" in r.stderr and "Traceback" not in r.stderr


def test_cli_generates(tmp_path):
    r = run_cli("chat", "Name a fruit.", "--max-tokens", "6")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()
    assert "prefill" in r.stderr and "decode" in r.stderr
