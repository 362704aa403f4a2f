"""Validation of Responses (``/v1/responses``) and Embeddings (``/v1/embeddings``)
bodies (sans-I/O), beside ``tidegate.validation.generation``'s chat and completions.

Each API's dialect (``tidegate.apis``) calls its validator;
``tidegate.apis.validate_request`` is the one entry point for every endpoint.
The same OpenAI-style 400s as chat's (``param`` names the field). Only
fields tidegate depends on are checked; unknown fields pass through.
``background: true`` is tidegate's own (``edge.background``) and never
reaches a backend; an embeddings body may not ask to ``stream``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tidegate.config import ModelConfig
from tidegate.errors import invalid_request
from tidegate.validation.generation import (
    DEFAULT_MAX_DEPTH,
    Validated,
    check_content_parts,
    check_number,
    check_token_limit,
    model_for,
    optional_bool,
    optional_int,
    parse_json,
)
from tidegate.validation.jsonbody import json_type
from tidegate.validation.schema_parts import (
    BOOL,
    CONTENT,
    MODEL,
    OBJECT,
    STRING,
    Schema,
    integer,
    number,
    obj,
    only_when_streaming,
    strings,
)
from tidegate.wire.protocol import Api

__all__ = ["DEFAULT_MAX_RESPONSE_BYTES", "check_embeddings_size", "embedding_inputs",
           "embeddings_size", "validate_embeddings", "validate_responses"]

# OpenAI's own bound on one embeddings request's inputs.
MAX_EMBEDDING_INPUTS = 2048
# An embeddings response's size, bounded before any vector is made: a value
# is at most 24 bytes of JSON (a float32 printed as a double, sign, exponent
# and comma: "-1.2345678901234567e-05,"), or 4 bytes in base64; the object
# around each vector and around the list add less than these.
_FLOAT_JSON_BYTES = 24
_PER_EMBEDDING_BYTES = 64
_PER_RESPONSE_BYTES = 256
DEFAULT_MAX_RESPONSE_BYTES = 8 << 20  # EdgeConfig's and WorkerConfig's default
ENCODINGS = ("float", "base64")
TRUNCATIONS = ("auto", "disabled")


def validate_responses(raw: bytes, api: Api, models: Mapping[str, ModelConfig], *,
                       max_depth: int = DEFAULT_MAX_DEPTH) -> Validated:
    """A Responses body; ``api``: the dialect's, which the result names."""
    body = parse_json(raw, max_depth)
    model = model_for(body, models)
    _input(body)
    _optional_str(body, "instructions")
    check_token_limit(body, "max_output_tokens", model)
    optional_int(body, "max_tool_calls", minimum=1)
    check_number(body, "temperature", 0.0, 2.0)
    check_number(body, "top_p", 0.0, 1.0)
    top_logprobs = optional_int(body, "top_logprobs", minimum=0)
    if top_logprobs is not None and top_logprobs > 20:
        raise invalid_request(f"'top_logprobs' must be <= 20, got {top_logprobs}.",
                              param="top_logprobs", code="invalid_value")
    _tools(body)
    _tool_choice(body)
    for key in ("parallel_tool_calls", "store"):
        optional_bool(body, key)
    for key in ("previous_response_id", "user", "prompt_cache_key", "safety_identifier",
                "service_tier"):
        _optional_str(body, key)
    for key in ("metadata", "text", "reasoning", "prompt", "conversation"):
        _optional_object(body, key, allow_str=key == "conversation")
    truncation = body.get("truncation")
    if truncation is not None and truncation not in TRUNCATIONS:
        raise invalid_request(f"'truncation' must be one of {', '.join(TRUNCATIONS)}, got "
                              f"{truncation!r}.", param="truncation", code="invalid_value")
    include = body.get("include")
    if include is not None and not (isinstance(include, list)
                                    and all(isinstance(i, str) for i in include)):
        raise invalid_request("'include' must be an array of strings.", param="include",
                              code="invalid_type")
    stream = optional_bool(body, "stream") or False
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise invalid_request(f"'stream_options' must be an object, got "
                                  f"{json_type(options)}.", param="stream_options",
                                  code="invalid_type")
        if not stream:
            raise invalid_request("The 'stream_options' parameter is only allowed when "
                                  "'stream' is true.", param="stream_options",
                                  code="invalid_value")
    optional_bool(body, "background")
    # Usage always arrives with response.completed: nothing to ask the backend for.
    return Validated(api=api, model=model, body=body, stream=stream,
                     include_usage=False)


def validate_embeddings(raw: bytes, api: Api, models: Mapping[str, ModelConfig], *,
                        max_depth: int = DEFAULT_MAX_DEPTH,
                        max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES) -> Validated:
    body = parse_json(raw, max_depth)
    model = model_for(body, models)
    _embedding_input(body)
    encoding = body.get("encoding_format")
    if encoding is not None and encoding not in ENCODINGS:
        raise invalid_request(f"'encoding_format' must be one of {', '.join(ENCODINGS)}, got "
                              f"{encoding!r}.", param="encoding_format", code="invalid_value")
    dimensions = optional_int(body, "dimensions", minimum=1)
    if dimensions is None and model.backend == "simulator":
        dimensions = model.simulator.embedding_dimensions
    if dimensions is not None:  # else the backend model's own size, unknown here
        check_embeddings_size(body, dimensions, max_response_bytes, "edge.max_response_bytes")
    _optional_str(body, "user")
    if optional_bool(body, "stream"):
        raise invalid_request("Embeddings cannot be streamed; send the request without "
                              "'stream'.", param="stream", code="unsupported_value")
    return Validated(api=api, model=model, body=body, stream=False,
                     include_usage=False)


def embedding_inputs(body: Mapping[str, Any]) -> list[str | list[int]]:
    """The inputs of an embeddings body, one vector each: a string or a
    token-id array alone is one input."""
    value = body.get("input")
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, int) for v in value):
        return [value]
    return list(value) if isinstance(value, list) else []


def embeddings_size(inputs: int, dimensions: int, base64: bool) -> int:
    """At most how many bytes the response to ``inputs`` vectors of
    ``dimensions`` values takes, in either encoding."""
    vector = 4 * -(-4 * dimensions // 3) + 2 if base64 else _FLOAT_JSON_BYTES * dimensions
    return _PER_RESPONSE_BYTES + inputs * (_PER_EMBEDDING_BYTES + vector)


def check_embeddings_size(body: Mapping[str, Any], dimensions: int, cap: int,
                          setting: str) -> None:
    """Refuse, before any vector is made, an embeddings request whose
    response could outgrow ``cap`` bytes (``setting`` names it): the work
    and the memory both grow with inputs x dimensions."""
    inputs = len(embedding_inputs(body))
    base64 = body.get("encoding_format") == "base64"
    size = embeddings_size(inputs, dimensions, base64)
    if size <= cap:
        return
    hint = "" if base64 else ", or encoding_format 'base64' (a fifth of the size)"
    raise invalid_request(
        f"{inputs} input(s) of {dimensions} dimensions make a response of up to {size} bytes, "
        f"over this gateway's limit of {cap} ({setting}); send fewer inputs or "
        f"dimensions{hint}.", param="dimensions" if "dimensions" in body else "input",
        code="invalid_value")


def _input(body: dict[str, Any]) -> None:
    if "input" not in body or body["input"] is None:
        if isinstance(body.get("previous_response_id"), str) or body.get("prompt") is not None:
            return  # the input lives on the backend (a stored response or prompt template)
        raise invalid_request("Missing required parameter: 'input'.", param="input",
                              code="missing_required_parameter")
    value = body["input"]
    if isinstance(value, str):
        return
    if not isinstance(value, list):
        raise invalid_request(f"'input' must be a string or an array of input items, got "
                              f"{json_type(value)}.", param="input", code="invalid_type")
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise invalid_request(f"'{where}' must be an object, got {json_type(item)}.",
                                  param=where, code="invalid_type")
        kind = item.get("type")
        if kind is not None and not isinstance(kind, str):
            raise invalid_request(f"'{where}.type' must be a string.", param=f"{where}.type",
                                  code="invalid_type")
        if "role" in item and not isinstance(item["role"], str):
            raise invalid_request(f"'{where}.role' must be a string.", param=f"{where}.role",
                                  code="invalid_type")
        if kind is None and "role" not in item:
            raise invalid_request(f"'{where}' needs a 'type' or a 'role'.", param=where,
                                  code="missing_required_parameter")
        content = item.get("content")
        if (kind in (None, "message") and "role" in item
                and not isinstance(content, str | list)):
            raise invalid_request(f"'{where}.content' must be a string or an array of content "
                                  f"parts, got {json_type(content)}.",
                                  param=f"{where}.content", code="invalid_type")
        if isinstance(content, list):
            check_content_parts(content, f"{where}.content")


def _tools(body: dict[str, Any]) -> None:
    tools = body.get("tools")
    if tools is None:
        return
    if not isinstance(tools, list):
        raise invalid_request(f"'tools' must be an array, got {json_type(tools)}.",
                              param="tools", code="invalid_type")
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("type"), str):
            raise invalid_request(f"'tools[{i}]' must be an object with a string 'type'.",
                                  param=f"tools[{i}]", code="invalid_type")


def _tool_choice(body: dict[str, Any]) -> None:
    choice = body.get("tool_choice")
    if choice is None or isinstance(choice, dict):
        return
    if choice not in ("none", "auto", "required"):
        raise invalid_request(f"'tool_choice' must be 'none', 'auto', 'required' or an object, "
                              f"got {choice!r}.", param="tool_choice", code="invalid_value")


def _embedding_input(body: dict[str, Any]) -> None:
    if "input" not in body or body["input"] is None:
        raise invalid_request("Missing required parameter: 'input'.", param="input",
                              code="missing_required_parameter")
    value = body["input"]
    if isinstance(value, str):
        if not value:
            raise invalid_request("'input' must not be an empty string.", param="input",
                                  code="invalid_value")
        return
    message = ("'input' must be a string, an array of strings, an array of token ids or an "
               "array of token-id arrays.")
    if not isinstance(value, list) or not value:
        raise invalid_request(message, param="input", code="invalid_type")
    if len(value) > MAX_EMBEDDING_INPUTS:
        raise invalid_request(f"'input' holds {len(value)} items; at most "
                              f"{MAX_EMBEDDING_INPUTS} are allowed.", param="input",
                              code="invalid_value")
    if all(_is_token(v) for v in value):
        return
    for i, item in enumerate(value):
        if isinstance(item, str):
            if not item:
                raise invalid_request(f"'input[{i}]' must not be empty.", param=f"input[{i}]",
                                      code="invalid_value")
        elif not (isinstance(item, list) and item and all(_is_token(v) for v in item)):
            raise invalid_request(message, param=f"input[{i}]", code="invalid_type")


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _optional_str(body: dict[str, Any], key: str) -> None:
    value = body.get(key)
    if value is not None and not isinstance(value, str):
        raise invalid_request(f"'{key}' must be a string, got {json_type(value)}.",
                              param=key, code="invalid_type")


def _optional_object(body: dict[str, Any], key: str, *, allow_str: bool = False) -> None:
    value = body.get(key)
    if value is None or isinstance(value, dict) or (allow_str and isinstance(value, str)):
        return
    raise invalid_request(f"'{key}' must be an object, got {json_type(value)}.", param=key,
                          code="invalid_type")


# -- the request schemas (/openapi.json; tidegate.validation.schemas) --------------

_RESPONSE_ITEM: Schema = {
    "type": "object",
    "anyOf": [{"required": ["role"]}, {"required": ["type"]}],
    "properties": {"type": STRING, "role": STRING, "content": CONTENT},
    # stricter than the validator, which needs content with a role only for messages
    "dependentRequired": {"role": ["content"]},
}


def responses_schema(max_tokens: int) -> Schema:
    return obj({
        "model": MODEL,
        "input": {"anyOf": [STRING, {"type": "array", "items": _RESPONSE_ITEM}]},
        "instructions": STRING,
        "max_output_tokens": integer(1, max_tokens),
        "max_tool_calls": integer(1),
        "temperature": number(0.0, 2.0),
        "top_p": number(0.0, 1.0),
        "top_logprobs": integer(0, 20),
        "tools": {"type": "array", "items": obj({"type": STRING}, ("type",))},
        "tool_choice": {"anyOf": [{"enum": ["none", "auto", "required"]}, OBJECT]},
        **{key: BOOL for key in ("parallel_tool_calls", "store", "stream", "background")},
        **strings("previous_response_id", "user", "prompt_cache_key", "safety_identifier",
                   "service_tier"),
        **{key: OBJECT for key in ("metadata", "text", "reasoning", "prompt")},
        "conversation": {"anyOf": [OBJECT, STRING]},
        "truncation": {"enum": list(TRUNCATIONS)},
        "include": {"type": "array", "items": STRING},
        "stream_options": OBJECT,
    }, ("model",), anyOf=[{"required": ["input"]}, {"required": ["previous_response_id"]},
                          {"required": ["prompt"]}],
        dependentSchemas=only_when_streaming("stream_options"))


_TOKEN = integer(0, (1 << 64) - 1)
_TOKENS: Schema = {"type": "array", "minItems": 1, "maxItems": MAX_EMBEDDING_INPUTS,
                   "items": _TOKEN}


def embeddings_schema() -> Schema:
    return obj({
        "model": MODEL,
        "input": {"anyOf": [
            {"type": "string", "minLength": 1},
            {"type": "array", "minItems": 1, "maxItems": MAX_EMBEDDING_INPUTS,
             "items": {"type": "string", "minLength": 1}},
            _TOKENS,
            {"type": "array", "minItems": 1, "maxItems": MAX_EMBEDDING_INPUTS,
             "items": {"type": "array", "minItems": 1, "items": _TOKEN}},
        ]},
        "encoding_format": {"enum": list(ENCODINGS)},
        "dimensions": integer(1),
        "user": STRING,
        "stream": {"const": False},
    }, ("model", "input"), description=(
        "Also bounded by inputs x dimensions: a request whose response could outgrow "
        "the gateway's edge.max_response_bytes is a 400 before any work."))
