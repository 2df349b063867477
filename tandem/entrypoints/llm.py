"""Offline API: ``LLM(model=...).generate(prompts, SamplingParams)``, like vLLM's."""

from __future__ import annotations

from collections.abc import Sequence

from tandem.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.outputs import RequestOutput
from tandem.sampling_params import SamplingParams

Prompt = str | Sequence[int]


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
    ) -> list[RequestOutput]:
        """Finished outputs in prompt order. Bad input raises ValueError before any work."""
        if isinstance(prompts, str) or (
            isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        if not prompts:
            raise ValueError("no prompts given")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(
                    f"{len(params)} sampling params for {len(prompts)} prompts"
                )
        engine = self.engine
        reqs = [engine.make_request(p, sp) for p, sp in zip(prompts, params)]
        for r in reqs:
            engine.add_request(r)
        done: dict[str, RequestOutput] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[r.request_id] for r in reqs]

    def chat(
        self,
        messages: Sequence[dict] | Sequence[Sequence[dict]],
        sampling_params: SamplingParams | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template, then generate (one conversation or many)."""
        if self.engine.tokenizer is None:
            raise ValueError("chat needs a tokenizer")
        if not messages:
            raise ValueError("no messages given")
        convs = [messages] if isinstance(messages[0], dict) else list(messages)
        prompts = [self.engine.tokenizer.apply_chat_template(list(c)) for c in convs]
        return self.generate(prompts, sampling_params)
