"""InputProcessor: a prompt and its sampling params -> a Request, validated.

It touches no engine state, so any thread may call it: callers tokenize, and
compile a grammar, before handing the request to the engine thread, and bad
input is an error there, before anything is queued.
"""

from __future__ import annotations

import itertools
import numbers
from collections.abc import Sequence

import torch

from tandem.core.detokenizer import IncrementalDetokenizer
from tandem.core.request import Request
from tandem.sampling_params import SamplingParams, checked_params
from tandem.tokenizer import Tokenizer
from tandem.worker.structured_output import StructuredOutputManager


class InputProcessor:
    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, max_model_len: int,
                 device: torch.device, structured_output: StructuredOutputManager | None) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.device = device  # of seeded requests' generators
        self.structured_output = structured_output
        self._ids = itertools.count()

    def make_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
    ) -> Request:
        """The request of a prompt (text or token ids) and its sampling params;
        ValueError for what no engine could run."""
        params = checked_params(params)
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty")
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer; pass token ids")
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (bytes, bytearray)) or not isinstance(prompt, Sequence):
            raise ValueError(f"a prompt is text or a list of token ids, got "
                             f"{type(prompt).__name__}")
        else:
            if any(not isinstance(t, numbers.Integral) or isinstance(t, bool) for t in prompt):
                raise ValueError("prompt token ids must be integers")
            ids = [int(t) for t in prompt]  # numpy's integers too
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(
                    f"prompt token id {bad[0]} is outside the vocabulary "
                    f"[0, {self.vocab_size})"
                )
        if not ids:
            raise ValueError("the prompt is empty")
        if params.n != 1:  # LLM.generate and the server fan out (SamplingParams.fan_out)
            raise ValueError("an engine request is one sequence (n=1): fan n out with "
                             "SamplingParams.fan_out()")
        room = self.max_model_len - len(ids)
        max_tokens = room if params.max_tokens is None else params.max_tokens
        if max_tokens > room or (room < 1 and params.max_tokens != 0):  # 0: the prompt alone
            want = 0 if params.max_tokens == 0 else max(max_tokens, 1)
            raise ValueError(
                f"this model's maximum context length is {self.max_model_len} tokens, but "
                f"{len(ids) + want} were requested ({len(ids)} in the prompt, "
                f"{want} for the completion); shorten the prompt or lower max_tokens"
            )
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(
                self.tokenizer.backend,
                stop=params.stop,
                include_stop_str_in_output=params.include_stop_str_in_output,
                skip_special_tokens=params.skip_special_tokens,
                prompt_token_ids=ids,
                min_tokens=params.min_tokens,
            )
        elif params.stop:
            raise ValueError("stop strings need a tokenizer")
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        grammar = None
        if params.structured_outputs is not None:
            if self.structured_output is None:
                raise ValueError("structured_outputs need the model's tokenizer (the engine "
                                 "was started with skip_tokenizer_init)")
            grammar = self.structured_output.new_request(params.structured_outputs)
        req = Request(rid, ids, params, max_tokens, generator, detok, arrival_time)
        req.structured_output_request = grammar
        req.prompt = prompt if isinstance(prompt, str) else None
        return req
