"""OpenAI's Chat Completions (``/v1/chat/completions``): messages in, chunks
out, ``data: [DONE]`` last; continuable."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tidegate.apis.dialect import Dialect
from tidegate.config import ModelConfig
from tidegate.validation.generation import Validated, validate_chat
from tidegate.wire.protocol import Api
from tidegate.wire.tokens import REPLY_PRIMING, json_text, message_cost, text_cost


class Chat(Dialect):
    api = Api.CHAT
    path = "/chat/completions"
    operation = "chat"
    cap_fields = ("max_completion_tokens", "max_tokens")
    done_marker = True
    continuable = True
    openai_chat = True
    on_websocket = True
    stop_field = "stop"
    affinity_field = "messages"
    usage_asked = True
    choice_chunks = True
    optional_endpoint = False

    def validate_body(self, body: dict[str, Any],
                      models: Mapping[str, ModelConfig]) -> Validated:
        return validate_chat(body, self.api, models)

    def chat_body(self, body: Mapping[str, Any]) -> Mapping[str, Any] | None:
        return body

    def continue_body(self, body: dict[str, Any], text: str) -> None:
        """The answer so far as a final assistant message the backend
        continues (vLLM's and llama.cpp's ``continue_final_message``)."""
        body["messages"] = [*body.get("messages", ()), {"role": "assistant", "content": text}]
        body["continue_final_message"] = True
        body["add_generation_prompt"] = False

    def prompt_cost(self, body: Mapping[str, Any]) -> float:
        """Framing per message, each message's text, name, tool calls and
        image parts, and the tool / response-format definitions."""
        cost = float(REPLY_PRIMING)
        messages = body.get("messages")
        for message in messages if isinstance(messages, list) else ():
            if isinstance(message, Mapping):
                cost += message_cost(message)
        for key in ("tools", "functions"):
            if body.get(key):
                cost += text_cost(json_text(body[key]))
        response_format = body.get("response_format")
        if isinstance(response_format, Mapping) and "json_schema" in response_format:
            cost += text_cost(json_text(response_format["json_schema"]))
        return cost


DIALECT = Chat()
