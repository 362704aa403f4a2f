"""OpenAI's Embeddings (``/v1/embeddings``): never streamed, priced by its
input alone."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tidegate.apis.dialect import Dialect
from tidegate.config import ModelConfig
from tidegate.validation.generation import DEFAULT_MAX_DEPTH, Validated
from tidegate.validation.responses import DEFAULT_MAX_RESPONSE_BYTES, validate_embeddings
from tidegate.wire.protocol import Api
from tidegate.wire.tokens import prompts, text_cost


class Embeddings(Dialect):
    api = Api.EMBEDDINGS
    path = "/embeddings"
    operation = "embeddings"
    vectors = True

    def validate(self, raw: bytes, models: Mapping[str, ModelConfig], *,
                 max_depth: int = DEFAULT_MAX_DEPTH,
                 max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES) -> Validated:
        return validate_embeddings(raw, self.api, models, max_depth=max_depth,
                                   max_response_bytes=max_response_bytes)

    def prompt_cost(self, body: Mapping[str, Any]) -> float:
        """``input`` as completions' ``prompt``, without framing."""
        return float(sum(text_cost(p) if isinstance(p, str) else len(p)
                         for p in prompts(body.get("input"))))

    def completion_cap(self, body: Mapping[str, Any], default_max_tokens: int) -> int:
        return 0  # an embedding's cost is its input


DIALECT = Embeddings()
