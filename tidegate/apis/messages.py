"""Anthropic's Messages API (``/v1/messages``): system and turns of content
blocks in, typed SSE events out (no ``[DONE]``); Anthropic's error shape and
rate-limit headers (docs/anthropic.md)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tidegate.apis.dialect import Dialect
from tidegate.config import ModelConfig
from tidegate.validation.generation import Validated
from tidegate.validation.messages import validate_messages_body
from tidegate.wire.protocol import Api
from tidegate.wire.tokens import (
    IMAGE_TOKENS,
    PER_MESSAGE,
    PER_TOOL_CALL,
    REPLY_PRIMING,
    json_text,
    text_cost,
)


class Messages(Dialect):
    api = Api.MESSAGES
    path = "/messages"
    operation = "chat"
    anthropic = True
    typed_events = True
    on_websocket = True
    stop_field = "stop_sequences"

    def validate_body(self, body: dict[str, Any],
                      models: Mapping[str, ModelConfig]) -> Validated:
        return validate_messages_body(body, self.api, models)

    def prompt_cost(self, body: Mapping[str, Any]) -> float:
        """An Anthropic Messages body: ``system``, each turn's content blocks
        (text, images, tool calls and their results), the tool definitions."""
        cost = float(REPLY_PRIMING)
        system = body.get("system")
        blocks: list[Any] = [{"type": "text", "text": system}] if isinstance(system, str) else (
            list(system) if isinstance(system, list) else [])
        if blocks:
            cost += PER_MESSAGE
        turns = body.get("messages")
        for turn in turns if isinstance(turns, list) else ():
            if not isinstance(turn, Mapping):
                continue
            cost += PER_MESSAGE
            content = turn.get("content")
            if isinstance(content, str):
                cost += text_cost(content)
            elif isinstance(content, list):
                blocks.extend(content)
        while blocks:
            block = blocks.pop()
            if not isinstance(block, Mapping):
                continue
            kind = block.get("type")
            if isinstance(block.get("text"), str):
                cost += text_cost(block["text"])
            elif kind == "image":
                cost += IMAGE_TOKENS
            elif kind == "tool_use":
                cost += PER_TOOL_CALL + text_cost(json_text(block.get("input")))
                if isinstance(block.get("name"), str):
                    cost += text_cost(block["name"])
            elif kind == "tool_result":
                content = block.get("content")
                if isinstance(content, str):
                    cost += PER_TOOL_CALL + text_cost(content)
                elif isinstance(content, list):
                    cost += PER_TOOL_CALL
                    blocks.extend(content)
        if body.get("tools"):
            cost += text_cost(json_text(body["tools"]))
        return cost


DIALECT = Messages()
