"""Prompts of a given token length, counted with the target server's own tokenizer.

A benchmark that asks for "1,024-token prompts" must count tokens the way the
server does, or the input lengths (and so the prefill numbers) are off by
whatever the two tokenizers disagree on. So prompts are built with, in order
of preference:

* the server's ``/tokenize`` and ``/detokenize`` (tandem, vLLM and
  llama-server all have them; both request/response shapes are understood);
* a local tokenizer (``--tokenizer``: an HF directory or a GGUF file; else
  tandem's embedded default model's, with a warning that counts are then
  approximate for other models);
* no tokenizer at all (``--skip-tokenizer-init``): prompts are random token
  ids, for servers started with ``--load-format dummy --skip-tokenizer-init``.

Each prompt is fresh random English words, so no two prompts share a prefix
the server could cache by accident.
"""

from __future__ import annotations

import logging
import math
from typing import Protocol

import httpx
import numpy as np

logger = logging.getLogger("tandem.tools.bench")

# Common English words: tokenizers split them into ~1-1.5 tokens each, like prose.
WORDS = (
    "the of and to in is was for that on as with by he at from his an were are which this "
    "be or has had not first one their its new after who they have her she two been other "
    "when there all during into school time may years more most only over city some world "
    "would where later up such used many can state about national out known university "
    "united then made team american group early three game film also between both under "
    "river water light house music history system night number people season series small "
    "large great long high old local public family water market book road field north "
    "south east west power young church story member place party company country second "
    "design model general support death part point program building design center line "
    "report area work life war army air sea land free open press plan study play form "
    "force name court early half human period paper order level value music region award "
    "art album song role cause hand head heart mind king queen page poem quiet reason "
    "signal simple summer winter spring autumn table train travel union voice window"
).split()


class TextTokenizer(Protocol):
    """What the prompt builder needs: token ids for text, and text for token ids."""

    source: str

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ServerTokenizer:
    """The target's ``/tokenize`` + ``/detokenize``: vLLM's (and tandem's) body shapes, or
    llama-server's (``content`` in, ``content`` out)."""

    def __init__(self, client: httpx.Client, base_url: str, model: str,
                 llama: bool = False) -> None:
        self.client = client
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.llama = llama
        self.source = f"{self.base_url}/tokenize"

    def encode(self, text: str) -> list[int]:
        body = ({"content": text, "add_special": False} if self.llama else
                {"model": self.model, "prompt": text, "add_special_tokens": False})
        r = self.client.post(f"{self.base_url}/tokenize", json=body)
        r.raise_for_status()
        return list(r.json()["tokens"])

    def decode(self, ids: list[int]) -> str:
        body = {"tokens": ids} if self.llama else {"model": self.model, "tokens": ids}
        r = self.client.post(f"{self.base_url}/detokenize", json=body)
        r.raise_for_status()
        return r.json()["content" if self.llama else "prompt"]

    @classmethod
    def probe(cls, client: httpx.Client, base_url: str, model: str) -> ServerTokenizer | None:
        """The server's tokenizer if either shape round-trips, else None."""
        for llama in (False, True):
            tok = cls(client, base_url, model, llama)
            try:
                ids = tok.encode("hello world")
                text = tok.decode(ids)
            except (httpx.HTTPError, ValueError, KeyError, TypeError):
                continue
            if ids and isinstance(text, str):
                return tok
        return None


class LocalTokenizer:
    """A tokenizer loaded here: an HF model directory, a GGUF file, or tandem's default."""

    def __init__(self, path: str | None = None) -> None:
        from tandem.model.gguf import gguf_to_hf_dir
        from tandem.paths import default_model_path
        from tandem.tokenizer import Tokenizer

        src = path or str(default_model_path())
        directory = gguf_to_hf_dir(src) if src.endswith(".gguf") else src
        self._tok = Tokenizer.from_dir(directory)
        self.source = f"local tokenizer ({src})"

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


class PromptBuilder:
    """Random prompts of an exact token count (text), or random token ids (no tokenizer)."""

    def __init__(self, tokenizer: TextTokenizer | None, rng: np.random.Generator,
                 vocab_size: int = 100) -> None:
        if tokenizer is None and vocab_size < 2:
            raise ValueError(f"--vocab-size must be at least 2, got {vocab_size}")
        self.tokenizer = tokenizer
        self.rng = rng
        self.vocab_size = vocab_size

    @property
    def token_ids(self) -> bool:
        """True when prompts are token-id lists (completions API only)."""
        return self.tokenizer is None

    def ids(self, n: int) -> list[int]:
        """``n`` random token ids in [1, vocab_size) (0 is often a special token)."""
        return self.rng.integers(1, self.vocab_size, size=n).tolist()

    def text(self, n: int) -> str:
        """Text that the tokenizer reads back as (about) ``n`` tokens.

        Random words are encoded, cut at ``n`` tokens and decoded; re-encoding
        the decoded text can differ by a token at the cut, which the server's
        reported usage corrects afterwards (as vLLM's random dataset does).
        """
        if self.tokenizer is None:
            raise ValueError("text prompts need a tokenizer (drop --skip-tokenizer-init)")
        if n < 1:
            raise ValueError(f"a prompt needs at least 1 token, got {n}")
        words = max(8, math.ceil(n * 1.1) + 4)
        ids: list[int] = []
        while len(ids) < n:
            picked = self.rng.choice(len(WORDS), size=words)
            ids = self.tokenizer.encode(" ".join(WORDS[i] for i in picked))
            words *= 2
        return self.tokenizer.decode(ids[:n])


def choose_tokenizer(client: httpx.Client, base_url: str, model: str, path: str | None,
                     skip: bool) -> TextTokenizer | None:
    """Server's tokenizer, else a local one (see the module docstring); None when skipped."""
    if skip:
        return None
    if path:
        return LocalTokenizer(path)
    tok = ServerTokenizer.probe(client, base_url, model)
    if tok is not None:
        return tok
    try:
        local = LocalTokenizer(None)
    except ValueError as e:
        raise ValueError(f"{base_url} has no /tokenize and tandem's default tokenizer is not "
                         f"available ({e}); pass --tokenizer PATH, or --skip-tokenizer-init"
                         ) from None
    logger.warning("%s has no /tokenize: counting prompt tokens with tandem's default "
                   "tokenizer (approximate for other models; pass --tokenizer)", base_url)
    return local
