"""The model's tokenizer and chat template, loaded from an HF model directory.

A thin wrapper over transformers' fast tokenizer: the engine needs a handful
of operations with plain ``list[int]`` results and ValueErrors for user
mistakes, not the whole PreTrainedTokenizer surface. GGUF files reach here via
``tandem.model.gguf.gguf_to_hf_dir``, which saves the tokenizer in this layout.

Encoding and decoding go through the Rust tokenizer's batch calls, which
release the GIL (the single-text ones hold it: 0.8 s for a 1.3 MB prompt), so
the server can run them in a thread while its event loop keeps serving.
"""

from __future__ import annotations

import inspect
import json
import os
from functools import cache, cached_property
from pathlib import Path
from typing import Any

from jinja2 import TemplateError


@cache
def _template_args() -> frozenset[str]:
    """The named arguments of transformers' template calls (apply_chat_template and the
    renderer it passes its extra keywords on with): read from their signatures, so a
    version that adds one (``sanitize_control_tokens``, ``conversations``) is covered."""
    from transformers import PreTrainedTokenizerFast
    from transformers.utils import chat_template_utils

    names = {"messages"}
    for fn in (PreTrainedTokenizerFast.apply_chat_template,
               getattr(chat_template_utils, "render_jinja_template", None)):
        if fn is not None:
            names |= {p.name for p in inspect.signature(fn).parameters.values()
                      if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and p.name != "self"}
    return frozenset(names)


def check_template_kwargs(template_kwargs: dict[str, Any] | None) -> None:
    """ValueError if chat_template_kwargs would set one of the template call's own arguments."""
    if not template_kwargs:
        return
    reserved = sorted(template_kwargs.keys() & _template_args())
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(reserved)}: the "
                         "request's own fields do")


class Tokenizer:
    """encode / decode / chat template for one model; ``backend`` is the raw Rust tokenizer."""

    def __init__(self, hf_tokenizer, generation_eos: list[int] | None = None):
        self._hf = hf_tokenizer
        self.backend = hf_tokenizer.backend_tokenizer  # tokenizers.Tokenizer (DecodeStream)
        self.eos_token_id: int | None = hf_tokenizer.eos_token_id
        self.bos_token_id: int | None = hf_tokenizer.bos_token_id
        # Token count the tokenizer can emit; the model's embedding may be larger (padded).
        self.vocab_size: int = len(hf_tokenizer)
        self.all_special_ids: list[int] = list(hf_tokenizer.all_special_ids)
        stops = [self.eos_token_id] if self.eos_token_id is not None else []
        stops += [i for i in generation_eos or [] if i not in stops]
        self.stop_token_ids: list[int] = stops

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> Tokenizer:
        """Load tokenizer files (and generation_config.json's eos ids, if any) from
        ``path``: a model directory, or a config.json in one (--load-format dummy)."""
        path = Path(path)
        if path.is_file():
            path = path.parent
        if not any((path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
            raise ValueError(f"{path} has no tokenizer.json or tokenizer_config.json (the "
                             "model's tokenizer files belong beside its config.json)")
        # A tokenizer without a model-specific class (what transformers writes for a
        # GGUF's vocabulary) loads as that class directly. AutoTokenizer first looks
        # through transformers' model modules: the default model's took 1.51 s that
        # way, 0.28 s this way.
        if _tokenizer_class(path / "tokenizer_config.json") in _GENERIC_CLASSES:
            from transformers import PreTrainedTokenizerFast as loader
        else:
            from transformers import AutoTokenizer as loader
        try:
            hf = loader.from_pretrained(str(path))
        except Exception as e:
            raise ValueError(f"cannot load the tokenizer from {path}: {e}") from e
        if not getattr(hf, "is_fast", False):
            raise ValueError(f"{path}: need a fast (tokenizers-backed) tokenizer, got {type(hf)}")
        return cls(hf, _generation_eos(path / "generation_config.json"))

    @property
    def chat_template(self) -> str | None:
        template = self._hf.chat_template
        return template if isinstance(template, str) else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"text to encode must be a str, got {type(text).__name__}")
        try:
            enc = self.backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)
        except TypeError:  # what tokenizers raises for a str that is not valid UTF-8
            raise ValueError("the text is not valid Unicode (a lone surrogate?)") from None
        return enc[0].ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.backend.decode_batch([list(ids)], skip_special_tokens=skip_special_tokens)[0]

    def token_bytes(self, tid: int, text: str | None = None) -> bytes:
        """The bytes token ``tid`` stands for: its text's UTF-8 where that is whole,
        else (the token holds part of a character: its text is U+FFFD) its vocabulary
        entry's own bytes, byte-level BPE's character per byte or SentencePiece's
        ``<0xNN>``, so the parts of a character that several tokens share join up.
        ``text``: the token's decoded text, when the caller has it already."""
        if text is None:
            text = self.decode([tid], skip_special_tokens=False)
        piece = self.backend.id_to_token(tid) if "\ufffd" in text else None
        if piece is None:
            return text.encode()
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        if all(c in _BYTE_OF_CHAR for c in piece):
            return bytes(_BYTE_OF_CHAR[c] for c in piece)
        return text.encode()

    @cached_property
    def max_chars_per_token(self) -> int:
        """An upper bound on the characters of text one token stands for.

        The longest vocabulary entry (a byte-level entry has a character per byte,
        so it bounds the text's characters too), times 4 if a normalizer may
        compose characters before the split (NFC turns up to 4 code points into 1).
        """
        longest = max(len(t) for t in self.backend.get_vocab(with_added_tokens=True))
        return longest * (1 if self.backend.normalizer is None else 4)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None, continue_final: bool = False,
                    template_kwargs: dict[str, Any] | None = None) -> str:
        """The chat template applied to ``messages`` (and ``tools``, OpenAI's shape), as
        text; ``continue_final``: the last message left open, for the model to go on with;
        ``template_kwargs``: more variables for the template (Qwen3's ``enable_thinking``)."""
        if not self._hf.chat_template:
            raise ValueError("this model has no chat template; send a plain prompt instead")
        _check_messages(messages)
        check_template_kwargs(template_kwargs)
        try:
            return self._hf.apply_chat_template(
                messages, tools=tools, tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final, **(template_kwargs or {}),
            )
        except (TemplateError, ValueError) as e:  # "roles must alternate user/assistant";
            # a final message the template does not write as given cannot be continued
            raise ValueError(f"chat template rejected the messages: {e}") from e

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True,
        tools: list[dict] | None = None, continue_final: bool = False,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """Prompt token ids for a chat; the template writes its own special tokens (bos too)."""
        text = self.render_chat(messages, add_generation_prompt, tools, continue_final,
                                template_kwargs)
        return self.encode(text, add_special_tokens=False)


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's vocabulary alphabet (GPT-2's): printable bytes stand for
    themselves, the other 68 for the characters from U+0100 on, in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    moved = [b for b in range(256) if b not in kept]
    return {**{chr(b): b for b in kept}, **{chr(256 + i): b for i, b in enumerate(moved)}}


_BYTE_OF_CHAR = _byte_level_alphabet()


def _check_messages(messages) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}] must be an object, got {type(m).__name__}")
        if not isinstance(m.get("role"), str) or not m["role"]:
            raise ValueError(f"messages[{i}].role must be a non-empty string")
        if not isinstance(m.get("content"), str):
            raise ValueError(f"messages[{i}].content must be a string")


# tokenizer_config.json classes that add nothing to the tokenizers.Tokenizer in
# tokenizer.json (TokenizersBackend is transformers 5's name for the second).
_GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _json_value(path: Path, key: str):
    """``key`` of the JSON object in ``path``; None if absent or unreadable."""
    try:
        return json.loads(path.read_text()).get(key)
    except (OSError, ValueError, AttributeError):
        return None


def _tokenizer_class(path: Path) -> str | None:
    """tokenizer_config.json's tokenizer_class; None if absent or unreadable."""
    value = _json_value(path, "tokenizer_class")
    return value if isinstance(value, str) else None


def _generation_eos(path: Path) -> list[int]:
    """eos_token_id (int or list) from generation_config.json; [] if absent or unreadable."""
    value = _json_value(path, "eos_token_id")
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [i for i in value if isinstance(i, int)]
    return []
