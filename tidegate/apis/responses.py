"""OpenAI's Responses API (``/v1/responses``): instructions and input items
in, typed SSE events out (no ``[DONE]``); background runs; continuable."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tidegate.apis.dialect import Dialect
from tidegate.config import ModelConfig
from tidegate.validation.generation import DEFAULT_MAX_DEPTH, Validated
from tidegate.validation.responses import DEFAULT_MAX_RESPONSE_BYTES, validate_responses
from tidegate.wire.protocol import Api
from tidegate.wire.tokens import (
    PER_MESSAGE,
    PER_TOOL_CALL,
    REPLY_PRIMING,
    json_text,
    message_cost,
    text_cost,
)


class Responses(Dialect):
    api = Api.RESPONSES
    path = "/responses"
    operation = "chat"
    cap_fields = ("max_output_tokens",)
    continuable = True
    typed_events = True
    background = True
    numbered_events = True
    previous_field = "previous_response_id"

    def validate(self, raw: bytes, models: Mapping[str, ModelConfig], *,
                 max_depth: int = DEFAULT_MAX_DEPTH,
                 max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES) -> Validated:
        return validate_responses(raw, self.api, models, max_depth=max_depth)

    def chat_body(self, body: Mapping[str, Any]) -> Mapping[str, Any] | None:
        """``instructions`` as a system turn, ``input`` as the turns (a text
        as one user turn)."""
        given = body.get("input")
        turns = [{"role": "user", "content": given}] if isinstance(given, str) else given
        return {"messages": [*([{"role": "system", "content": body["instructions"]}]
                               if body.get("instructions") else []),
                             *(turns if isinstance(turns, list) else [])]}

    def prompt_cost(self, body: Mapping[str, Any]) -> float:
        """A Responses body: ``instructions``, ``input`` (a text or a list of
        items: messages, function calls and their outputs), the tool definitions."""
        cost = float(REPLY_PRIMING)
        instructions = body.get("instructions")
        if isinstance(instructions, str):
            cost += PER_MESSAGE + text_cost(instructions)
        items = body.get("input")
        if isinstance(items, str):
            cost += PER_MESSAGE + text_cost(items)
        for item in items if isinstance(items, list) else ():
            if not isinstance(item, Mapping):
                continue
            if "content" in item or "role" in item:
                cost += message_cost(item)
                continue
            cost += PER_TOOL_CALL
            for key in ("name", "arguments", "output"):
                value = item.get(key)
                if isinstance(value, str):
                    cost += text_cost(value)
        if body.get("tools"):
            cost += text_cost(json_text(body["tools"]))
        return cost

    def continue_body(self, body: dict[str, Any], text: str) -> None:
        """The answer so far as a final assistant item of ``input``."""
        given = body.get("input")
        items = [{"role": "user", "content": given}] if isinstance(given, str) else list(
            given if isinstance(given, list) else ())
        body["input"] = [*items, {"role": "assistant", "content": text}]

    def choices(self, body: Mapping[str, Any]) -> int:
        return 1  # no ``n``


DIALECT = Responses()
