"""OpenAI's legacy Completions (``/v1/completions``): a prompt (texts or
token arrays) in, chunks out, ``data: [DONE]`` last; continuable."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tidegate.apis.dialect import Dialect
from tidegate.config import ModelConfig
from tidegate.validation.generation import Validated, validate_completion
from tidegate.wire.protocol import Api
from tidegate.wire.tokens import choice_count, is_int, prompts, text_cost


class Completions(Dialect):
    api = Api.COMPLETIONS
    path = "/completions"
    operation = "text_completion"
    done_marker = True
    continuable = True
    on_websocket = True
    stop_field = "stop"
    affinity_field = "prompt"
    usage_asked = True
    choice_chunks = True
    optional_endpoint = False

    def validate_body(self, body: dict[str, Any],
                      models: Mapping[str, ModelConfig]) -> Validated:
        return validate_completion(body, self.api, models)

    def prompt_cost(self, body: Mapping[str, Any]) -> float:
        """``prompt`` as a text, a list of texts or token arrays (each integer
        one token), plus ``suffix``."""
        cost = 0.0
        for prompt in prompts(body.get("prompt")):
            cost += text_cost(prompt) if isinstance(prompt, str) else len(prompt)
        suffix = body.get("suffix")
        if isinstance(suffix, str):
            cost += text_cost(suffix)
        return cost

    def continue_body(self, body: dict[str, Any], text: str) -> None:
        """The answer so far appended to a text prompt."""
        if isinstance(body.get("prompt"), str):
            body["prompt"] = body["prompt"] + text

    def choices(self, body: Mapping[str, Any]) -> int:
        """``n`` or ``best_of`` (which generates that many), per prompt of a
        batched request."""
        count = max(choice_count(body.get("n")), choice_count(body.get("best_of")))
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not is_int(prompt[0]):
            count *= len(prompt)
        return count


DIALECT = Completions()
