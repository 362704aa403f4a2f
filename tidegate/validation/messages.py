"""Validation of Anthropic Messages bodies (``POST /v1/messages`` and
``/v1/messages/count_tokens``), sans-I/O, beside ``tidegate.validation.generation``.

As there, only what tidegate depends on, or whose wrong type would make a
worker's translation or a backend fail confusingly, is checked, with a 400
naming the field (``param``; the edge writes it in Anthropic's error shape).
``max_tokens`` is required, as Anthropic requires it, and bounded by the
model's ``max_output_tokens``. ``system`` turns inside ``messages`` (today's
Claude Code sends them), ``thinking``, ``context_management`` and
``output_config`` are checked for shape only: whether a backend can honour
them is the worker's to say (docs/anthropic.md, "Request fields"). Unknown
fields pass on untouched.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from tidegate.config import ModelConfig
from tidegate.errors import invalid_request
from tidegate.validation.generation import (
    DEFAULT_MAX_DEPTH,
    MAX_STOP_CHARS,
    Validated,
    check_number,
    check_stop_lengths,
    check_token_limit,
    model_for,
    optional_bool,
    optional_int,
    parse_json,
)
from tidegate.validation.jsonbody import json_type
from tidegate.validation.schema_parts import (
    BOOL,
    MODEL,
    OBJECT,
    STRING,
    Schema,
    integer,
    number,
    obj,
    stop_strings,
    strings,
)
from tidegate.wire.protocol import Api

__all__ = ["quota_user", "validate_messages", "validate_messages_body"]

ROLES = ("user", "assistant", "system")
# Anthropic documents no bound on stop_sequences; each becomes a backend stop
# string that is matched on every token, so tidegate sets one (docs/anthropic.md).
MAX_STOP_SEQUENCES = 16
TOOL_CHOICE_TYPES = ("auto", "any", "tool", "none")
# Block types and the string fields each must carry.
_BLOCK_STRINGS = {"text": ("text",), "tool_use": ("id", "name"), "tool_result": ("tool_use_id",)}
# Longer than Claude Code's JSON ids (about 150 characters); bounds the parse.
_MAX_USER_JSON = 1024
_USER_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")


def validate_messages(raw: bytes, api: Api, models: Mapping[str, ModelConfig], *,
                      max_depth: int = DEFAULT_MAX_DEPTH,
                      count_tokens: bool = False) -> Validated:
    """A Messages body; ``api``: the dialect's, which the result names."""
    return validate_messages_body(parse_json(raw, max_depth), api, models,
                                  count_tokens=count_tokens)


def validate_messages_body(body: dict[str, Any], api: Api, models: Mapping[str, ModelConfig],
                           *, count_tokens: bool = False) -> Validated:
    """:func:`validate_messages` for a body already parsed (a WebSocket
    request frame's, parsed with the same strict, depth-bounded parser)."""
    model = model_for(body, models)
    if not count_tokens:
        if body.get("max_tokens") is None:
            raise invalid_request("max_tokens: Field required.", param="max_tokens",
                                  code="missing_required_parameter")
        check_token_limit(body, "max_tokens", model)
    _turns(body)
    _system(body)
    stops = body.get("stop_sequences")
    if stops is not None:
        if not (isinstance(stops, list) and all(isinstance(s, str) and s for s in stops)):
            raise invalid_request("'stop_sequences' must be an array of non-empty strings.",
                                  param="stop_sequences", code="invalid_type")
        if len(stops) > MAX_STOP_SEQUENCES:
            raise invalid_request(f"'stop_sequences' may have at most {MAX_STOP_SEQUENCES} "
                                  f"entries, got {len(stops)}.", param="stop_sequences",
                                  code="invalid_value")
        check_stop_lengths(stops, "stop_sequences")
    check_number(body, "temperature", 0.0, 1.0)
    check_number(body, "top_p", 0.0, 1.0)
    optional_int(body, "top_k", minimum=0)
    _tools(body)
    _tool_choice(body)
    _thinking(body)
    _objects(body, "context_management", "edits")
    _output_config(body)
    # A capacity hint: passed on to an Anthropic backend, which knows its own
    # tiers (auto, standard_only today), and dropped in translation.
    tier = body.get("service_tier")
    if tier is not None and not isinstance(tier, str):
        raise invalid_request(f"'service_tier' must be a string, got {json_type(tier)}.",
                              param="service_tier", code="invalid_type")
    metadata = body.get("metadata")
    if metadata is not None:
        if not isinstance(metadata, dict):
            raise invalid_request(f"'metadata' must be an object, got {json_type(metadata)}.",
                                  param="metadata", code="invalid_type")
        user = metadata.get("user_id")
        if user is not None and not isinstance(user, str):
            raise invalid_request("'metadata.user_id' must be a string.",
                                  param="metadata.user_id", code="invalid_type")
    stream = bool(optional_bool(body, "stream")) and not count_tokens
    return Validated(api=api, model=model, body=body, stream=stream,
                     include_usage=False)


def quota_user(body: Mapping[str, Any]) -> str:
    """``metadata.user_id`` as a quota user (docs/anthropic.md), or "" when
    there is none or it is not usable as one: a quota scope's user is a NATS
    subject token and part of Redis keys, so only letters, digits, ``_`` and
    ``-``, at most 128 of them. Claude Code sends a JSON object as text
    (``{"device_id": ..., "account_uuid": ..., "session_id": ...}``): its
    account, else its device, is the user (the session changes every run)."""
    metadata = body.get("metadata")
    user = metadata.get("user_id") if isinstance(metadata, dict) else None
    if isinstance(user, str) and user.startswith("{") and len(user) <= _MAX_USER_JSON:
        try:
            ids = json.loads(user)
        except (ValueError, RecursionError):
            ids = None
        if isinstance(ids, dict):
            user = ids.get("account_uuid") or ids.get("device_id")
    if isinstance(user, str) and 0 < len(user) <= 128 and _USER_CHARS.issuperset(user):
        return user
    return ""


def _turns(body: dict[str, Any]) -> None:
    turns = body.get("messages")
    if turns is None:
        raise invalid_request("messages: Field required.", param="messages",
                              code="missing_required_parameter")
    if not isinstance(turns, list) or not turns:
        raise invalid_request("'messages' must be a non-empty array.", param="messages",
                              code="invalid_type")
    for i, turn in enumerate(turns):
        where = f"messages[{i}]"
        if not isinstance(turn, dict):
            raise invalid_request(f"'{where}' must be an object, got {json_type(turn)}.",
                                  param=where, code="invalid_type")
        if turn.get("role") not in ROLES:
            raise invalid_request(f"'{where}.role' must be 'user', 'assistant' or 'system'.",
                                  param=f"{where}.role", code="invalid_value")
        content = turn.get("content")
        if turn["role"] == "system":
            _system_text(content, f"{where}.content")
            continue
        if isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise invalid_request(f"'{where}.content' must be a string or an array of content "
                                  f"blocks, got {json_type(content)}.",
                                  param=f"{where}.content", code="invalid_type")
        _blocks(content, f"{where}.content", turn["role"])


def _blocks(blocks: list[Any], where: str, role: str) -> None:
    for j, block in enumerate(blocks):
        at = f"{where}[{j}]"
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise invalid_request(f"'{at}' must be a content block object with a string "
                                  "'type'.", param=at, code="invalid_type")
        kind = block["type"]
        for name in _BLOCK_STRINGS.get(kind, ()):
            if not isinstance(block.get(name), str):
                raise invalid_request(f"'{at}.{name}' must be a string.", param=f"{at}.{name}",
                                      code="invalid_type")
        if kind == "tool_use" and not isinstance(block.get("input", {}), dict):
            raise invalid_request(f"'{at}.input' must be an object.", param=f"{at}.input",
                                  code="invalid_type")
        if kind == "image" and not isinstance(block.get("source"), dict):
            raise invalid_request(f"'{at}.source' must be an object.", param=f"{at}.source",
                                  code="invalid_type")
        if kind == "tool_result":
            content = block.get("content")
            if isinstance(content, list):
                _blocks(content, f"{at}.content", role)
            elif content is not None and not isinstance(content, str):
                raise invalid_request(f"'{at}.content' must be a string or an array.",
                                      param=f"{at}.content", code="invalid_type")


def _system(body: dict[str, Any]) -> None:
    if body.get("system") is not None:
        _system_text(body["system"], "system")


def _system_text(system: Any, where: str) -> None:
    """A system prompt: a string or text blocks (the top-level ``system`` or
    a ``system`` turn's content)."""
    if isinstance(system, str):
        return
    if not isinstance(system, list) or not all(
            isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str)
            for b in system):
        raise invalid_request(f"'{where}' must be a string or an array of text blocks.",
                              param=where, code="invalid_type")


def _thinking(body: dict[str, Any]) -> None:
    thinking = body.get("thinking")
    if thinking is None:
        return
    # Its type is not checked against the ones known today (enabled,
    # adaptive, disabled): translation drops it whatever it is, and a
    # passthrough backend knows its own.
    if not isinstance(thinking, dict) or not isinstance(thinking.get("type"), str):
        raise invalid_request("'thinking' must be an object with a string 'type' (enabled, "
                              "adaptive, disabled).", param="thinking", code="invalid_type")
    budget = thinking.get("budget_tokens")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int)
                               or budget < 1):
        raise invalid_request("'thinking.budget_tokens' must be an integer >= 1.",
                              param="thinking.budget_tokens", code="invalid_value")
    display = thinking.get("display")
    if display is not None and not isinstance(display, str):
        raise invalid_request("'thinking.display' must be a string.", param="thinking.display",
                              code="invalid_type")


def _objects(body: dict[str, Any], key: str, items: str) -> None:
    """``body[key]``, when there, is an object whose ``items`` (when there) is
    an array of objects each with a string ``type``."""
    value = body.get(key)
    if value is None:
        return
    if not isinstance(value, dict):
        raise invalid_request(f"'{key}' must be an object, got {json_type(value)}.",
                              param=key, code="invalid_type")
    listed = value.get(items)
    if listed is None:
        return
    if not isinstance(listed, list):
        raise invalid_request(f"'{key}.{items}' must be an array.", param=f"{key}.{items}",
                              code="invalid_type")
    for i, item in enumerate(listed):
        if not isinstance(item, dict) or not isinstance(item.get("type"), str):
            raise invalid_request(f"'{key}.{items}[{i}]' must be an object with a string "
                                  "'type'.", param=f"{key}.{items}[{i}]", code="invalid_type")


def _output_config(body: dict[str, Any]) -> None:
    config = body.get("output_config")
    if config is None:
        return
    if not isinstance(config, dict):
        raise invalid_request(f"'output_config' must be an object, got {json_type(config)}.",
                              param="output_config", code="invalid_type")
    effort = config.get("effort")
    if effort is not None and not isinstance(effort, str):
        raise invalid_request("'output_config.effort' must be a string.",
                              param="output_config.effort", code="invalid_type")
    output_format = config.get("format")
    if output_format is not None and (not isinstance(output_format, dict)
                                      or not isinstance(output_format.get("type"), str)):
        raise invalid_request("'output_config.format' must be an object with a string "
                              "'type'.", param="output_config.format", code="invalid_type")


def _tools(body: dict[str, Any]) -> None:
    tools = body.get("tools")
    if tools is None:
        return
    if not isinstance(tools, list):
        raise invalid_request(f"'tools' must be an array, got {json_type(tools)}.",
                              param="tools", code="invalid_type")
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
            raise invalid_request(f"'{where}' must be an object with a string 'name'.",
                                  param=where, code="invalid_type")
        kind = tool.get("type")
        if kind is not None and not isinstance(kind, str):
            raise invalid_request(f"'{where}.type' must be a string.", param=f"{where}.type",
                                  code="invalid_type")
        if kind in (None, "custom") and not isinstance(tool.get("input_schema"), dict):
            raise invalid_request(f"'{where}.input_schema' must be an object.",
                                  param=f"{where}.input_schema", code="invalid_type")


def _tool_choice(body: dict[str, Any]) -> None:
    choice = body.get("tool_choice")
    if choice is None:
        return
    if not isinstance(choice, dict) or choice.get("type") not in TOOL_CHOICE_TYPES:
        raise invalid_request("'tool_choice' must be an object whose 'type' is one of "
                              f"{', '.join(TOOL_CHOICE_TYPES)}.", param="tool_choice",
                              code="invalid_value")
    if choice["type"] == "tool" and not isinstance(choice.get("name"), str):
        raise invalid_request("'tool_choice.name' must be a string for type 'tool'.",
                              param="tool_choice.name", code="invalid_type")


# -- the request schemas (/openapi.json; tidegate.validation.schemas) --------------

_BLOCK: Schema = {"anyOf": [
    obj({"type": {"const": "text"}, "text": STRING}, ("type", "text")),
    obj({"type": {"const": "image"}, "source": OBJECT}, ("type", "source")),
    obj({"type": {"const": "tool_use"}, **strings("id", "name"), "input": OBJECT},
         ("type", "id", "name")),
    obj({"type": {"const": "tool_result"}, "tool_use_id": STRING, "content": {"anyOf": [
        STRING, {"type": "array", "items": obj({"type": {"const": "text"}, "text": STRING},
                                                 ("type", "text"))}]}},
         ("type", "tool_use_id")),
]}


_SYSTEM: Schema = {"anyOf": [STRING, {"type": "array", "items": obj(
    {"type": {"const": "text"}, "text": STRING}, ("type", "text"))}]}


def messages_schema(max_tokens: int, *, count_tokens: bool = False) -> Schema:
    required = ("model", "messages") if count_tokens else ("model", "max_tokens", "messages")
    return obj({
        "model": MODEL,
        "max_tokens": integer(1, max_tokens),
        "messages": {"type": "array", "minItems": 1, "items": {"anyOf": [
            obj({"role": {"enum": [r for r in ROLES if r != "system"]},
                  "content": {"anyOf": [STRING, {"type": "array", "items": _BLOCK}]}},
                 ("role", "content")),
            # a system turn holds what the top-level system does
            obj({"role": {"const": "system"}, "content": _SYSTEM}, ("role", "content"))]}},
        "system": _SYSTEM,
        "stop_sequences": stop_strings(MAX_STOP_SEQUENCES, MAX_STOP_CHARS),
        "temperature": number(0.0, 1.0),
        "top_p": number(0.0, 1.0),
        "top_k": integer(0),
        "tools": {"type": "array", "items": obj(
            {"name": STRING, "type": STRING, "input_schema": OBJECT},
            ("name",), anyOf=[{"required": ["type"], "properties": {
                "type": {"type": "string", "not": {"const": "custom"}}}},
                {"required": ["input_schema"]}])},
        "tool_choice": {"anyOf": [
            obj({"type": {"const": "tool"}, "name": STRING}, ("type", "name")),
            obj({"type": {"enum": [c for c in TOOL_CHOICE_TYPES if c != "tool"]}},
                 ("type",))]},
        "metadata": obj({"user_id": STRING}),
        "service_tier": STRING,
        "stream": BOOL,
    }, required)
