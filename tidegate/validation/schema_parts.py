"""The parts the request schemas are built of (JSON Schema 2020-12, as
OpenAPI 3.1 takes them): scalars, objects open to vendor fields, content parts.

Each dialect's validator module builds its endpoint's schema from these, beside
its checks, so a field is added to one module (``tidegate.validation.schemas``
assembles them for ``/openapi.json``; docs/security.md, "Schema fuzzing").
"""

from __future__ import annotations

from typing import Any

Schema = dict[str, Any]
MODEL_NAME = "ModelName"
INT64 = 1 << 63

JSON_VALUE = "JsonValue"
STRING: Schema = {"type": "string"}
BOOL: Schema = {"type": "boolean"}
ANY: Schema = {"$ref": f"#/components/schemas/{JSON_VALUE}"}
OBJECT: Schema = {"type": "object", "additionalProperties": ANY}
MODEL: Schema = {"$ref": f"#/components/schemas/{MODEL_NAME}"}
# Any JSON value a body may hold anywhere: its integers must fit the broker's
# encoding (msgpack: -2^63 .. 2^64-1; tidegate.wire.protocol.Request.encode).
JSON_VALUE_SCHEMA: Schema = {"anyOf": [
    {"type": ["null", "boolean", "string"]},
    {"type": "number", "minimum": -INT64, "maximum": (1 << 64) - 1},
    {"type": "array", "items": ANY},
    OBJECT,
]}


def integer(minimum: int, maximum: int | None = None) -> Schema:
    schema: Schema = {"type": "integer", "minimum": minimum}
    if maximum is not None:
        schema["maximum"] = maximum
    return schema


def number(low: float, high: float) -> Schema:
    return {"type": "number", "minimum": low, "maximum": high}


def obj(properties: dict[str, Schema], required: tuple[str, ...] = (), **more: Any) -> Schema:
    schema: Schema = {"type": "object", "properties": properties, "additionalProperties": ANY}
    if required:
        schema["required"] = list(required)
    schema.update(more)
    return schema


def only_when_streaming(field: str) -> Schema:
    """``field`` is allowed only beside ``stream: true`` (the validators' rule)."""
    return {field: {"required": ["stream"], "properties": {"stream": {"const": True}}}}


def text_part(kind: str, field: str) -> Schema:
    return obj({"type": {"const": kind}, field: STRING}, ("type", field))


def strings(*names: str) -> dict[str, Schema]:
    return {name: STRING for name in names}


DETAIL: Schema = {"enum": ["auto", "low", "high"]}
# Content parts of the types OpenAI defines (generation._PART_STRINGS and
# _PART_OBJECTS); the validator also passes vendor parts of other types.
PARTS: list[Schema] = [
    text_part("text", "text"), text_part("input_text", "text"),
    text_part("output_text", "text"), text_part("refusal", "refusal"),
    obj({"type": {"const": "input_image"}, **strings("image_url", "file_id"),
          "detail": DETAIL}, ("type",)),
    obj({"type": {"const": "input_file"},
          **strings("file_id", "file_data", "file_url", "filename")}, ("type",)),
    obj({"type": {"const": "image_url"}, "image_url": {"anyOf": [
        STRING, obj({"url": STRING, "detail": DETAIL}, ("url",))]}},
         ("type", "image_url")),
    obj({"type": {"const": "input_audio"},
          "input_audio": obj(strings("data", "format"), ("data", "format"))},
         ("type", "input_audio")),
    obj({"type": {"const": "file"},
          "file": obj(strings("file_data", "file_id", "filename"))}, ("type", "file")),
]
CONTENT: Schema = {"anyOf": [STRING, {"type": "array", "items": {"anyOf": PARTS}}]}


def stop_strings(max_items: int, max_chars: int) -> Schema:
    """An array of at most ``max_items`` stop strings of 1 to ``max_chars`` characters."""
    return {"type": "array", "maxItems": max_items,
            "items": {"type": "string", "minLength": 1, "maxLength": max_chars}}
