"""Offline API: ``LLM(model=...).generate(prompts, SamplingParams)``, like vLLM's."""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Sequence
from typing import Any

from tandem.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.outputs import RequestOutput
from tandem.sampling_params import SamplingParams, checked_params

# Text, token ids, or vLLM's prompt dicts: {"prompt": text}, {"prompt_token_ids": ids}.
Prompt = str | Sequence[int] | dict[str, Any]


def _is_token(x: object) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """One prompt or a sequence of them. A dict was iterated as a sequence: its key
    names became the prompts."""
    if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, Sequence) and prompts and _is_token(prompts[0])):
        prompts = [prompts]
    if isinstance(prompts, (bytes, bytearray)) or not isinstance(prompts, Sequence):
        raise ValueError("prompts are a prompt (text, token ids, or a dict with prompt or "
                         f"prompt_token_ids) or a list of them, got {type(prompts).__name__}")
    if not prompts:
        raise ValueError("no prompts given")
    return list(prompts)


def _prompt(p: Prompt) -> str | Sequence[int]:
    """What the engine tokenizes or takes: a dict's ids when it has them, else its text."""
    if not isinstance(p, dict):
        return p
    other = sorted(k for k, v in p.items() if k not in ("prompt", "prompt_token_ids")
                   and v is not None)
    if other:
        raise ValueError(f"prompt fields {other} are not supported (prompt or "
                         "prompt_token_ids only)")
    if p.get("prompt_token_ids") is not None:  # the ids, when the text comes with them
        return p["prompt_token_ids"]
    if p.get("prompt") is None:
        raise ValueError("a prompt dict needs prompt (text) or prompt_token_ids")
    return p["prompt"]


class LLM:
    """All prompts go into one engine at once and share its batched steps."""

    def __init__(self, model: str | None = None, **engine_kwargs) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **engine_kwargs))

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Finished outputs in prompt order, each with its ``n`` sequences (sequence i
        sampled with seed + i). Bad input raises ValueError before any work; an
        exception while running (Ctrl-C included) aborts this call's requests, so
        none is left in the engine to run before the next call's."""
        prompts = _prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(
                    f"{len(params)} sampling params for {len(prompts)} prompts"
                )
        engine = self.engine
        groups = [[engine.make_request(_prompt(p), one) for one in checked_params(sp).fan_out()]
                  for p, sp in zip(prompts, params)]
        for p, group in zip(prompts, groups):
            if isinstance(p, dict) and isinstance(p.get("prompt"), str):
                for r in group:  # ids with their text: RequestOutput.prompt keeps the text
                    r.prompt = p["prompt"]
        reqs = [r for group in groups for r in group]
        done: dict[str, RequestOutput] = {}
        bar = _progress(len(reqs)) if use_tqdm else None
        try:
            for r in reqs:
                engine.add_request(r)
            while len(done) < len(reqs) and engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            for r in reqs:  # a finished or never-added id is a no-op
                engine.abort_request(r.request_id)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [_merged([done[r.request_id] for r in group]) for group in groups]

    def chat(
        self,
        messages: Sequence[dict] | Sequence[Sequence[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template, then generate (one conversation or many).
        The options are vLLM's: extra template variables (``enable_thinking``, ...),
        no new assistant turn, the last message left open to go on with, and tools
        for a template that renders them."""
        if self.engine.tokenizer is None:
            raise ValueError("chat needs a tokenizer")
        if not messages:
            raise ValueError("no messages given")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message goes with add_generation_prompt=False "
                             "(the last message is continued, not answered)")
        convs = [messages] if isinstance(messages[0], dict) else list(messages)
        prompts = [self.engine.tokenizer.apply_chat_template(
            list(c), add_generation_prompt, tools, continue_final_message, chat_template_kwargs)
            for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm)


def _merged(outs: list[RequestOutput]) -> RequestOutput:
    """One prompt's sequences as one output, vLLM's shape: ``outputs[i]`` is
    sequence i; the first sequence's id and metrics."""
    if len(outs) == 1:
        return outs[0]
    first = outs[0]
    seqs = [dataclasses.replace(o.outputs[0], index=i) for i, o in enumerate(outs)]
    return dataclasses.replace(first, outputs=seqs)


def _progress(total: int):
    """A tqdm bar of finished requests (tqdm comes with transformers)."""
    from tqdm import tqdm

    return tqdm(total=total, desc="requests", unit="req")
