"""LLMEngine: add_request / step / abort, the one loop everything else serves.

    scheduler.schedule()           -> SchedulerOutput  (who runs, how many tokens)
    model_runner.execute(...)      -> sampled ids      (one forward, one host sync)
    self._append_token(...)        -> EngineCoreOutputs (append, stop checks, free)

Not thread-safe: AsyncEngine drives it from one background thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from tandem.config import EngineConfig, host_memory, resolve_dtype
from tandem.core.kv_cache_manager import KVCacheManager
from tandem.core.output_processor import EngineCoreOutput, process_output
from tandem.core.request import Request, RequestStatus
from tandem.core.scheduler import Scheduler
from tandem.engine import kv_handoff
from tandem.engine.client import EngineStats, ModelInfo
from tandem.engine.input_processor import InputProcessor
from tandem.engine.kv_handoff import KVBlocks
from tandem.engine.kv_sizing import (
    KVLayout,
    PoolSize,
    StepBudgets,
    check_pool_before_load,
    cuda_kv_budget,
    kv_layout,
    log_pool,
    set_kv_bytes,
    size_pool,
    step_budgets,
)
from tandem.engine.token_budget import ChunkTuner
from tandem.model.attention import AttentionMetadata, build_group
from tandem.model.hugepages import populate
from tandem.model.kv_cache import kv_cache_class, kv_cache_dtype_name
from tandem.model.linear import quantization_level
from tandem.model.llama import ModelConfig
from tandem.model.loader import load_model, read_hf_config, resolve_model
from tandem.outputs import RequestOutput
from tandem.paths import default_model_path
from tandem.sampling_params import SamplingParams
from tandem.tokenizer import Tokenizer
from tandem.worker.model_runner import ModelRunner, allocate_kv_caches
from tandem.worker.structured_output import GrammarFailedError, StructuredOutputManager

logger = logging.getLogger(__name__)

KV_COMMIT_HEADROOM = 2**30  # bytes of memory the KV pool's commit leaves free


def _resolve_device(config: EngineConfig) -> torch.device:
    if config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ValueError("--device cuda was asked for but torch sees no CUDA device")
        return torch.device("cuda")
    return torch.device("cpu")


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, **kwargs) -> None:
        """Built in order: config, model (the KV layout first, from its config,
        so what can fail without the weights fails before they load: the
        tokenizer, --max-model-len, a pool of a set size), KV pool, KV manager,
        scheduler, runner."""
        config = config or EngineConfig(**kwargs)
        self.config = c = config
        t0 = time.monotonic()
        self.device = _resolve_device(c)
        if self.device.type == "cpu":
            torch.set_num_threads(c.num_threads or torch.get_num_threads())
        self.dtype = getattr(torch, resolve_dtype(c.dtype, self.device.type))  # torch's names
        files = resolve_model(c.model, c.load_format)
        self.model_dir = files.dir
        # The tokenizer before the weights: a directory without one is an error
        # in a second, not after a large model's load.
        self.tokenizer: Tokenizer | None = None
        if not c.skip_tokenizer_init:
            self.tokenizer = Tokenizer.from_dir(self.model_dir)
        # So is a --max-model-len beyond the model's window (its config.json alone),
        model_config = ModelConfig.from_hf(read_hf_config(self.model_dir))
        _check_max_model_len(c, model_config)
        max_len = c.max_model_len or model_config.max_position_embeddings
        # ... and a pool of a set size that cannot hold it (a GPU's default
        # pool is what its memory leaves after the weights: None here).
        layout = self._kv_layout(model_config, max_len)
        self.kv_cache_dtype = layout.dtype
        set_bytes = set_kv_bytes(c.kv_cache_memory) if (
            c.kv_cache_memory is not None or self.device.type == "cpu") else None
        if set_bytes is not None:
            check_pool_before_load(layout, set_bytes, max_len,
                                   fixed_len=c.max_model_len is not None)

        # The model. On CPU the load stops as soon as the weights show they cannot
        # fit beside the KV pool (loader.MemoryGuard), not when the kernel kills it.
        self.model = load_model(files, c.load_format, self.dtype, self.device, c.seed,
                                c.quantization, model_config,
                                set_bytes if self.device.type == "cpu" else None)
        self.model_config = self.model.cfg
        eos = self.tokenizer.eos_token_id if self.tokenizer else self.model_config.eos_token_id
        self.eos_token_id = eos[0] if isinstance(eos, list) else eos
        # Every end-of-generation id (generation_config's list, e.g. <|im_end|> and
        # <|endoftext|>) ends a request unless ignore_eos, like vLLM and HF.
        ends = self.tokenizer.stop_token_ids if self.tokenizer else (
            eos if isinstance(eos, list) else [eos])
        self.eos_token_ids = frozenset(t for t in ends if t is not None)
        self.load_duration_s = time.monotonic() - t0

        # The KV pool: its size, then its caches.
        steps, size = self._size_kv_pool(layout, set_bytes, max_len)
        self.kv_groups = layout.groups
        self.kv_bytes_per_token = layout.bytes_per_token
        self.kv_pool_tokens = layout.pool_tokens(size.num_blocks)
        self.max_model_len = size.max_model_len
        self.max_num_batched_tokens = size.max_num_batched_tokens
        self.kv_caches = allocate_kv_caches(self.model, size.num_blocks, c.block_size,
                                            self.dtype, layout.dtype, layout.groups)

        self.kv_manager = KVCacheManager(size.num_blocks, c.block_size, c.enable_prefix_caching,
                                         windows=layout.groups.windows)

        cap = size.max_prefill_tokens_with_decodes
        self.scheduler = Scheduler(self.kv_manager, c.max_num_seqs, size.max_num_batched_tokens,
                                   c.enable_chunked_prefill, cap)
        self.chunk_tuner = None if cap is None else ChunkTuner(
            cap, steps.t1, size.max_num_batched_tokens, steps.per_token)

        # The runner, with the grammars of structured outputs (llguidance,
        # imported on first use) where there is a tokenizer for their vocabulary.
        self.structured_output: StructuredOutputManager | None = None
        if self.tokenizer is not None:
            self.structured_output = StructuredOutputManager(
                self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)
        self.runner = ModelRunner(self.model, self.kv_caches, c.block_size, self.eos_token_ids,
                                  c.max_num_seqs, size.max_model_len, layout.groups, c.seed,
                                  self.structured_output)

        self.input_processor = InputProcessor(self.tokenizer, self.model_config.vocab_size,
                                              self.max_model_len, self.device,
                                              self.structured_output)
        self.requests: dict[str, Request] = {}
        # Engine-level counters for the metrics endpoint.
        self.num_prompt_tokens_total = 0
        self.num_generation_tokens_total = 0
        self.num_steps = 0

    # ------------------------------------------------------------------ set-up
    def _kv_layout(self, cfg: ModelConfig, max_len: int) -> KVLayout:
        """The pool's layout, its element type resolved ("auto") once, here."""
        c = self.config
        kv_dtype = kv_cache_dtype_name(c.kv_cache_dtype, self.device, self.dtype)
        return kv_layout(
            kv_dtype, kv_cache_class(kv_dtype).bytes_per_token_layer(cfg.num_key_value_heads,
                                                                     cfg.head_dim),
            [cfg.layer_window(i) for i in range(cfg.num_hidden_layers)], c.block_size, max_len,
            not c.disable_hybrid_kv_cache_manager)

    def _size_kv_pool(self, layout: KVLayout, set_bytes: int | None,
                      max_len: int) -> tuple[StepBudgets, PoolSize]:
        """The step's token budgets (on CPU measured on the loaded model), the
        pool's bytes (``set_bytes``, or a GPU's after a warm-up step), then its
        blocks and the context they hold."""
        c = self.config
        steps = step_budgets(c.max_num_batched_tokens, self.device.type, self._step_cost,
                             c.max_num_seqs, self.model_config.max_position_embeddings)
        budget = set_bytes if set_bytes is not None else self._cuda_kv_budget(
            steps.max_num_batched_tokens)
        size = size_pool(
            layout, budget, max_len, steps, chunked_prefill=c.enable_chunked_prefill,
            fixed_len=c.max_model_len is not None,
            fixed_batched=c.max_num_batched_tokens is not None,
            budget_flag="--kv-cache-memory" if set_bytes is not None
            else "--gpu-memory-utilization")
        log_pool(layout, size, c.max_num_seqs)
        return steps, size

    def _step_cost(self, num_tokens: int) -> float:
        """Seconds of one num_tokens prefill: the CPU token budgets' probe."""
        t0 = time.perf_counter()
        self.score_tokens([0] * num_tokens, 1)
        return time.perf_counter() - t0

    def _cuda_kv_budget(self, num_tokens: int) -> int:
        """Bytes left for the KV pool (kv_sizing.cuda_kv_budget) from a warm-up
        forward of up to num_tokens, one sequence, with a scratch cache."""
        c = self.config
        n = min(num_tokens, self.model_config.max_position_embeddings)
        torch.cuda.reset_peak_memory_stats()
        weights = torch.cuda.memory_allocated()
        self.score_tokens([0] * n, logits_rows=min(n, c.max_num_seqs))
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        outside_torch = (total - free) - torch.cuda.memory_reserved()
        return cuda_kv_budget(total, outside_torch, weights, peak, n, num_tokens,
                              c.gpu_memory_utilization)

    def commit_kv_pool(self) -> None:
        """Fault in the whole CPU KV pool now (a server's engine does, in a
        thread of its own right after start-up), contents kept.

        Left to fault in as blocks are first handed out, the pool's pages were
        committed mid-serving: a huge page per layer in the step whose new
        blocks reached fresh ones, which made that step slower (a host that
        backs memory on first touch). A pool that would leave less than
        KV_COMMIT_HEADROOM of memory free (checked before each chunk, so two
        engines starting together do not both take the last of it) is left to
        fault in as it fills, which is all it did before.
        """
        if self.device.type != "cpu":
            return  # device memory is committed when allocated
        t0 = time.perf_counter()
        # Layers in one place of their KV cache groups share a cache.
        tensors = list({id(t): t for c in self.kv_caches for t in c.tensors}.values())
        short: list[tuple[int, int]] = []  # (bytes left, bytes available) where it stopped

        def fits(left: int) -> bool:
            _, available = host_memory()
            if available is None or left + KV_COMMIT_HEADROOM <= available:
                return True
            short.append((left, available))
            return False

        try:
            done = populate(tensors, fits)
        except OSError as e:  # an old kernel: pages fault in as blocks are written
            logger.info("KV pool not committed ahead (%s)", e)
            return
        if done:
            logger.info("KV pool committed in %.1f s", time.perf_counter() - t0)
        else:
            left, available = short[0]
            logger.warning(
                "%.2f GiB of the KV pool not committed ahead: %.2f GiB of memory available, "
                "and at least %.0f GiB stays free; the pool fills as blocks are used, and the "
                "server may run out of memory if it does; lower --kv-cache-memory",
                left / 2**30, available / 2**30, KV_COMMIT_HEADROOM / 2**30)

    def score_tokens(self, token_ids: Sequence[int], logits_rows: int | None = None):
        """One prefill of token_ids outside the scheduler, with a scratch KV cache.

        Returns the fp32 logits of the last ``logits_rows`` positions (all when
        None): the warm-up that sizes the GPU pool, and perplexity measurements.
        """
        n, bs, dev = len(token_ids), self.config.block_size, self.device
        nblk = -(-n // bs)
        scratch = allocate_kv_caches(self.model, nblk, bs, self.dtype, self.kv_cache_dtype)
        meta = AttentionMetadata(
            slot_mapping=torch.arange(n, device=dev),
            decode=None,
            prefill=build_group([n], [n], torch.arange(nblk)[None], bs, dev, self.dtype,
                                self.model.fused, self.model.window),
        )
        rows = n if logits_rows is None else logits_rows
        return self.model.forward(
            torch.tensor(list(token_ids), dtype=torch.long, device=dev),
            torch.arange(n, device=dev), scratch, [meta] * len(scratch),
            torch.arange(n - rows, n, device=dev),
        )

    # --------------------------------------------------------------- requests
    def make_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
    ) -> Request:
        """Validate and tokenize (InputProcessor); safe from any thread."""
        return self.input_processor.make_request(prompt, params, request_id, arrival_time)

    def add_request(
        self,
        prompt: str | Sequence[int] | Request,
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> Request:
        req = prompt if isinstance(prompt, Request) else self.make_request(
            prompt, params, request_id
        )
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        self.requests[req.request_id] = req
        self.scheduler.add_request(req)
        return req

    def abort_request(
        self, request_id: str, status: RequestStatus = RequestStatus.FINISHED_ABORTED
    ) -> EngineCoreOutput | None:
        """Stop a request wherever it is and free its blocks (unknown ids: no-op).

        ``status`` FINISHED_STOPPED: a stop string, found outside the step thread,
        ended it.
        """
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        self._finish(req, status)
        req.times.finished = time.monotonic()
        return EngineCoreOutput(req, [], None, status, None, req.num_output_tokens,
                                req.times.finished)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ------------------------------------------------ the client contract's views
    def stats(self) -> EngineStats:
        """The counters, safe to read from another thread while the engine steps:
        each value is consistent, the set is a moment give or take a step. An
        engine alone has no inbox (num_pending 0) and runs on its configured
        threads; AsyncEngine replaces both with what it knows."""
        sched, kv = self.scheduler, self.kv_manager
        return EngineStats(
            num_running=sched.num_running, num_waiting=sched.num_waiting,
            num_waiting_for_kv=sched.num_waiting_for_kv, num_pending=0,
            kv_cache_usage=kv.usage, num_preemptions=sched.num_preemptions,
            prefix_cache_queries=kv.prefix_cache_queries, prefix_cache_hits=kv.prefix_cache_hits,
            prompt_tokens_total=self.num_prompt_tokens_total,
            generation_tokens_total=self.num_generation_tokens_total,
            num_threads=self.config.num_threads if self.device.type == "cpu" else None,
            num_kv_blocks=kv.num_blocks, num_steps=self.num_steps,
            scheduled_tokens_total=sched.num_scheduled_tokens,
            prefill_tokens_total=sched.num_prefill_tokens,
        )

    def model_info(self) -> ModelInfo:
        """The served model as the client contract describes it."""
        c, m = self.config, self.model_config
        return ModelInfo(
            source=c.model, model_dir=str(self.model_dir),
            model_path=str(default_model_path() if c.model is None else c.model),
            load_format=c.load_format, architecture=m.architecture, vocab_size=m.vocab_size,
            hidden_size=m.hidden_size, num_hidden_layers=m.num_hidden_layers,
            num_attention_heads=m.num_attention_heads,
            num_key_value_heads=m.num_key_value_heads, max_model_len=self.max_model_len,
            max_num_seqs=c.max_num_seqs, parameter_count=parameter_count(m),
            size_bytes=self.model.nbytes, quantization_level=served_quantization(self),
            device=self.device.type, load_duration_s=self.load_duration_s,
        )

    # ------------------------------------------- KV hand-off (disaggregated prefill)
    def export_kv(self, token_ids: Sequence[int]) -> KVBlocks:
        """token_ids' cached prefix copied out (kv_handoff.export_kv). Engine
        thread only (AsyncEngine.call)."""
        return kv_handoff.export_kv(self.kv_manager, self.kv_caches, self.kv_groups,
                                    self.config.block_size, token_ids)

    def import_kv(self, kv: KVBlocks) -> int:
        """Another engine's export as prefix-cache blocks (kv_handoff.import_kv);
        the tokens now cached. Engine thread only (AsyncEngine.call)."""
        return kv_handoff.import_kv(self.kv_manager, self.kv_caches, self.kv_groups,
                                    self.config.block_size, kv)

    # -------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """One step, its outputs with text (offline use: LLM, the CLI)."""
        outputs = []
        for core in self.step_core():
            out, stopped_by_string = process_output(core)
            if stopped_by_string:  # the request ends in this step, as if a token ended it
                self.abort_request(out.request_id, RequestStatus.FINISHED_STOPPED)
            if out is not None:
                outputs.append(out)
        return outputs

    def step_core(self) -> list[EngineCoreOutput]:
        """Schedule, run the model, append each sampled token, end what token ids
        end (EOS, stop ids, max_tokens); text is ``process_output``'s job."""
        start = time.monotonic()
        scheduler, tuner = self.scheduler, self.chunk_tuner
        if tuner is not None:  # this step's tokens: the change of the scheduler's totals
            scheduled, prefill = scheduler.num_scheduled_tokens, scheduler.num_prefill_tokens
        sched = scheduler.schedule(start)
        for req in sched.preempted:  # recomputed later, in fresh blocks
            self.runner.remove_request(req.request_id)
        if not sched:
            return []
        result = self.runner.execute(sched)
        now = time.monotonic()
        if tuner is not None:
            prefill = scheduler.num_prefill_tokens - prefill
            scheduler.max_prefill_tokens_with_decodes = tuner.observe(
                now - start, scheduler.num_scheduled_tokens - scheduled - prefill, prefill)
        self.num_steps += 1
        for req, n in zip(sched.requests, sched.num_scheduled_tokens):
            req.num_computed_tokens += n
        for req, entries in result.prompt_logprobs:
            req.prompt_logprobs.extend(entries)
        outputs = []
        logprobs = result.logprobs or [None] * len(result.requests)
        for req, tok, lp in zip(result.requests, result.sampled_token_ids, logprobs):
            out = self._append_token(req, tok, lp, now)
            self.num_generation_tokens_total += len(out.new_token_ids)
            outputs.append(out)
        return outputs

    def _append_token(
        self, req: Request, tok: int, logprobs: dict[int, float] | None, now: float
    ) -> EngineCoreOutput:
        t = req.times
        if t.first_token is None:  # the prompt's compute ends here
            t.first_token = now
            self.num_prompt_tokens_total += req.num_prompt_tokens
        if req.max_tokens == 0:  # the prompt alone: nothing is kept of what it sampled
            self._finish(req, RequestStatus.FINISHED_LENGTH)
            self.requests.pop(req.request_id, None)
            t.finished = now
            return EngineCoreOutput(req, [], None, RequestStatus.FINISHED_LENGTH, None, 0, now,
                                    False)
        req.append_token(tok)
        if logprobs is not None:
            req.logprobs.append(logprobs)
        t.last_token = now
        p = req.sampling_params
        n_out = req.num_output_tokens
        status = stop_id = None
        text = True  # the token that hit EOS or a stop id is not text
        grammar = req.structured_output_request
        if n_out >= p.min_tokens:
            if tok in self.eos_token_ids and not p.ignore_eos:
                status, text = RequestStatus.FINISHED_STOPPED, False
            elif tok in p.stop_token_ids:
                status, stop_id, text = RequestStatus.FINISHED_STOPPED, tok, False
        if grammar is not None:
            try:
                complete = grammar.accept(tok)
            except GrammarFailedError as e:  # this request ends; the step's others go on
                logger.warning("req %s: %s", req.request_id, e)
                req.error, complete = str(e), False
                status, stop_id, text = RequestStatus.FINISHED_ERROR, None, False
            if complete and status is None:
                # The grammar is complete (nothing may follow), min_tokens or not; the
                # token that completed it is text unless it is an EOS the grammar took.
                status, text = RequestStatus.FINISHED_STOPPED, tok not in self.eos_token_ids
        if status is None and n_out >= req.max_tokens:
            status = RequestStatus.FINISHED_LENGTH
        if status is not None:
            self._finish(req, status)
            self.requests.pop(req.request_id, None)
            t.finished = now
        return EngineCoreOutput(req, [tok], logprobs, status, stop_id, n_out, now, text)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        """The request leaves the scheduler, its blocks and its block-table row."""
        self.scheduler.finish_request(req, status)
        self.runner.remove_request(req.request_id)


def parameter_count(cfg: ModelConfig) -> int:
    """From the config (not the tensors), so a quantized layout does not change it."""
    h, v, inter, d = cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size, cfg.head_dim
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    per_layer = (
        h * (heads + 2 * kv) * d  # q, k, v
        + heads * d * h  # o
        + 3 * h * inter  # gate, up, down
        + 2 * h  # norms
    )
    if cfg.attention_bias:
        per_layer += (heads + 2 * kv) * d
    if cfg.qk_norm:
        per_layer += 2 * d
    embed = v * h
    head = 0 if cfg.tie_word_embeddings else v * h
    moe = 0
    if cfg.moe is not None:  # its layers' experts and router in place of the dense MLP
        e = cfg.moe.num_experts
        moe = len(cfg.moe.layers) * (e * 3 * h * cfg.moe.intermediate_size + e * h - 3 * h * inter)
    return embed + cfg.num_hidden_layers * per_layer + moe + h + head


def served_quantization(engine: LLMEngine) -> str:
    """The format holding most of the layer matmuls' bytes, as served (a Q4_K_M
    file's few Q6_K matrices run as int8 beside its int4 majority)."""
    by_level: dict[str, int] = {}
    for layer in engine.model.layers:
        for lin in layer.matmuls:
            level = quantization_level(lin)
            by_level[level] = by_level.get(level, 0) + lin.nbytes
    return max(by_level, key=by_level.__getitem__)


def _check_max_model_len(config: EngineConfig, cfg: ModelConfig) -> None:
    """The served window fits the model's (what its positions were trained to)."""
    if config.max_model_len and config.max_model_len > cfg.max_position_embeddings:
        raise ValueError(
            f"--max-model-len {config.max_model_len} exceeds the model's context window "
            f"({cfg.max_position_embeddings})"
        )
