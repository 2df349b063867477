"""ServerState: what every handler needs, built once per app."""

from __future__ import annotations

import asyncio
import itertools
import json
import secrets
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, TypeVar

from starlette.requests import Request

from tandem.engine.client import EngineClient
from tandem.entrypoints.server.admission import Admission
from tandem.entrypoints.server.defaults import SamplingDefaults
from tandem.entrypoints.server.errors import APIError
from tandem.entrypoints.server.metrics import ServerMetrics
from tandem.entrypoints.server.model_card import ModelCard
from tandem.entrypoints.server.protocol import B, parse_body, read_json
from tandem.entrypoints.server.reasoning import ReasoningParser, prompt_position
from tandem.tokenizer import Tokenizer, check_template_kwargs

if TYPE_CHECKING:
    from tandem.entrypoints.server.structured import Constraint

T = TypeVar("T")
MAX_N = 128  # OpenAI's bound on n
# Tokenizer threads: a long prompt is tokenized beside short ones, not before them.
TOKENIZER_THREADS = 2
# Prompt tokens decoded to see whether the template left a think block open.
PROMPT_TAIL_TOKENS = 16


@dataclass
class ServerState:
    engine: EngineClient
    card: ModelCard
    admission: Admission
    metrics: ServerMetrics
    api_key: str | None = None
    max_body_bytes: int = 16 * 2**20
    defaults: SamplingDefaults = field(default_factory=SamplingDefaults)
    reasoning: bool = False  # think blocks leave the answer (--reasoning-parser)
    _ids: itertools.count = field(default_factory=itertools.count)
    _salt: str = field(default_factory=lambda: secrets.token_hex(4))
    _pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(
        TOKENIZER_THREADS, thread_name_prefix="tandem-tokenize"))

    @property
    def tokenizer(self) -> Tokenizer:
        """The tokenizer, or a 400 for text requests to a tokenizer-less (dummy) model."""
        tok = self.engine.tokenizer
        if tok is None:
            raise APIError(400, "this model was loaded without a tokenizer: send token ids")
        return tok

    @property
    def has_tokenizer(self) -> bool:
        return self.engine.tokenizer is not None

    def reasoning_for(self, prompt_ids: list[int], constraint: Constraint | None
                      ) -> tuple[ReasoningParser | None, Constraint | None]:
        """A chat output's reasoning parser (None when this server parses none) and its
        constraint, whose grammar waits for a think block to end; both follow where
        the prompt leaves the output (see tandem.entrypoints.server.reasoning)."""
        if not self.reasoning or not self.has_tokenizer:
            return None, constraint
        tail = self.tokenizer.decode(prompt_ids[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
        position = prompt_position(tail)
        if constraint is not None and position != "closed":
            constraint = replace(constraint, params=replace(constraint.params,
                                                            reasoning=position))
        return ReasoningParser.for_prompt(tail), constraint

    def new_id(self, prefix: str) -> str:
        """Unique within this process (the engine requires it), short, readable in logs;
        ``prefix`` with its separator, as each API writes its ids (``chatcmpl-``, ``resp_``)."""
        return f"{prefix}{self._salt}{next(self._ids):x}"

    def check_model(self, requested: str | None) -> None:
        if not self.card.matches(requested):
            raise APIError(
                404, f"The model `{requested}` does not exist; this server serves "
                f"{', '.join(repr(n) for n in self.card.names)}.",
                param="model", code="model_not_found",
                ollama_message=f"model '{requested}' not found",
            )

    # ------------------------------------------------ the work one request may cause
    async def read(self, request: Request, model: type[B], max_items: int | None = None) -> B:
        """The request's body as ``model``: its size bounded, and its lists to
        ``max_items`` (default: the context window, or 128 prompts) before validation."""
        body = await read_json(request, self.max_body_bytes)
        return parse_body(model, body, max_items or max(self.card.max_model_len, MAX_N))

    async def off_loop(self, fn: Callable[..., T], *args) -> T:
        """fn(*args) in a tokenizer thread, so tokenizing and templating a long prompt
        never stalls the event loop (every stream, /health); tandem.tokenizer releases
        the GIL while it encodes and decodes."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    @property
    def max_fan_out(self) -> int:
        """Engine requests one API request may start (n x prompts): what an idle server
        admits at once (--max-num-seqs + --max-queue), and at most OpenAI's 128."""
        return min(MAX_N, self.admission.max_num_seqs + self.admission.max_queue)

    def check_fan_out(self, n: int, prompts: int = 1) -> None:
        if not isinstance(n, int) or n < 1:
            return  # SamplingParams names the field
        if n * prompts > self.max_fan_out:
            what = f"n ({n})" if prompts == 1 else f"n x prompts ({n} x {prompts})"
            raise APIError(
                400, f"{what} must be at most {self.max_fan_out}: one request may start "
                f"--max-num-seqs + --max-queue = {self.admission.max_num_seqs} + "
                f"{self.admission.max_queue} generations, never more than {MAX_N}",
                param="n")

    @property
    def max_text_chars(self) -> int:
        """The most characters of text one request may have tokenized: more than
        max_model_len tokens' worth can never fit, so it is refused before the work."""
        return self.card.max_model_len * self.tokenizer.max_chars_per_token

    def _check_text(self, chars: int, param: str) -> None:
        if chars > self.max_text_chars:
            raise APIError(
                400, f"{param} has {chars} characters: more than fit in this model's "
                f"{self.card.max_model_len}-token context ({self.max_text_chars} characters "
                "at most), so it was not tokenized", param=param)

    async def encode(self, texts: list[str], param: str, add_special_tokens: bool = True
                     ) -> list[list[int]]:
        """Token ids of each text: bounded, then encoded off the event loop."""
        tok = self.tokenizer
        self._check_text(sum(len(t) for t in texts), param)
        return await self.off_loop(lambda: [tok.encode(t, add_special_tokens) for t in texts])

    def chat_fits(self, messages: list[dict], tools: list[dict] | None = None,
                  template_kwargs: dict[str, Any] | None = None) -> bool:
        """Whether chat_ids would template the chat: its text is within the bound."""
        return self.chat_chars(messages, tools, template_kwargs) <= self.max_text_chars

    @staticmethod
    def chat_chars(messages: list[dict], tools: list[dict] | None = None,
                   template_kwargs: dict[str, Any] | None = None) -> int:
        chars = sum(len(m["content"]) + len(m.get("reasoning_content") or "")
                    + len(json.dumps(m.get("tool_calls") or "")) for m in messages)
        return chars + len(json.dumps(tools or "")) + len(json.dumps(template_kwargs or ""))

    async def chat_ids(self, messages: list[dict], add_generation_prompt: bool = True,
                       tools: list[dict] | None = None, continue_final: bool = False,
                       template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """Both APIs' chat prompt: bounded (more characters than the context holds are
        refused first), then templated and encoded off the event loop."""
        tok = self.tokenizer
        self._check_text(self.chat_chars(messages, tools, template_kwargs), "messages")
        try:
            check_template_kwargs(template_kwargs)
        except ValueError as e:
            raise APIError(400, str(e), param="chat_template_kwargs") from None
        try:
            return await self.off_loop(tok.apply_chat_template, messages, add_generation_prompt,
                                       tools, continue_final, template_kwargs)
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None
