"""The KV pool's size, decided once at start-up: its layout (element type, a
block's bytes, the layers' KV cache groups), the step's token budgets, the
bytes it may take (set ahead, or what a GPU leaves), the blocks those buy and
the longest context they hold.

Functions of plain numbers (no torch, no engine): the engine calls them with
what it measured, the planner (tandem.tools.plan) can with its own.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tandem.config import format_bytes
from tandem.core.kv_cache_utils import KVCacheGroups, group_layers
from tandem.engine.token_budget import cpu_token_budgets

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_BYTES = 2 * 2**30
CUDA_BATCHED_TOKENS = 8192  # --max-num-batched-tokens' default on CUDA


@dataclass(frozen=True)
class KVLayout:
    """How the pool holds tokens: its element type ("auto" resolved), a token's
    KV bytes in one layer, the layers' KV cache groups and the block size."""

    dtype: str
    layer_bytes: int
    groups: KVCacheGroups
    block_size: int

    @property
    def block_bytes(self) -> int:
        """A block: block_size tokens of one group's layers."""
        return self.groups.group_size * self.layer_bytes * self.block_size

    @property
    def bytes_per_token(self) -> int:
        """Every layer's KV of one token."""
        return len(self.groups.layer_group) * self.layer_bytes

    def pool_tokens(self, num_blocks: int) -> int:
        """Tokens of every layer's KV that num_blocks' bytes hold (their tokens
        without window groups)."""
        return num_blocks * self.block_size * self.groups.group_size // len(
            self.groups.layer_group)

    def blocks_for(self, num_tokens: int, chunk: int) -> int:
        return self.groups.blocks_for(num_tokens, self.block_size, chunk)


def kv_layout(dtype: str, layer_bytes: int, layer_windows: Sequence[int], block_size: int,
              max_len: int, hybrid: bool = True) -> KVLayout:
    """The layout of a pool of ``dtype`` elements (``layer_bytes`` a token in one
    layer) for layers with these windows (0: full attention), serving up to
    ``max_len`` tokens; ``hybrid`` False keeps every layer in one group."""
    return KVLayout(dtype, layer_bytes, group_layers(layer_windows, hybrid, max_len), block_size)


def set_kv_bytes(kv_cache_memory: int | None) -> int:
    """The pool's bytes where they are set ahead: --kv-cache-memory, or the
    CPU's default (a GPU's default is what its memory leaves)."""
    return DEFAULT_CPU_KV_BYTES if kv_cache_memory is None else int(kv_cache_memory)


def longest_context(groups: KVCacheGroups, block_size: int, chunk: int, num_blocks: int,
                    max_len: int) -> int:
    """The most tokens, up to max_len, one request holds in ``num_blocks``
    blocks, its steps computing up to ``chunk`` tokens (a window group keeps
    them): blocks_for grows with the tokens, so a bisect finds it."""
    return bisect.bisect_right(
        range(max_len + 1), num_blocks,
        key=lambda n: groups.blocks_for(n, block_size, chunk)) - 1


def pool_blocks(layout: KVLayout, budget: int, max_len: int, chunk: int, *, fixed_len: bool,
                budget_flag: str = "--kv-cache-memory") -> tuple[int, int]:
    """(blocks, the context they hold up to max_len) of a pool of ``budget``
    bytes whose requests' steps compute up to ``chunk`` tokens each.

    ValueError when it holds no block (raise ``budget_flag``), or cannot hold
    the context: max_len when ``fixed_len`` (--max-model-len was given), else
    2 tokens.
    """
    num_blocks = budget // layout.block_bytes
    if num_blocks < 1:
        raise ValueError(
            f"the KV cache budget ({format_bytes(budget)}) holds no block of "
            f"{format_bytes(layout.block_bytes)}; raise {budget_flag}"
        )
    if layout.blocks_for(max_len, chunk) > num_blocks:
        fits = longest_context(layout.groups, layout.block_size, chunk, num_blocks, max_len)
        if fixed_len or fits < 2:
            raise ValueError(
                f"a {max_len}-token context needs {layout.blocks_for(max_len, chunk)} KV blocks "
                f"but the pool holds {num_blocks} ({fits} tokens); raise --kv-cache-memory or "
                "lower --max-model-len"
            )
        max_len = fits
    return num_blocks, max_len


def check_pool_before_load(layout: KVLayout, budget: int, max_len: int, *,
                           fixed_len: bool) -> None:
    """A pool of a set size that cannot hold the context fails before the
    weights load (minutes for a large model), not after: at the fewest blocks
    a request can hold (steps of one token; a window group keeps a step's
    tokens too, and the step budget is measured on the loaded model)."""
    pool_blocks(layout, budget, max_len, chunk=1, fixed_len=fixed_len)


@dataclass(frozen=True)
class StepBudgets:
    """The step's token budgets before the pool is sized, and on CPU the costs
    they were measured from (ChunkTuner keeps the prompt cap to them)."""

    max_num_batched_tokens: int
    max_prefill_tokens_with_decodes: int | None  # None: every step's budget is the total
    t1: float = 0.0  # a 1-token step's seconds
    per_token: float = 0.0  # a further token's


def step_budgets(max_num_batched_tokens: int | None, device_type: str,
                 cost: Callable[[int], float], max_num_seqs: int,
                 max_positions: int) -> StepBudgets:
    """An explicit budget holds for every step (vLLM's semantics); CUDA's
    default is CUDA_BATCHED_TOKENS; CPU's follows the model's cost (``cost(n)``:
    the seconds of an n-token forward, cpu_token_budgets) and caps prompt
    tokens in steps with decodes."""
    if max_num_batched_tokens is not None:
        return StepBudgets(max_num_batched_tokens, None)
    if device_type == "cuda":
        return StepBudgets(CUDA_BATCHED_TOKENS, None)
    total, with_decodes, t1, per_token = cpu_token_budgets(cost, max_num_seqs, max_positions)
    logger.info("token budget %d per step, %d prompt tokens in steps with decodes (to "
                "start: tuned while serving): a 1-token step costs %.1f ms, each further "
                "token %.2f ms", total, with_decodes, t1 * 1e3, per_token * 1e3)
    return StepBudgets(total, with_decodes, t1, per_token)


def cuda_kv_budget(total: int, outside_torch: int, weights: int, warmup_peak: int,
                   warmup_tokens: int, num_tokens: int, utilization: float) -> int:
    """Bytes left for the KV pool on a GPU: ``utilization`` of its ``total``
    minus a ``num_tokens`` step's peak and the memory held outside torch's
    allocator (CUDA context, libraries).

    A warm-up forward of ``warmup_tokens`` (one prefill sequence, with a
    scratch cache) peaked at ``warmup_peak`` on top of the ``weights``. One
    sequence holds at most the model's positions: a budget beyond them
    (several sequences in a step) scales the measured activations linearly.
    """
    peak = weights + (warmup_peak - weights) * num_tokens // warmup_tokens
    budget = int(total * utilization) - peak - outside_torch
    logger.info("GPU memory: %.2f GiB total, peak %.2f GiB after weights + warm-up "
                "(%d tokens), %.2f GiB outside torch -> %.2f GiB for the KV cache",
                total / 2**30, peak / 2**30, num_tokens, outside_torch / 2**30,
                budget / 2**30)
    return budget


@dataclass(frozen=True)
class PoolSize:
    """The pool and the limits it sets."""

    num_blocks: int
    max_model_len: int  # lowered to what the pool holds unless --max-model-len was given
    max_num_batched_tokens: int
    max_prefill_tokens_with_decodes: int | None
    chunk: int  # the most tokens one step computes for a request


def size_pool(layout: KVLayout, budget: int, max_len: int, steps: StepBudgets, *,
              chunked_prefill: bool, fixed_len: bool, fixed_batched: bool,
              budget_flag: str) -> PoolSize:
    """The blocks ``budget`` bytes buy and the context they hold. Without
    chunked prefill a prompt runs in one step: the budget (unless set,
    ``fixed_batched``) grows to the context, and must hold it."""
    tokens, cap = steps.max_num_batched_tokens, steps.max_prefill_tokens_with_decodes
    chunk = tokens if chunked_prefill else max(tokens, max_len)
    num_blocks, fits = pool_blocks(layout, budget, max_len, chunk, fixed_len=fixed_len,
                                   budget_flag=budget_flag)
    if fits < max_len:
        logger.warning("max_model_len lowered from %d to the %d tokens the KV pool holds",
                       max_len, fits)
        max_len = fits
    if not chunked_prefill and not fixed_batched:
        tokens, cap = max(tokens, max_len), None
    if not chunked_prefill and tokens < max_len:
        raise ValueError(
            f"without chunked prefill --max-num-batched-tokens ({tokens}) must be "
            f">= max_model_len ({max_len}), or long prompts could never be scheduled"
        )
    return PoolSize(num_blocks, max_len, tokens, cap, chunk)


def log_pool(layout: KVLayout, size: PoolSize, max_num_seqs: int) -> None:
    groups, bs, cap = layout.groups, layout.block_size, size.max_prefill_tokens_with_decodes
    logger.info(
        "KV cache (%s): %d blocks x %d tokens x %d layers (%.2f GiB), %d bytes/token of "
        "%d layers%s; max_model_len %d -> %.1f full-context conversations fit; "
        "max_num_seqs %d, max_num_batched_tokens %d%s",
        layout.dtype, size.num_blocks, bs, groups.group_size,
        size.num_blocks * layout.block_bytes / 2**30, layout.bytes_per_token,
        len(groups.layer_group),
        f"; {len(groups.windows)} groups, windows {groups.windows}: a request holds the "
        "windowed layers' blocks of its last window only" if groups.hybrid else "",
        size.max_model_len, size.num_blocks / layout.blocks_for(size.max_model_len, size.chunk),
        max_num_seqs, size.max_num_batched_tokens,
        "" if cap is None else f" ({cap} prompt tokens in steps with decodes)",
    )
