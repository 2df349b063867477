"""Sliding-window KV cache groups (Gemma 2 and 3): a request holds its windowed
layers' blocks of its last window only, and serves what HF computes."""

from __future__ import annotations

import pytest
import torch

from tandem.config import EngineConfig
from tandem.core.kv_cache_manager import NULL_BLOCK
from tandem.engine.llm_engine import LLMEngine
from tandem.sampling_params import SamplingParams

from .cpu_paths import CPU_PATHS, cpu_path
from .test_architectures import hf_model

# 3 layers of 256 B of fp32 K/V per token; blocks of 4 tokens: 48 KiB = 48 blocks.
POOL = dict(kv_cache_memory="48KiB", kv_cache_dtype="fp32", block_size=4,
            max_num_batched_tokens=16)


def _engine(path, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), skip_tokenizer_init=True, **{**POOL, **kw}))


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3")
    hf = hf_model("gemma3")  # windowed (10 keys), global, windowed
    hf.save_pretrained(path)
    return hf, path


def test_the_pool_holds_a_longer_context_with_window_groups(gemma3):
    _, path = gemma3
    hybrid, flat = _engine(path), _engine(path, disable_hybrid_kv_cache_manager=True)
    assert hybrid.kv_groups.windows == (0, 10, 10) and not flat.kv_groups.hybrid
    # Per 4 tokens: 3 layers' blocks without groups; with them 1 block, and 2 for
    # the windowed layers' last 10 keys and a 16-token chunk (8 blocks each).
    assert flat.max_model_len == 64
    assert hybrid.max_model_len == 128
    with pytest.raises(ValueError, match="pool holds 48"):
        _engine(path, max_model_len=129)
    with pytest.raises(ValueError, match="pool holds 1 "):  # no context fits
        _engine(path, kv_cache_memory="1KiB")
    # A window no shorter than the context hides no key: one group.
    assert not _engine(path, max_model_len=10).kv_groups.hybrid


def _hf_logprobs(hf, prompt: list[int], out: list[int]) -> list[float]:
    """HF's log-probability of each output token after the tokens before it."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + out])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(out)[:, None])[
        :, 0].tolist()


def test_window_groups_serve_hf_logprobs_under_preemption_and_prefix_hits(gemma3):
    """A prompt longer than the pool holds without groups, prompts sharing a
    prefix (hits that need only the window's blocks) and more requests than the
    pool holds at once (preemption, then recompute from cached blocks), on
    every CPU path: each sampled token's log-probability is HF's, and the
    windowed layers' blocks are released as they slide out."""
    hf, path = gemma3
    engine = _engine(path)
    kv = engine.kv_manager
    take = kv._take_free

    def take_newest(group: int):
        """The block freed last is taken first: a block released while a window
        still sees it would be overwritten by the next one taken."""
        kv.free_blocks.move_to_end(next(reversed(kv.free_blocks)), last=False)
        return take(group)

    kv._take_free = take_newest
    rng = torch.Generator().manual_seed(0)

    def tokens(n: int) -> list[int]:
        return torch.randint(3, 96, (n,), generator=rng).tolist()

    shared = tokens(30)
    prompts = [tokens(96), shared + tokens(2), shared + tokens(1), shared[:9], tokens(5)]
    params = SamplingParams(temperature=0.8, seed=1, max_tokens=14, ignore_eos=True,
                            logprobs=0)
    for path_name in CPU_PATHS:
        with cpu_path(engine, path_name):
            reqs = [engine.add_request(p, params) for p in prompts]
            most_held, released = 0, False
            while engine.has_unfinished_requests():
                engine.step()
                for r in engine.scheduler.running:
                    for ids in r.group_block_ids:
                        held = sum(b != NULL_BLOCK for b in ids)
                        most_held = max(most_held, held)
                        released |= held < len(ids)
        for p, r in zip(prompts, reqs):
            got = [lp[t] for lp, t in zip(r.logprobs, r.output_token_ids)]
            want = _hf_logprobs(hf, p, r.output_token_ids)
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=path_name)
        # 10 keys and a 16-token chunk: at most ceil(25 / 4) + 1 blocks of a group.
        assert released and most_held <= 8
    assert engine.scheduler.num_preemptions > 0
    assert kv.prefix_cache_hits > 0
    assert kv.usage == 0


def test_kv_hand_off_needs_one_group(gemma3):
    _, path = gemma3
    with pytest.raises(ValueError, match="--disable-hybrid-kv-cache-manager"):
        _engine(path).export_kv(list(range(3, 20)))
    flat = _engine(path, disable_hybrid_kv_cache_manager=True)
    assert flat.export_kv(list(range(3, 20))).token_ids == []  # nothing cached yet


def test_plan_engine_check_counts_the_pool_by_groups(gemma3):
    from tandem.tools.plan.arithmetic import kv_groups
    from tandem.tools.plan.engine_check import check_engine
    from tandem.tools.plan.readers import load_model

    _, path = gemma3
    chk = check_engine(str(path), kv_cache_memory=2**20, kv_cache_dtype="fp32")
    assert chk.ok and chk.engine_cache_tokens == 2**20 // (3 * 256)
    assert any(n.startswith("3 KV cache groups of 1 layers (the engine's: 3 of 1)")
               for n in chk.notes)
    # The planner groups the layers as the engine does, from the same config.json.
    assert kv_groups(load_model(str(path)), 64) == _engine(path).kv_groups
    # At a --max-model-len the window does not hide keys of, one group (the engine's too).
    assert not kv_groups(load_model(str(path)), 10).hybrid
    assert not _engine(path, max_model_len=10).kv_groups.hybrid
    chk = check_engine(str(path), kv_cache_memory=2**20, kv_cache_dtype="fp32", context=10)
    assert chk.ok and chk.engine_cache_tokens == 2**20 // (3 * 256) // 16 * 16
    assert not any("KV cache groups" in n for n in chk.notes)
