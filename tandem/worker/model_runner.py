"""SchedulerOutput -> flat batch tensors -> one forward -> sampled token ids.

Per step the host work is O(requests) Python plus O(tokens) list building for
prefill chunks (those tokens have to reach the model anyway); every per-layer
index or mask tensor is built here once and shared by all layers. The only
host synchronisation is the final ``.tolist()`` of the sampled ids (and, in a
step that scores prompt tokens for prompt logprobs, one for those).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tandem.core.kv_cache_utils import KVCacheGroups
from tandem.core.request import Request
from tandem.core.scheduler import SchedulerOutput
from tandem.model.attention import AttentionMetadata, build_groups
from tandem.model.kv_cache import KVCache, kv_cache_class, kv_zeros
from tandem.model.llama import LlamaModel
from tandem.worker.block_table import BlockTable
from tandem.worker.decode_step import DecodeStep
from tandem.worker.sampler import Sampler
from tandem.worker.sampling_metadata import SamplingMetadata
from tandem.worker.structured_output import StructuredOutputManager


@dataclass
class ModelRunnerOutput:
    """Requests that sampled this step, in the same order as their tokens."""

    requests: list[Request]
    sampled_token_ids: list[int]
    logprobs: list[dict[int, float] | None] | None = None
    # Requests asking for prompt logprobs: the next entries of their
    # Request.prompt_logprobs this step computed, in prompt order.
    prompt_logprobs: list[tuple[Request, list[dict[int, float]]]] = field(default_factory=list)


def allocate_kv_caches(
    model: LlamaModel, num_blocks: int, block_size: int, dtype: torch.dtype,
    kv_cache_dtype: str, groups: KVCacheGroups | None = None,
) -> list[KVCache]:
    """Each layer's cache, holding ``kv_cache_dtype`` (a resolved element type:
    tandem.model.kv_cache.kv_cache_dtype_name). With KV cache ``groups``, the
    layers in one place of their groups share a cache (each block is one
    group's); without, every layer has its own."""
    cfg = model.cfg
    cls = kv_cache_class(kv_cache_dtype)
    zeros = kv_zeros(model.device)  # one allocator: small layers share its chunks
    n = cfg.num_hidden_layers
    slots = groups.layer_slot if groups is not None else range(n)
    caches = [
        cls(num_blocks * block_size, cfg.num_key_value_heads, cfg.head_dim, dtype, model.device,
            zeros)
        for _ in range(max(slots) + 1)
    ]
    return [caches[s] for s in slots]


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        kv_caches: list[KVCache],
        block_size: int,
        eos_token_ids: frozenset[int],
        max_num_seqs: int,
        max_model_len: int,
        groups: KVCacheGroups,
        seed: int = 0,
        structured_output: StructuredOutputManager | None = None,
    ) -> None:
        """``structured_output``: the grammars' token masks, where the engine has
        a tokenizer (they need its vocabulary); None: no request is constrained."""
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.groups = groups
        self.block_table = BlockTable(max_num_seqs, -(-max_model_len // block_size) + 1,
                                      len(groups.windows))
        self.eos_token_ids = eos_token_ids
        self.device = model.device
        self.vocab_size = model.cfg.vocab_size
        self.sampler = Sampler()
        # Unseeded requests' draws: the engine's own stream, not torch's global one.
        self.generator = torch.Generator(self.device).manual_seed(seed)
        self.decode_step = DecodeStep.build(model, kv_caches, block_size, groups.layer_group)
        self.structured_output = structured_output

    def remove_request(self, request_id: str) -> None:
        """A request finished or was preempted (it recomputes later, in fresh
        blocks): its block-table row is free (no-op if it had none)."""
        self.block_table.release(request_id)

    def _slots(self, row: int, start: int, n: int) -> torch.Tensor:
        """[groups, n]: each KV cache group's slots of positions [start, start + n)
        of the sequence in ``row``."""
        bs = self.block_size
        pos = torch.arange(start, start + n)
        return self.block_table.tensor[:, row, pos // bs].long() * bs + pos % bs

    def prepare(self, out: SchedulerOutput) -> tuple:
        """Flat inputs, decodes (1 new token) first, then prefill chunks; the
        attention metadata of each layer (one per KV cache group, shared)."""
        bs = self.block_size
        dec = [(r, n) for r, n in zip(out.requests, out.num_scheduled_tokens) if n == 1]
        pre = [(r, n) for r, n in zip(out.requests, out.num_scheduled_tokens) if n > 1]
        ids: list[int] = []
        positions: list[int] = []
        slots: list[list[int]] = [[] for _ in self.groups.windows]  # per group, the decodes'
        group0, others = slots[0], slots[1:]
        for r, _ in dec:
            c = r.num_computed_tokens
            ids.append(r.token_ids[c])
            positions.append(c)
            i, off = divmod(c, bs)
            group0.append(r.block_ids[i] * bs + off)
            for out_slots, g in zip(others, r.group_block_ids):
                out_slots.append(g[i] * bs + off)
        slot_parts = [torch.tensor(slots, dtype=torch.long)]
        pre_rows = self.block_table.rows([r for r, _ in pre])
        for (r, n), row in zip(pre, pre_rows):
            c = r.num_computed_tokens
            ids.extend(r.token_ids[c : c + n])
            positions.extend(range(c, c + n))
            slot_parts.append(self._slots(row, c, n))
        # Rows whose chunk reaches the end of their tokens sample a token; after
        # them, the rows whose logits score a next prompt token (prompt logprobs).
        sample_reqs: list[Request] = []
        logits_idx: list[int] = []
        prompt_rows: list[tuple[Request, int, int]] = []  # (request, first position, count)
        prompt_idx: list[int] = []
        t = 0
        for r, n in dec + pre:
            c = r.num_computed_tokens
            if r.prompt_logprobs_pending:
                # Position p's logits score prompt token p + 1; those before
                # len(prompt_logprobs) were scored before a preemption.
                first, end = max(c, len(r.prompt_logprobs)), min(c + n, r.num_prompt_tokens - 1)
                if first < end:
                    prompt_rows.append((r, first, end - first))
                    prompt_idx.extend(range(t + first - c, t + end - c))
            t += n
            if c + n == r.num_tokens:
                sample_reqs.append(r)
                logits_idx.append(t - 1)
        logits_idx.extend(prompt_idx)

        def groups(items: list[tuple[Request, int]], rows: list[int]) -> list:
            if not items:
                return [None] * len(windows)
            ctx = [r.num_computed_tokens + n for r, n in items]
            return build_groups([n for _, n in items], ctx,
                                self.block_table.table(rows, -(-max(ctx) // bs)), bs,
                                self.device, self.model.dtype, self.model.fused, windows)

        # One group (no KV cache groups) holds every layer: its windowed ones'.
        windows = self.groups.windows if self.groups.hybrid else (self.model.window,)
        slot_mapping = torch.cat(slot_parts, 1).to(self.device)
        metas = [AttentionMetadata(slot_mapping=s, decode=d, prefill=p) for s, d, p in zip(
            slot_mapping.unbind(0), groups(dec, self.block_table.rows([r for r, _ in dec])),
            groups(pre, pre_rows))]
        dev = self.device
        return (
            torch.tensor(ids, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            [metas[g] for g in self.groups.layer_group],
            torch.tensor(logits_idx, dtype=torch.long, device=dev) if logits_idx else None,
            sample_reqs,
            prompt_rows,
        )

    def uses_decode_step(self, out: SchedulerOutput) -> bool:
        """Which path runs this step: the one-call decode step when it is built,
        every scheduled sequence decodes one token and samples, and they fit."""
        step = self.decode_step
        return step is not None and len(out.requests) <= step.max_batch and all(
            n == 1 and r.num_computed_tokens + 1 == r.num_tokens
            for r, n in zip(out.requests, out.num_scheduled_tokens))

    def _decode_step_inputs(self, reqs: list[Request]) -> tuple[torch.Tensor, torch.Tensor]:
        """The decode step's token rows (id, position, a slot per KV cache group)
        and block tables."""
        bs = self.block_size
        tokens = []
        for r in reqs:
            c = r.num_computed_tokens
            i, off = divmod(c, bs)
            row = [r.token_ids[c], c, r.block_ids[i] * bs + off]
            for g in r.group_block_ids:
                row.append(g[i] * bs + off)
            tokens.append(row)
        nblk = max(t[1] for t in tokens) // bs + 1  # blocks of the longest context
        table = self.block_table.table(self.block_table.rows(reqs), nblk)
        return torch.tensor(tokens, dtype=torch.long), table

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        argmax = None
        prompt_logprobs: list[tuple[Request, list[dict[int, float]]]] = []
        if self.uses_decode_step(out):
            sample_reqs = out.requests
            logits, argmax = self.decode_step(*self._decode_step_inputs(sample_reqs))
        else:
            input_ids, positions, metas, logits_idx, sample_reqs, prompt_rows = self.prepare(out)
            logits = self.model.forward(input_ids, positions, self.kv_caches, metas, logits_idx)
            if prompt_rows:
                ns = len(sample_reqs)
                prompt_logprobs = _prompt_logprobs(logits[ns:], prompt_rows)
                logits = logits[:ns] if ns else None
        if logits is None:
            return ModelRunnerOutput([], [], prompt_logprobs=prompt_logprobs)
        smeta = SamplingMetadata.build(
            params=[r.sampling_params for r in sample_reqs],
            generators=[r.generator for r in sample_reqs],
            prompt_token_ids=[r.prompt_token_ids for r in sample_reqs],
            output_token_ids=[r.output_token_ids for r in sample_reqs],
            eos_token_ids=self.eos_token_ids,
            vocab_size=self.vocab_size,
            device=self.device,
            default_generator=self.generator,
        )
        # Constrained rows' token masks: after the forward is issued, so on a GPU
        # the fill overlaps its kernels.
        masks = None if self.structured_output is None else self.structured_output.masks(
            sample_reqs)
        if masks is not None:
            rows, bitmask = masks
            smeta.grammar_mask = (rows.to(self.device), bitmask.to(self.device))
        if argmax is not None and smeta.argmax_only:
            return ModelRunnerOutput(sample_reqs, argmax.tolist())  # the step's one host sync
        so = self.sampler(logits, smeta)
        sampled = so.sampled_token_ids.tolist()  # the step's one host sync
        logprobs = None
        if so.logprobs is not None:
            lp, ids = so.logprobs.tolist(), so.logprob_token_ids.tolist()
            logprobs = []
            for r, row_lp, row_ids in zip(sample_reqs, lp, ids):
                k = r.sampling_params.logprobs
                if k is None:
                    logprobs.append(None)
                else:
                    logprobs.append(dict(zip(row_ids[: k + 1], row_lp[: k + 1])))
        return ModelRunnerOutput(sample_reqs, sampled, logprobs, prompt_logprobs)


# Rows of prompt logits turned into logprobs at a time: bounds the [rows, vocab]
# fp32 temporaries (a 128k vocabulary: 64 MB) whatever the chunk size.
_PROMPT_LOGPROB_ROWS = 128


def _prompt_logprobs(logits: torch.Tensor, prompt_rows: list[tuple[Request, int, int]]
                     ) -> list[tuple[Request, list[dict[int, float]]]]:
    """Each (request, first position, count): {next prompt token: its logprob, the
    top k: theirs} per position (log_softmax of the raw logits, as sampled tokens')."""
    dev = logits.device
    targets = [t for r, first, n in prompt_rows for t in r.token_ids[first + 1:first + 1 + n]]
    tok = torch.tensor(targets, dtype=torch.long, device=dev)[:, None]
    k = max(r.sampling_params.prompt_logprobs for r, _, _ in prompt_rows)
    lps, ids = [], []
    for s in range(0, logits.shape[0], _PROMPT_LOGPROB_ROWS):
        lp = torch.log_softmax(logits[s:s + _PROMPT_LOGPROB_ROWS].float(), dim=-1)
        t = tok[s:s + _PROMPT_LOGPROB_ROWS]
        lps.append(lp.gather(1, t))
        ids.append(t)
        if k:
            top = torch.topk(lp, min(k, lp.shape[1]), dim=-1)
            lps[-1] = torch.cat([lps[-1], top.values], 1)
            ids[-1] = torch.cat([t, top.indices], 1)
    all_lp, all_ids = torch.cat(lps).tolist(), torch.cat(ids).tolist()
    out, row = [], 0
    for r, _, n in prompt_rows:
        w = r.sampling_params.prompt_logprobs + 1
        out.append((r, [dict(zip(all_ids[i][:w], all_lp[i][:w])) for i in range(row, row + n)]))
        row += n
    return out
