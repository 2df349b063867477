"""What the benchmark sends: ``random``, ``shared-prefix``, ``chat`` and ``file`` workloads.

* ``random`` (vLLM's): input/output lengths drawn uniformly from
  ``[len * (1 - r), len * (1 + r)]`` with ``--random-range-ratio`` r, every
  prompt fresh text; an optional common ``--random-prefix-len``.
* ``shared-prefix``: one long system prompt + short varied questions — the
  case automatic prefix caching exists for (RAG preambles, agents' tool docs).
* ``chat``: multi-turn conversations whose turn lengths come from
  ``data/chat_lengths.json`` (synthetic, ShareGPT-like; see
  ``benchmarks/make_chat_lengths.py``). Turn k of a conversation repeats the
  exact text of turns 0..k-1, so history reuse is as real as in a chat UI.
* ``file``: a JSONL file, one request per line: ``{"prompt": "..."}`` or
  ``{"messages": [...]}`` or ``{"input_len": N}``, with an optional
  ``"output_len"`` (``"output_tokens"``/``"max_tokens"`` also read).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from tandem.tools.bench.tokens import PromptBuilder

DATASETS = ("random", "shared-prefix", "chat", "file")
CHAT_DATA = "chat_lengths.json"


@dataclass
class SampleRequest:
    """One request to send; ``messages`` is the chat form of ``prompt`` when it has one."""

    prompt: str | list[int]
    prompt_len: int
    expected_output_len: int
    messages: list[dict[str, str]] | None = None

    def chat_messages(self) -> list[dict[str, str]]:
        if self.messages is not None:
            return self.messages
        if not isinstance(self.prompt, str):
            raise ValueError("token-id prompts cannot be sent to a chat endpoint")
        return [{"role": "user", "content": self.prompt}]


@dataclass
class DatasetArgs:
    """The dataset flags (vLLM's names where vLLM has them)."""

    name: str = "random"
    path: str | None = None
    random_input_len: int = 1024
    random_output_len: int = 128
    random_range_ratio: float = 0.0
    random_prefix_len: int = 0
    shared_prefix_len: int = 1024
    shared_prefix_num_prefixes: int = 1
    shared_prefix_question_len: int = 32
    output_len: int | None = None  # overrides every dataset's output length
    max_model_len: int | None = None  # the server's window, when it says


def sample_requests(args: DatasetArgs, builder: PromptBuilder, n: int) -> list[SampleRequest]:
    """``n`` requests of the chosen workload (ValueError on bad settings)."""
    if n < 1:
        raise ValueError(f"--num-prompts must be positive, got {n}")
    if args.output_len is not None and args.output_len < 1:
        raise ValueError(f"--output-len must be positive, got {args.output_len}")
    if args.name == "random":
        out = _random(args, builder, n)
    elif args.name == "shared-prefix":
        out = _shared_prefix(args, builder, n)
    elif args.name == "chat":
        out = _chat(args, builder, n)
    elif args.name == "file":
        out = _file(args, builder, n)
    else:
        raise ValueError(f"--dataset-name {args.name!r}: choose from {', '.join(DATASETS)}")
    _check_window(out, args.max_model_len)
    return out


def _prompt(builder: PromptBuilder, n: int) -> str | list[int]:
    return builder.ids(n) if builder.token_ids else builder.text(n)


def _join(a: str | list[int], b: str | list[int]) -> str | list[int]:
    if isinstance(a, list) and isinstance(b, list):
        return a + b
    return f"{a} {b}"  # a word boundary, so the prefix's last word stays itself


def _uniform(rng: np.random.Generator, mean: int, ratio: float, n: int, low: int) -> np.ndarray:
    lo = max(low, int(np.floor(mean * (1 - ratio))))
    hi = max(lo, int(np.ceil(mean * (1 + ratio))))
    return rng.integers(lo, hi + 1, size=n)


def _random(args: DatasetArgs, builder: PromptBuilder, n: int) -> list[SampleRequest]:
    if not 0.0 <= args.random_range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {args.random_range_ratio}")
    if args.random_input_len < 1 or args.random_output_len < 1 or args.random_prefix_len < 0:
        raise ValueError("--random-input-len and --random-output-len must be positive, "
                         "--random-prefix-len >= 0")
    rng = builder.rng
    inputs = _uniform(rng, args.random_input_len, args.random_range_ratio, n, 1)
    outputs = _uniform(rng, args.output_len or args.random_output_len, args.random_range_ratio,
                       n, 1)
    prefix = _prompt(builder, args.random_prefix_len) if args.random_prefix_len else None
    samples = []
    for i in range(n):
        body = _prompt(builder, int(inputs[i]))
        prompt = _join(prefix, body) if prefix is not None else body
        samples.append(SampleRequest(prompt, args.random_prefix_len + int(inputs[i]),
                                     int(outputs[i])))
    return samples


def _shared_prefix(args: DatasetArgs, builder: PromptBuilder, n: int) -> list[SampleRequest]:
    k = args.shared_prefix_num_prefixes
    if k < 1 or args.shared_prefix_len < 1 or args.shared_prefix_question_len < 1:
        raise ValueError("--shared-prefix-len, --shared-prefix-question-len and "
                         "--shared-prefix-num-prefixes must be positive")
    systems = [_prompt(builder, args.shared_prefix_len) for _ in range(k)]
    out_len = args.output_len or args.random_output_len
    samples = []
    for i in range(n):
        system = systems[i % k]
        question = _prompt(builder, args.shared_prefix_question_len)
        prompt_len = args.shared_prefix_len + args.shared_prefix_question_len
        if builder.token_ids:
            samples.append(SampleRequest(_join(system, question), prompt_len, out_len))
            continue
        prompt = f"{system}\n\nQuestion: {question}\nAnswer:"
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        samples.append(SampleRequest(prompt, prompt_len, out_len, messages))
    return samples


def load_chat_lengths() -> list[list[tuple[int, int]]]:
    """The shipped conversations: lists of (user tokens, assistant tokens) per turn."""
    text = resources.files("tandem.tools.bench").joinpath("data", CHAT_DATA).read_text()
    return [[(int(u), int(a)) for u, a in conv] for conv in json.loads(text)["conversations"]]


def _chat(args: DatasetArgs, builder: PromptBuilder, n: int) -> list[SampleRequest]:
    """Turns in conversation order; a turn that would not fit the window drops old turns."""
    if builder.token_ids:
        raise ValueError("the chat dataset needs a tokenizer (drop --skip-tokenizer-init)")
    convs = load_chat_lengths()
    order = builder.rng.permutation(len(convs))
    window = args.max_model_len or 4096
    samples: list[SampleRequest] = []
    while len(samples) < n:
        for c in order:
            history: list[tuple[dict[str, str], int]] = []
            for user_len, assistant_len in convs[c]:
                user_len = min(user_len, window // 4)  # a quarter each: any turn fits
                assistant_len = min(assistant_len, window // 4)
                out_len = args.output_len or assistant_len
                history.append(({"role": "user", "content": builder.text(user_len)}, user_len))
                while len(history) > 1 and sum(t for _, t in history) + out_len > window - 64:
                    history = history[2:]  # forget the oldest user/assistant pair
                msgs = [m for m, _ in history]
                prompt = "".join(f"{m['role'].capitalize()}: {m['content']}\n" for m in msgs)
                samples.append(SampleRequest(prompt + "Assistant:", sum(t for _, t in history),
                                             out_len, msgs))
                if len(samples) == n:
                    return samples
                history.append(({"role": "assistant", "content": builder.text(assistant_len)},
                                assistant_len))
    return samples


def _file(args: DatasetArgs, builder: PromptBuilder, n: int) -> list[SampleRequest]:
    if not args.path:
        raise ValueError("--dataset-name file needs --dataset-path FILE.jsonl")
    path = Path(args.path)
    if not path.is_file():
        raise ValueError(f"--dataset-path {path}: no such file")
    rows = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(_file_row(json.loads(line), args, builder))
            except (json.JSONDecodeError, ValueError, TypeError, KeyError) as e:
                raise ValueError(f"{path}:{lineno}: {e}") from None
    if not rows:
        raise ValueError(f"{path} has no requests")
    return [rows[i % len(rows)] for i in range(n)]  # cycle when asked for more than the file


def _file_row(row: Any, args: DatasetArgs, builder: PromptBuilder) -> SampleRequest:
    if not isinstance(row, dict):
        raise ValueError("each line must be a JSON object")
    out = args.output_len or next(
        (int(row[k]) for k in ("output_len", "output_tokens", "max_tokens") if k in row),
        args.random_output_len)
    if out < 1:
        raise ValueError(f"output length must be positive, got {out}")
    tok = builder.tokenizer
    if "messages" in row:
        msgs = [{"role": str(m["role"]), "content": str(m["content"])} for m in row["messages"]]
        prompt = "".join(f"{m['role'].capitalize()}: {m['content']}\n" for m in msgs)
        count = len(tok.encode(prompt)) if tok is not None else 0
        return SampleRequest(prompt + "Assistant:", count, out, msgs)
    if "prompt" in row:
        prompt = row["prompt"]
        if isinstance(prompt, list):
            return SampleRequest([int(t) for t in prompt], len(prompt), out)
        count = len(tok.encode(str(prompt))) if tok is not None else 0
        return SampleRequest(str(prompt), count, out)
    if "input_len" in row:
        n_in = int(row["input_len"])
        return SampleRequest(_prompt(builder, n_in), n_in, out)
    raise ValueError('a line needs "prompt", "messages" or "input_len"')


def _check_window(samples: list[SampleRequest], max_model_len: int | None) -> None:
    """Fail before sending anything when requests cannot fit the server's context window."""
    if not max_model_len:
        return
    too_long = [s for s in samples if s.prompt_len + s.expected_output_len > max_model_len]
    if too_long:
        s = too_long[0]
        raise ValueError(
            f"{len(too_long)} of {len(samples)} requests do not fit the server's context "
            f"window of {max_model_len} tokens (e.g. {s.prompt_len} prompt + "
            f"{s.expected_output_len} output); use shorter lengths")
