"""Validation of OpenAI request bodies (sans-I/O).

Takes the raw body bytes and the model index, returns a :class:`Validated`
request or raises :class:`tidegate.errors.ApiError` with the status, ``param``
and message a client needs to fix its request. Only the fields tidegate itself
depends on, or that would make a backend fail in a confusing way, are checked;
unknown fields pass through to the backend untouched, as OpenAI-compatible
servers accept vendor extensions (``top_k``, ``repetition_penalty``, ...).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tidegate.config import ModelConfig
from tidegate.errors import ApiError, invalid_request
from tidegate.validation.jsonbody import json_type, parse_object
from tidegate.validation.openai_fields import (
    MAX_LOGIT_BIAS,
    MAX_METADATA,
    MAX_TOOLS,
    TOOL_CHOICES,
    check_chat,
    check_completion,
)
from tidegate.validation.schema_parts import (
    BOOL,
    CONTENT,
    INT64,
    MODEL,
    OBJECT,
    STRING,
    Schema,
    integer,
    number,
    obj,
    only_when_streaming,
    stop_strings,
)
from tidegate.wire.protocol import Api

_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


@dataclass(frozen=True, slots=True)
class Validated:
    api: Api
    model: ModelConfig
    body: dict[str, Any]
    stream: bool
    include_usage: bool



# OpenAI's bound on the number of stop strings. It documents no length; real
# stop strings are a delimiter or a role tag, and a backend may scan each one
# per token, so tidegate bounds them (docs/security.md, "OpenAI fields").
MAX_STOPS = 4
MAX_STOP_CHARS = 1000

# Deeper than any real request (tool and response schemas nest a dozen levels),
# far below msgpack's encoder limit (511) and Python's recursion limit.
DEFAULT_MAX_DEPTH = 64


def parse_json(raw: bytes, max_depth: int = DEFAULT_MAX_DEPTH) -> dict[str, Any]:
    """The body as a JSON object (strict, depth-bounded: see tidegate.validation.jsonbody)."""
    return parse_object(raw, max_depth)


def validate_chat(body: dict[str, Any], api: Api,
                  models: Mapping[str, ModelConfig]) -> Validated:
    """A chat completions body already parsed (an HTTP body's or a WebSocket
    frame's, with the same strict, depth-bounded parser: :func:`parse_json`);
    ``api`` is what the result carries (``tidegate.apis.chat``'s)."""
    model = model_for(body, models)
    _messages(body)
    check_token_limit(body, "max_completion_tokens", model)
    check_chat(body)
    return _generation(body, api, model)


def validate_completion(body: dict[str, Any], api: Api,
                        models: Mapping[str, ModelConfig]) -> Validated:
    """:func:`validate_chat` for a (legacy) completions body."""
    model = model_for(body, models)
    _prompt(body)
    check_completion(body)
    return _generation(body, api, model)


def _generation(body: dict[str, Any], api: Api, model: ModelConfig) -> Validated:
    """What chat and completions check alike, after their own fields."""
    stream = optional_bool(body, "stream") or False
    include_usage = _stream_options(body, stream)
    check_token_limit(body, "max_tokens", model)
    check_number(body, "temperature", 0.0, 2.0)
    check_number(body, "top_p", 0.0, 1.0)
    check_number(body, "presence_penalty", -2.0, 2.0)
    check_number(body, "frequency_penalty", -2.0, 2.0)
    n = optional_int(body, "n", minimum=1)
    if n is not None and n != 1:
        raise invalid_request("tidegate supports only n=1 (one choice per request).", param="n",
                              code="unsupported_value")
    _stop(body)
    return Validated(api=api, model=model, body=body, stream=stream, include_usage=include_usage)


def model_for(body: dict[str, Any], models: Mapping[str, ModelConfig]) -> ModelConfig:
    if "model" not in body or body["model"] is None:
        raise invalid_request("You must provide a model parameter.", param="model",
                              code="missing_required_parameter")
    name = body["model"]
    if not isinstance(name, str):
        raise invalid_request(f"'model' must be a string, got {json_type(name)}.",
                              param="model", code="invalid_type")
    model = models.get(name)
    if model is None:
        raise model_not_found(name)
    return model


def model_not_found(name: str) -> ApiError:
    """The answer for a model that is not there, and for one the key may not
    use (the edge validates against the key's models only): the same, so a
    restricted key learns no other model's name. No list of the others
    (GET /v1/models lists the ones the key may use)."""
    return ApiError(404, f"The model '{name}' does not exist or you do not have access to "
                         "it; GET /v1/models lists the models your key may use.",
                    type="invalid_request_error", code="model_not_found", param="model")


def _messages(body: dict[str, Any]) -> None:
    if "messages" not in body:
        raise invalid_request("Missing required parameter: 'messages'.", param="messages",
                              code="missing_required_parameter")
    messages = body["messages"]
    if not isinstance(messages, list):
        raise invalid_request(f"'messages' must be an array, got {json_type(messages)}.",
                              param="messages", code="invalid_type")
    if not messages:
        raise invalid_request("'messages' must contain at least one message.",
                              param="messages", code="empty_array")
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise invalid_request(f"'{where}' must be an object, got {json_type(message)}.",
                                  param=where, code="invalid_type")
        role = message.get("role")
        if not isinstance(role, str):
            raise invalid_request(f"'{where}.role' is required and must be a string.",
                                  param=f"{where}.role", code="invalid_type")
        if role not in _ROLES:
            raise invalid_request(
                f"'{where}.role' must be one of {', '.join(sorted(_ROLES))}, got {role!r}.",
                param=f"{where}.role", code="invalid_value")
        content = message.get("content")
        if content is not None and not isinstance(content, str | list):
            raise invalid_request(
                f"'{where}.content' must be a string or an array of content parts, got "
                f"{json_type(content)}.", param=f"{where}.content", code="invalid_type")
        if isinstance(content, list):
            check_content_parts(content, f"{where}.content")
        if content is None and role in ("system", "developer", "user"):
            raise invalid_request(f"'{where}.content' is required for role {role!r}.",
                                  param=f"{where}.content", code="missing_required_parameter")


# The string fields of each content part type OpenAI defines (chat's and the
# Responses API's), True = required. A part of another type passes untouched
# (vendor parts: vLLM's video_url, ...); a known type must have its shape, so
# a backend never gets a part it would choke on (issue 24: "image_url": 5).
_PART_STRINGS: dict[str, dict[str, bool]] = {
    "text": {"text": True},
    "input_text": {"text": True},
    "output_text": {"text": True},
    "refusal": {"refusal": True},
    "input_image": {"image_url": False, "file_id": False, "detail": False},
    "input_file": {"file_id": False, "file_data": False, "file_url": False, "filename": False},
}
# Chat's parts whose payload is an object under the type's name.
_PART_OBJECTS: dict[str, dict[str, bool]] = {
    "image_url": {"url": True, "detail": False},
    "input_audio": {"data": True, "format": True},
    "file": {"file_data": False, "file_id": False, "filename": False},
}
_DETAIL = ("auto", "low", "high")


def check_content_parts(parts: list[Any], where: str) -> None:
    for j, part in enumerate(parts):
        at = f"{where}[{j}]"
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise invalid_request(f"'{at}' must be a content part object with a string "
                                  "'type'.", param=at, code="invalid_type")
        kind = part["type"]
        if kind in _PART_STRINGS:
            _string_fields(part, at, _PART_STRINGS[kind])
        elif kind in _PART_OBJECTS:
            payload = part.get(kind)
            if kind == "image_url" and isinstance(payload, str):
                continue  # the URL alone, as several OpenAI-compatible servers accept
            if payload is None:
                raise invalid_request(f"'{at}.{kind}' is required for a '{kind}' part.",
                                      param=f"{at}.{kind}", code="missing_required_parameter")
            if not isinstance(payload, dict):
                raise invalid_request(f"'{at}.{kind}' must be an object, got "
                                      f"{json_type(payload)}.", param=f"{at}.{kind}",
                                      code="invalid_type")
            _string_fields(payload, f"{at}.{kind}", _PART_OBJECTS[kind])


def _string_fields(obj: dict[str, Any], at: str, spec: dict[str, bool]) -> None:
    for name, required in spec.items():
        value = obj.get(name)
        if value is None:
            if required:
                raise invalid_request(f"'{at}.{name}' is required.", param=f"{at}.{name}",
                                      code="missing_required_parameter")
            continue
        if not isinstance(value, str):
            raise invalid_request(f"'{at}.{name}' must be a string, got {json_type(value)}.",
                                  param=f"{at}.{name}", code="invalid_type")
        if name == "detail" and value not in _DETAIL:
            raise invalid_request(f"'{at}.detail' must be one of {', '.join(_DETAIL)}, got "
                                  f"{value[:40]!r}.", param=f"{at}.detail", code="invalid_value")


def _prompt(body: dict[str, Any]) -> None:
    if "prompt" not in body:
        raise invalid_request("Missing required parameter: 'prompt'.", param="prompt",
                              code="missing_required_parameter")
    prompt = body["prompt"]
    if isinstance(prompt, str):
        return
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return
    raise invalid_request("'prompt' must be a string or a non-empty array of strings.",
                          param="prompt", code="invalid_type")


def optional_bool(body: dict[str, Any], key: str) -> bool | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, bool):
        raise invalid_request(f"'{key}' must be a boolean, got {json_type(value)}.",
                              param=key, code="invalid_type")
    return value


def optional_int(body: dict[str, Any], key: str, *, minimum: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid_request(f"'{key}' must be an integer, got {json_type(value)}.",
                              param=key, code="invalid_type")
    if value < minimum:
        raise invalid_request(f"'{key}' must be >= {minimum}, got {value}.", param=key,
                              code="invalid_value")
    return value


def check_token_limit(body: dict[str, Any], key: str, model: ModelConfig) -> None:
    """A client's output token limit, bounded by the model's
    ``max_output_tokens``: a worker sizes per-request state by it (and a
    backend would run it), so a limit no model can reach is refused here."""
    value = optional_int(body, key, minimum=1)
    if value is not None and value > model.max_output_tokens:
        raise invalid_request(
            f"'{key}' must be <= {model.max_output_tokens} for model '{model.name}' (its "
            f"max_output_tokens), got {value if value < 1 << 64 else 'a larger number'}.",
            param=key, code="invalid_value")


def check_number(body: dict[str, Any], key: str, low: float, high: float) -> None:
    value = body.get(key)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise invalid_request(f"'{key}' must be a number, got {json_type(value)}.",
                              param=key, code="invalid_type")
    if not low <= value <= high:
        raise invalid_request(f"'{key}' must be between {low:g} and {high:g}, got {value}.",
                              param=key, code="invalid_value")


def _stream_options(body: dict[str, Any], stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise invalid_request(f"'stream_options' must be an object, got {json_type(options)}.",
                              param="stream_options", code="invalid_type")
    if not stream:
        raise invalid_request("The 'stream_options' parameter is only allowed when 'stream' "
                              "is true.", param="stream_options", code="invalid_value")
    include = options.get("include_usage")
    if include is not None and not isinstance(include, bool):
        raise invalid_request("'stream_options.include_usage' must be a boolean.",
                              param="stream_options.include_usage", code="invalid_type")
    return bool(include)


def _stop(body: dict[str, Any]) -> None:
    stop = body.get("stop")
    if stop is None:
        return
    if not (isinstance(stop, str) or (isinstance(stop, list) and len(stop) <= MAX_STOPS
                                      and all(isinstance(s, str) and s for s in stop))):
        raise invalid_request(f"'stop' must be a string or an array of at most {MAX_STOPS} "
                              "non-empty strings.", param="stop", code="invalid_type")
    check_stop_lengths([stop] if isinstance(stop, str) else stop, "stop")


def check_stop_lengths(stops: list[str], param: str) -> None:
    """Each stop string at most :data:`MAX_STOP_CHARS` characters: a matcher
    (the simulator's, a backend's) keeps a window that long per stream."""
    for i, stop in enumerate(stops):
        if len(stop) > MAX_STOP_CHARS:
            raise invalid_request(
                f"'{param}' strings may be at most {MAX_STOP_CHARS} characters; "
                f"{param}[{i}] has {len(stop)}.", param=param, code="invalid_value")


# -- the request schemas (/openapi.json; tidegate.validation.schemas) --------------

def _common(max_tokens: int) -> dict[str, Schema]:
    """Fields chat and completions share (validate_body, check_common)."""
    return {
        "model": MODEL,
        "stream": BOOL,
        "stream_options": obj({"include_usage": BOOL}),
        "max_tokens": integer(1, max_tokens),
        "temperature": number(0.0, 2.0),
        "top_p": number(0.0, 1.0),
        "presence_penalty": number(-2.0, 2.0),
        "frequency_penalty": number(-2.0, 2.0),
        "n": {"type": "integer", "const": 1},
        "stop": {"anyOf": [{"type": "string", "maxLength": MAX_STOP_CHARS},
                           stop_strings(MAX_STOPS, MAX_STOP_CHARS)]},
        "seed": integer(-INT64, INT64 - 1),
        "logit_bias": {"type": "object", "maxProperties": MAX_LOGIT_BIAS,
                       "propertyNames": {"pattern": "^[0-9]{1,10}$"},
                       "additionalProperties": number(-100, 100)},
        "user": STRING,
        "echo": BOOL,
        "store": BOOL,
        "parallel_tool_calls": BOOL,
    }


_FUNCTION_NAME: Schema = {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"}
_CHAT_TOOL: Schema = {"anyOf": [
    obj({"type": {"const": "function"}, "function": obj({
        "name": _FUNCTION_NAME, "description": STRING, "parameters": OBJECT,
        "strict": BOOL}, ("name",))}, ("type", "function")),
    obj({"type": {"type": "string", "not": {"const": "function"}}}, ("type",)),
]}
_CHAT_MESSAGE: Schema = {"anyOf": [
    obj({"role": {"enum": ["system", "developer", "user"]}, "content": CONTENT},
         ("role", "content")),
    obj({"role": {"enum": ["assistant", "tool", "function"]},
          "content": {"anyOf": [CONTENT, {"type": "null"}]}}, ("role",)),
]}


def chat_schema(max_tokens: int) -> Schema:
    return obj({
        **_common(max_tokens),
        "messages": {"type": "array", "minItems": 1, "items": _CHAT_MESSAGE},
        "max_completion_tokens": integer(1, max_tokens),
        "tools": {"type": "array", "maxItems": MAX_TOOLS, "items": _CHAT_TOOL},
        "tool_choice": {"anyOf": [
            {"enum": sorted(TOOL_CHOICES)},
            obj({"type": {"const": "function"},
                  "function": obj({"name": _FUNCTION_NAME}, ("name",))},
                 ("type", "function")),
            obj({"type": {"type": "string", "not": {"const": "function"}}}, ("type",))]},
        "response_format": {"anyOf": [
            obj({"type": {"enum": ["text", "json_object"]}}, ("type",)),
            obj({"type": {"const": "json_schema"}, "json_schema": obj(
                {"name": _FUNCTION_NAME, "schema": OBJECT, "strict": BOOL}, ("name",))},
                ("type", "json_schema"))]},
        "metadata": {"type": "object", "maxProperties": MAX_METADATA,
                     "additionalProperties": STRING},
        "logprobs": BOOL,
        "top_logprobs": integer(0, 20),
        "reasoning_effort": STRING,
        "service_tier": STRING,
    }, ("model", "messages"), dependentSchemas={
        **only_when_streaming("stream_options"),
        "top_logprobs": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}},
    })


def completions_schema(max_tokens: int) -> Schema:
    return obj({
        **_common(max_tokens),
        "prompt": {"anyOf": [STRING, {"type": "array", "minItems": 1, "items": STRING}]},
        "logprobs": integer(0, 5),
        "best_of": {"type": "integer", "const": 1},
        "suffix": STRING,
    }, ("model", "prompt"), dependentSchemas=only_when_streaming("stream_options"))
