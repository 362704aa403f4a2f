"""Type checks of the optional OpenAI request fields (sans-I/O).

Each check looks at one known field and raises a 400 whose ``param`` names the
exact place (``tools[2].function.name``) when the value cannot be what the
OpenAI API means by it. A backend would otherwise get ``tools: "all"`` or a
50,000-entry ``logit_bias`` and fail slowly, confusingly, or not at all.
Values are checked for shape, not for the backend's support: a field the
backend ignores still passes. Unknown fields are not looked at.

Limits follow OpenAI's documented ones where it has them (128 tools, 300
``logit_bias`` entries, ``top_logprobs`` 0..20, 16 ``metadata`` pairs).
"""

from __future__ import annotations

import re
from typing import Any

from tidegate.errors import invalid_request
from tidegate.validation.jsonbody import json_type

MAX_TOOLS = 128
MAX_LOGIT_BIAS = 300
MAX_METADATA = 16
_INT64 = 1 << 63
_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
TOOL_CHOICES = frozenset({"none", "auto", "required"})
_RESPONSE_FORMATS = frozenset({"text", "json_object", "json_schema"})


def _type_error(param: str, expected: str, value: Any) -> Exception:
    return invalid_request(f"'{param}' must be {expected}, got {json_type(value)}.", param=param,
                           code="invalid_type")


def _value_error(param: str, message: str) -> Exception:
    return invalid_request(f"'{param}' {message}", param=param, code="invalid_value")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def check_common(body: dict[str, Any]) -> None:
    """Fields both the chat and the completions API share."""
    _seed(body)
    _logit_bias(body)
    _user(body)
    for key in ("echo", "store", "parallel_tool_calls"):
        value = body.get(key)
        if value is not None and not isinstance(value, bool):
            raise _type_error(key, "a boolean", value)


def check_chat(body: dict[str, Any]) -> None:
    """The chat-only fields."""
    check_common(body)
    _tools(body)
    _tool_choice(body)
    _response_format(body)
    _metadata(body)
    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise _type_error("logprobs", "a boolean", logprobs)
    top = body.get("top_logprobs")
    if top is not None:
        if not _is_int(top):
            raise _type_error("top_logprobs", "an integer", top)
        if not 0 <= top <= 20:
            raise _value_error("top_logprobs", f"must be between 0 and 20, got {top}.")
        if logprobs is not True:
            raise _value_error("top_logprobs", "requires 'logprobs' to be true.")
    for key in ("reasoning_effort", "service_tier"):
        value = body.get(key)
        if value is not None and not isinstance(value, str):
            raise _type_error(key, "a string", value)


def check_completion(body: dict[str, Any]) -> None:
    """The legacy completions-only fields."""
    check_common(body)
    logprobs = body.get("logprobs")
    if logprobs is not None:
        if not _is_int(logprobs):
            raise _type_error("logprobs", "an integer", logprobs)
        if not 0 <= logprobs <= 5:
            raise _value_error("logprobs", f"must be between 0 and 5, got {logprobs}.")
    best_of = body.get("best_of")
    if best_of is not None and (not _is_int(best_of) or best_of != 1):
        raise invalid_request("tidegate supports only best_of=1.", param="best_of",
                              code="unsupported_value")
    suffix = body.get("suffix")
    if suffix is not None and not isinstance(suffix, str):
        raise _type_error("suffix", "a string", suffix)


def _seed(body: dict[str, Any]) -> None:
    seed = body.get("seed")
    if seed is None:
        return
    if not _is_int(seed):
        raise _type_error("seed", "an integer", seed)
    if not -_INT64 <= seed < _INT64:
        raise _value_error("seed", "must fit a signed 64-bit integer.")


def _logit_bias(body: dict[str, Any]) -> None:
    bias = body.get("logit_bias")
    if bias is None:
        return
    if not isinstance(bias, dict):
        raise _type_error("logit_bias", "an object mapping token ids to biases", bias)
    if len(bias) > MAX_LOGIT_BIAS:
        raise _value_error("logit_bias", f"may have at most {MAX_LOGIT_BIAS} entries, got "
                                         f"{len(bias)}.")
    for token, value in bias.items():
        if not (token.isascii() and token.isdigit() and len(token) <= 10):
            raise _value_error("logit_bias", f"keys must be token ids (digits), got {token!r}.")
        if not _is_number(value) or not -100 <= value <= 100:
            raise _value_error(f"logit_bias.{token}", "must be a number between -100 and 100.")


def _user(body: dict[str, Any]) -> None:
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise _type_error("user", "a string", user)


def _metadata(body: dict[str, Any]) -> None:
    metadata = body.get("metadata")
    if metadata is None:
        return
    if not isinstance(metadata, dict):
        raise _type_error("metadata", "an object", metadata)
    if len(metadata) > MAX_METADATA:
        raise _value_error("metadata", f"may have at most {MAX_METADATA} entries.")
    for key, value in metadata.items():
        if not isinstance(value, str):
            raise _type_error(f"metadata.{key}", "a string", value)


def _function_name(value: Any, param: str) -> None:
    if not isinstance(value, str):
        raise _type_error(param, "a string", value)
    if not _FUNCTION_NAME.fullmatch(value):
        raise _value_error(param, "must be 1-64 characters of a-z, A-Z, 0-9, '_' and '-'.")


def _tools(body: dict[str, Any]) -> None:
    tools = body.get("tools")
    if tools is None:
        return
    if not isinstance(tools, list):
        raise _type_error("tools", "an array of tool objects", tools)
    if len(tools) > MAX_TOOLS:
        raise _value_error("tools", f"may have at most {MAX_TOOLS} entries, got {len(tools)}.")
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise _type_error(where, "an object", tool)
        kind = tool.get("type")
        if not isinstance(kind, str):
            raise _type_error(f"{where}.type", "a string", kind)
        if kind != "function":
            continue  # other tool kinds ("custom", vendor ones) are the backend's to judge
        function = tool.get("function")
        if not isinstance(function, dict):
            raise _type_error(f"{where}.function", "an object", function)
        _function_name(function.get("name"), f"{where}.function.name")
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise _type_error(f"{where}.function.description", "a string", description)
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise _type_error(f"{where}.function.parameters", "a JSON Schema object",
                              parameters)
        strict = function.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise _type_error(f"{where}.function.strict", "a boolean", strict)


def _tool_choice(body: dict[str, Any]) -> None:
    choice = body.get("tool_choice")
    if choice is None:
        return
    if isinstance(choice, str):
        if choice not in TOOL_CHOICES:
            raise _value_error("tool_choice", f"must be one of {', '.join(sorted(TOOL_CHOICES))} "
                                              f"or an object, got {choice!r}.")
        return
    if not isinstance(choice, dict):
        raise _type_error("tool_choice", "a string or an object", choice)
    kind = choice.get("type")
    if not isinstance(kind, str):
        raise _type_error("tool_choice.type", "a string", kind)
    if kind == "function":
        function = choice.get("function")
        if not isinstance(function, dict):
            raise _type_error("tool_choice.function", "an object", function)
        _function_name(function.get("name"), "tool_choice.function.name")


def _response_format(body: dict[str, Any]) -> None:
    fmt = body.get("response_format")
    if fmt is None:
        return
    if not isinstance(fmt, dict):
        raise _type_error("response_format", "an object", fmt)
    kind = fmt.get("type")
    if kind not in _RESPONSE_FORMATS:
        raise _value_error("response_format.type",
                           f"must be one of {', '.join(sorted(_RESPONSE_FORMATS))}, got "
                           f"{kind!r}." if isinstance(kind, str) else
                           f"must be one of {', '.join(sorted(_RESPONSE_FORMATS))}.")
    if kind != "json_schema":
        return
    schema = fmt.get("json_schema")
    if not isinstance(schema, dict):
        raise _type_error("response_format.json_schema", "an object", schema)
    _function_name(schema.get("name"), "response_format.json_schema.name")
    inner = schema.get("schema")
    if inner is not None and not isinstance(inner, dict):
        raise _type_error("response_format.json_schema.schema", "a JSON Schema object", inner)
    strict = schema.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise _type_error("response_format.json_schema.strict", "a boolean", strict)
