"""ServerState: what every handler needs, built once per app."""

from __future__ import annotations

import itertools
import secrets
from dataclasses import dataclass, field

from tandem.engine.async_engine import AsyncEngine
from tandem.server.admission import Admission
from tandem.server.errors import APIError
from tandem.server.metrics import ServerMetrics
from tandem.server.model_card import ModelCard
from tandem.tokenizer import Tokenizer


@dataclass
class ServerState:
    engine: AsyncEngine
    card: ModelCard
    admission: Admission
    metrics: ServerMetrics
    api_key: str | None = None
    max_body_bytes: int = 16 * 2**20
    _ids: itertools.count = field(default_factory=itertools.count)
    _salt: str = field(default_factory=lambda: secrets.token_hex(4))

    @property
    def tokenizer(self) -> Tokenizer:
        """The tokenizer, or a 400 for text requests to a tokenizer-less (dummy) model."""
        tok = self.engine.engine.tokenizer
        if tok is None:
            raise APIError(400, "this model was loaded without a tokenizer: send token ids")
        return tok

    @property
    def has_tokenizer(self) -> bool:
        return self.engine.engine.tokenizer is not None

    def new_id(self, prefix: str) -> str:
        """Unique within this process (the engine requires it), short, readable in logs."""
        return f"{prefix}-{self._salt}{next(self._ids):x}"

    def check_model(self, requested: str | None, ollama: bool = False) -> None:
        if not self.card.matches(requested, ollama=ollama):
            raise APIError(
                404, f"The model `{requested}` does not exist; this server serves "
                f"{', '.join(repr(n) for n in self.card.names)}.",
                param="model", code="model_not_found",
                ollama_message=f"model '{requested}' not found",
            )
