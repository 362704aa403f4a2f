"""JSON Schemas (2020-12, as OpenAPI 3.1 takes them) of the request bodies the
validators check, built from the validators' own bounds (docs/security.md, "Schema fuzzing").

Invariant: a body these schemas accept passes the validator
(``tests/test_openapi.py`` generates bodies from them and validates each), so
the description a client's tools read never promises more than the edge takes.
The schemas may be stricter than the validator (content parts and blocks of
the known types only; vendor fields pass either way: ``additionalProperties``
is left open). What a schema cannot say is in its description: an embeddings
request is also bounded by inputs x dimensions (``edge.max_response_bytes``).

Model names are a ``$ref`` to one ``ModelName`` schema without an ``enum``:
the description is served without a key, and a model's name is for keys
allowed to use it (``GET /v1/models``).
"""

from __future__ import annotations

from typing import Any

from tidegate.validation import generation, messages, openai_fields
from tidegate.validation.responses import ENCODINGS, MAX_EMBEDDING_INPUTS, TRUNCATIONS
from tidegate.wire.batch import ENDPOINTS

__all__ = ["JSON_VALUE", "MODEL_NAME", "request_schemas"]

Schema = dict[str, Any]
MODEL_NAME = "ModelName"
_INT64 = 1 << 63

JSON_VALUE = "JsonValue"
_STRING: Schema = {"type": "string"}
_BOOL: Schema = {"type": "boolean"}
_ANY: Schema = {"$ref": f"#/components/schemas/{JSON_VALUE}"}
_OBJECT: Schema = {"type": "object", "additionalProperties": _ANY}
_MODEL: Schema = {"$ref": f"#/components/schemas/{MODEL_NAME}"}
# Any JSON value a body may hold anywhere: its integers must fit the broker's
# encoding (msgpack: -2^63 .. 2^64-1; tidegate.wire.protocol.Request.encode).
_JSON_VALUE: Schema = {"anyOf": [
    {"type": ["null", "boolean", "string"]},
    {"type": "number", "minimum": -_INT64, "maximum": (1 << 64) - 1},
    {"type": "array", "items": _ANY},
    _OBJECT,
]}


def _int(minimum: int, maximum: int | None = None) -> Schema:
    schema: Schema = {"type": "integer", "minimum": minimum}
    if maximum is not None:
        schema["maximum"] = maximum
    return schema


def _number(low: float, high: float) -> Schema:
    return {"type": "number", "minimum": low, "maximum": high}


def _obj(properties: dict[str, Schema], required: tuple[str, ...] = (), **more: Any) -> Schema:
    schema: Schema = {"type": "object", "properties": properties, "additionalProperties": _ANY}
    if required:
        schema["required"] = list(required)
    schema.update(more)
    return schema


def _only_when_streaming(field: str) -> Schema:
    """``field`` is allowed only beside ``stream: true`` (the validators' rule)."""
    return {field: {"required": ["stream"], "properties": {"stream": {"const": True}}}}


def _text_part(kind: str, field: str) -> Schema:
    return _obj({"type": {"const": kind}, field: _STRING}, ("type", field))


def _strings(*names: str) -> dict[str, Schema]:
    return {name: _STRING for name in names}


_DETAIL: Schema = {"enum": ["auto", "low", "high"]}
# Content parts of the types OpenAI defines (generation._PART_STRINGS and
# _PART_OBJECTS); the validator also passes vendor parts of other types.
_PARTS: list[Schema] = [
    _text_part("text", "text"), _text_part("input_text", "text"),
    _text_part("output_text", "text"), _text_part("refusal", "refusal"),
    _obj({"type": {"const": "input_image"}, **_strings("image_url", "file_id"),
          "detail": _DETAIL}, ("type",)),
    _obj({"type": {"const": "input_file"},
          **_strings("file_id", "file_data", "file_url", "filename")}, ("type",)),
    _obj({"type": {"const": "image_url"}, "image_url": {"anyOf": [
        _STRING, _obj({"url": _STRING, "detail": _DETAIL}, ("url",))]}},
         ("type", "image_url")),
    _obj({"type": {"const": "input_audio"},
          "input_audio": _obj(_strings("data", "format"), ("data", "format"))},
         ("type", "input_audio")),
    _obj({"type": {"const": "file"},
          "file": _obj(_strings("file_data", "file_id", "filename"))}, ("type", "file")),
]
_CONTENT: Schema = {"anyOf": [_STRING, {"type": "array", "items": {"anyOf": _PARTS}}]}


def _stop_strings(max_items: int) -> Schema:
    return {"type": "array", "maxItems": max_items,
            "items": {"type": "string", "minLength": 1, "maxLength": generation.MAX_STOP_CHARS}}


def _common(max_tokens: int) -> dict[str, Schema]:
    """Fields chat and completions share (generation.validate_body, check_common)."""
    return {
        "model": _MODEL,
        "stream": _BOOL,
        "stream_options": _obj({"include_usage": _BOOL}),
        "max_tokens": _int(1, max_tokens),
        "temperature": _number(0.0, 2.0),
        "top_p": _number(0.0, 1.0),
        "presence_penalty": _number(-2.0, 2.0),
        "frequency_penalty": _number(-2.0, 2.0),
        "n": {"type": "integer", "const": 1},
        "stop": {"anyOf": [{"type": "string", "maxLength": generation.MAX_STOP_CHARS},
                           _stop_strings(generation.MAX_STOPS)]},
        "seed": _int(-_INT64, _INT64 - 1),
        "logit_bias": {"type": "object", "maxProperties": openai_fields.MAX_LOGIT_BIAS,
                       "propertyNames": {"pattern": "^[0-9]{1,10}$"},
                       "additionalProperties": _number(-100, 100)},
        "user": _STRING,
        "echo": _BOOL,
        "store": _BOOL,
        "parallel_tool_calls": _BOOL,
    }


_FUNCTION_NAME: Schema = {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"}
_CHAT_TOOL: Schema = {"anyOf": [
    _obj({"type": {"const": "function"}, "function": _obj({
        "name": _FUNCTION_NAME, "description": _STRING, "parameters": _OBJECT,
        "strict": _BOOL}, ("name",))}, ("type", "function")),
    _obj({"type": {"type": "string", "not": {"const": "function"}}}, ("type",)),
]}
_CHAT_MESSAGE: Schema = {"anyOf": [
    _obj({"role": {"enum": ["system", "developer", "user"]}, "content": _CONTENT},
         ("role", "content")),
    _obj({"role": {"enum": ["assistant", "tool", "function"]},
          "content": {"anyOf": [_CONTENT, {"type": "null"}]}}, ("role",)),
]}


def chat(max_tokens: int) -> Schema:
    return _obj({
        **_common(max_tokens),
        "messages": {"type": "array", "minItems": 1, "items": _CHAT_MESSAGE},
        "max_completion_tokens": _int(1, max_tokens),
        "tools": {"type": "array", "maxItems": openai_fields.MAX_TOOLS, "items": _CHAT_TOOL},
        "tool_choice": {"anyOf": [
            {"enum": sorted(openai_fields.TOOL_CHOICES)},
            _obj({"type": {"const": "function"},
                  "function": _obj({"name": _FUNCTION_NAME}, ("name",))},
                 ("type", "function")),
            _obj({"type": {"type": "string", "not": {"const": "function"}}}, ("type",))]},
        "response_format": {"anyOf": [
            _obj({"type": {"enum": ["text", "json_object"]}}, ("type",)),
            _obj({"type": {"const": "json_schema"}, "json_schema": _obj(
                {"name": _FUNCTION_NAME, "schema": _OBJECT, "strict": _BOOL}, ("name",))},
                ("type", "json_schema"))]},
        "metadata": {"type": "object", "maxProperties": openai_fields.MAX_METADATA,
                     "additionalProperties": _STRING},
        "logprobs": _BOOL,
        "top_logprobs": _int(0, 20),
        "reasoning_effort": _STRING,
        "service_tier": _STRING,
    }, ("model", "messages"), dependentSchemas={
        **_only_when_streaming("stream_options"),
        "top_logprobs": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}},
    })


def completions(max_tokens: int) -> Schema:
    return _obj({
        **_common(max_tokens),
        "prompt": {"anyOf": [_STRING, {"type": "array", "minItems": 1, "items": _STRING}]},
        "logprobs": _int(0, 5),
        "best_of": {"type": "integer", "const": 1},
        "suffix": _STRING,
    }, ("model", "prompt"), dependentSchemas=_only_when_streaming("stream_options"))


_RESPONSE_ITEM: Schema = {
    "type": "object",
    "anyOf": [{"required": ["role"]}, {"required": ["type"]}],
    "properties": {"type": _STRING, "role": _STRING, "content": _CONTENT},
    # stricter than the validator, which needs content with a role only for messages
    "dependentRequired": {"role": ["content"]},
}


def responses(max_tokens: int) -> Schema:
    return _obj({
        "model": _MODEL,
        "input": {"anyOf": [_STRING, {"type": "array", "items": _RESPONSE_ITEM}]},
        "instructions": _STRING,
        "max_output_tokens": _int(1, max_tokens),
        "max_tool_calls": _int(1),
        "temperature": _number(0.0, 2.0),
        "top_p": _number(0.0, 1.0),
        "top_logprobs": _int(0, 20),
        "tools": {"type": "array", "items": _obj({"type": _STRING}, ("type",))},
        "tool_choice": {"anyOf": [{"enum": ["none", "auto", "required"]}, _OBJECT]},
        **{key: _BOOL for key in ("parallel_tool_calls", "store", "stream", "background")},
        **_strings("previous_response_id", "user", "prompt_cache_key", "safety_identifier",
                   "service_tier"),
        **{key: _OBJECT for key in ("metadata", "text", "reasoning", "prompt")},
        "conversation": {"anyOf": [_OBJECT, _STRING]},
        "truncation": {"enum": list(TRUNCATIONS)},
        "include": {"type": "array", "items": _STRING},
        "stream_options": _OBJECT,
    }, ("model",), anyOf=[{"required": ["input"]}, {"required": ["previous_response_id"]},
                          {"required": ["prompt"]}],
        dependentSchemas=_only_when_streaming("stream_options"))


_TOKEN = _int(0, (1 << 64) - 1)
_TOKENS: Schema = {"type": "array", "minItems": 1, "maxItems": MAX_EMBEDDING_INPUTS,
                   "items": _TOKEN}


def embeddings() -> Schema:
    return _obj({
        "model": _MODEL,
        "input": {"anyOf": [
            {"type": "string", "minLength": 1},
            {"type": "array", "minItems": 1, "maxItems": MAX_EMBEDDING_INPUTS,
             "items": {"type": "string", "minLength": 1}},
            _TOKENS,
            {"type": "array", "minItems": 1, "maxItems": MAX_EMBEDDING_INPUTS,
             "items": {"type": "array", "minItems": 1, "items": _TOKEN}},
        ]},
        "encoding_format": {"enum": list(ENCODINGS)},
        "dimensions": _int(1),
        "user": _STRING,
        "stream": {"const": False},
    }, ("model", "input"), description=(
        "Also bounded by inputs x dimensions: a request whose response could outgrow "
        "the gateway's edge.max_response_bytes is a 400 before any work."))


_BLOCK: Schema = {"anyOf": [
    _obj({"type": {"const": "text"}, "text": _STRING}, ("type", "text")),
    _obj({"type": {"const": "image"}, "source": _OBJECT}, ("type", "source")),
    _obj({"type": {"const": "tool_use"}, **_strings("id", "name"), "input": _OBJECT},
         ("type", "id", "name")),
    _obj({"type": {"const": "tool_result"}, "tool_use_id": _STRING, "content": {"anyOf": [
        _STRING, {"type": "array", "items": _obj({"type": {"const": "text"}, "text": _STRING},
                                                 ("type", "text"))}]}},
         ("type", "tool_use_id")),
]}


_SYSTEM: Schema = {"anyOf": [_STRING, {"type": "array", "items": _obj(
    {"type": {"const": "text"}, "text": _STRING}, ("type", "text"))}]}


def anthropic_messages(max_tokens: int, *, count_tokens: bool = False) -> Schema:
    required = ("model", "messages") if count_tokens else ("model", "max_tokens", "messages")
    return _obj({
        "model": _MODEL,
        "max_tokens": _int(1, max_tokens),
        "messages": {"type": "array", "minItems": 1, "items": {"anyOf": [
            _obj({"role": {"enum": [r for r in messages.ROLES if r != "system"]},
                  "content": {"anyOf": [_STRING, {"type": "array", "items": _BLOCK}]}},
                 ("role", "content")),
            # a system turn holds what the top-level system does
            _obj({"role": {"const": "system"}, "content": _SYSTEM}, ("role", "content"))]}},
        "system": _SYSTEM,
        "stop_sequences": _stop_strings(messages.MAX_STOP_SEQUENCES),
        "temperature": _number(0.0, 1.0),
        "top_p": _number(0.0, 1.0),
        "top_k": _int(0),
        "tools": {"type": "array", "items": _obj(
            {"name": _STRING, "type": _STRING, "input_schema": _OBJECT},
            ("name",), anyOf=[{"required": ["type"], "properties": {
                "type": {"type": "string", "not": {"const": "custom"}}}},
                {"required": ["input_schema"]}])},
        "tool_choice": {"anyOf": [
            _obj({"type": {"const": "tool"}, "name": _STRING}, ("type", "name")),
            _obj({"type": {"enum": [c for c in messages.TOOL_CHOICE_TYPES if c != "tool"]}},
                 ("type",))]},
        "metadata": _obj({"user_id": _STRING}),
        "stream": _BOOL,
    }, required)


def batch_create() -> Schema:
    return _obj({
        "input_file_id": {"type": "string", "pattern": "^file-[0-9a-f]{32}$"},
        "endpoint": {"enum": list(ENDPOINTS)},
        "completion_window": {"type": "string", "pattern": "^[1-9][0-9]*[smh]$",
                              "description": "'24h', or a shorter '<n>s|m|h' up to the "
                                             "gateway's batch.max_window."},
        "metadata": {"type": "object", "maxProperties": 16,
                     "propertyNames": {"maxLength": 64},
                     "additionalProperties": {"type": "string", "maxLength": 512}},
    }, ("input_file_id", "endpoint", "completion_window"))


def message_batch(max_requests: int) -> Schema:
    return _obj({"requests": {"type": "array", "minItems": 1, "maxItems": max_requests,
                              "items": _obj({
                                  "custom_id": {"type": "string",
                                                "pattern": "^[a-zA-Z0-9_-]{1,64}$"},
                                  "params": {"$ref": "#/components/schemas/MessagesRequest"}},
                                  ("custom_id", "params"))}},
                ("requests",), description="Each custom_id unique in the batch.")


def request_schemas(max_tokens: int, max_batch_requests: int) -> dict[str, Schema]:
    """Every request body schema by its component name; ``max_tokens`` is the
    largest output token limit of any configured model, ``max_batch_requests``
    the most requests a Message Batch may hold (``batch.max_lines``)."""
    return {
        "MessageBatchRequest": message_batch(max_batch_requests),
        "ChatCompletionRequest": chat(max_tokens),
        "CompletionRequest": completions(max_tokens),
        "ResponseRequest": responses(max_tokens),
        "EmbeddingRequest": embeddings(),
        "MessagesRequest": anthropic_messages(max_tokens),
        "CountTokensRequest": anthropic_messages(max_tokens, count_tokens=True),
        "BatchRequest": batch_create(),
        "FileUpload": _obj({"file": {"type": "string", "contentMediaType":
                                     "application/octet-stream"},
                            "purpose": {"const": "batch"}}, ("file", "purpose")),
        JSON_VALUE: _JSON_VALUE,
        MODEL_NAME: {"type": "string", "minLength": 1,
                     "description": "GET /v1/models lists the models your key may use."},
        "Error": _obj({"error": _obj({"message": _STRING, "type": _STRING,
                                      "param": {"type": ["string", "null"]},
                                      "code": {"type": ["string", "null"]}},
                                     ("message", "type"))}, ("error",)),
    }
