"""Strict, bounded JSON (tidegate.validation.jsonbody) and the OpenAI field
checks (tidegate.validation.openai_fields)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tidegate.apis import validate_request as validate
from tidegate.config import ModelConfig
from tidegate.errors import ApiError
from tidegate.validation.jsonbody import parse_object
from tidegate.wire.protocol import Api

SIM = ModelConfig(name="tidegate-sim")
MODELS = {"tidegate-sim": SIM}
USER = [{"role": "user", "content": "hi"}]


def refused(raw: bytes, max_depth: int = 64) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse_object(raw, max_depth)
    assert info.value.status == 400
    assert info.value.code == "invalid_json"
    return info.value


def test_the_issues_200000_levels_is_a_400_naming_the_limit() -> None:
    for opener, closer in ((b"[", b"]"), (b'{"a":', b"}")):
        deep = b'{"x":' + opener * 200_000 + b"1" + closer * 200_000 + b"}"
        error = refused(deep)
        assert "64" in error.message


@pytest.mark.parametrize("depth", [63, 64])
def test_depth_at_the_limit_passes(depth: int) -> None:
    # The top-level object is level 1.
    raw = b'{"x":' + b"[" * (depth - 1) + b"]" * (depth - 1) + b"}"
    assert parse_object(raw, 64)["x"] is not None


def test_one_level_past_the_limit_is_refused_however_spelled() -> None:
    raw = b'{"x":' + b"[" * 64 + b"]" * 64 + b"}"
    assert "64" in refused(raw).message
    mixed = b'{"x":' + b'[{"y":' * 32 + b"1" + b"}]" * 32 + b"}"
    assert "64" in refused(mixed).message


def test_many_brackets_but_shallow_passes() -> None:
    # Past the bracket count that triggers the walk, but only 3 levels deep.
    raw = json.dumps({"a": [[1] for _ in range(500)], "b": "[[[[{{{{" * 100}).encode()
    assert len(parse_object(raw, 64)["a"]) == 500


@pytest.mark.parametrize("raw", [
    b'{"a": NaN}', b'{"a": Infinity}', b'{"a": -Infinity}', b'{"a": 1e999}',
    b'{"a": -1e999}', b'{"a": ' + b"9" * 5000 + b"}", b'{"a": "\xff"}',
    b'{"a": "\xed\xa0\x80"}', b'{"a": "\\ud800"}', b'{"a": "\\udc00x"}', b"\xef\xbb\xbf{}",
    b'{"a": 1} {"b": 2}', b"", b"{", b'{"a":}', b"\x00", b"{'a': 1}", b'{"a": 01}',
    b'{"a": .5}', b'{"a": 1.}', b'{"a": "tab\there"}',
])
def test_not_strict_json_is_a_400(raw: bytes) -> None:
    refused(raw)


def test_huge_exact_integer_is_kept_for_a_clear_wire_error() -> None:
    # Within JSON but past 64 bits: kept exact (orjson would round it to a
    # float); the edge's publish answers 400 invalid_value when it reaches the wire.
    assert parse_object(b'{"a": 123456789012345678901234567890}', 64)["a"] == \
        123456789012345678901234567890


@pytest.mark.parametrize("raw", [
    b'{"model": "a", "model": "b"}',
    b'{"model": "a", "mod\\u0065l": "b"}',
    b'{"stream": true, "x": 1, "stream": false}',
])
def test_duplicate_top_level_key_is_refused(raw: bytes) -> None:
    error = refused(raw)
    assert error.param in ("model", "stream")


def test_duplicate_spelling_inside_a_string_or_nested_object_passes() -> None:
    raw = json.dumps({"model": "m", "messages": [{"role": "user", "content": '"model"'}],
                      "tools": [{"model": 1}, {"model": 2}], "note": "caf\u00e9"}).encode()
    assert parse_object(raw, 64)["model"] == "m"


@settings(max_examples=200, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1)
                    | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
                    lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=5), inner, max_size=4),
                    max_leaves=30))
def test_any_json_value_round_trips_or_is_a_400(value: Any) -> None:
    raw = json.dumps({"v": value}).encode()
    assert parse_object(raw, 64) == {"v": value}


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_arbitrary_bytes_never_raise_anything_but_a_400(raw: bytes) -> None:
    status = 200
    try:
        validate(raw, Api.CHAT, MODELS)
    except ApiError as error:
        status = error.status
    assert status == 200 or 400 <= status < 500


# --------------------------------------------------------------------------
# Known OpenAI fields
# --------------------------------------------------------------------------


def chat_error(**fields: Any) -> ApiError:
    body = {"model": "tidegate-sim", "messages": USER, **fields}
    with pytest.raises(ApiError) as info:
        validate(json.dumps(body).encode(), Api.CHAT, MODELS)
    assert info.value.status == 400
    return info.value


def chat_ok(**fields: Any) -> None:
    body = {"model": "tidegate-sim", "messages": USER, **fields}
    assert validate(json.dumps(body).encode(), Api.CHAT, MODELS).body == body


TOOL = {"type": "function", "function": {"name": "get_weather", "description": "d",
                                         "parameters": {"type": "object"}, "strict": True}}


@pytest.mark.parametrize(("fields", "param"), [
    ({"tools": "all"}, "tools"),
    ({"tools": [1]}, "tools[0]"),
    ({"tools": [TOOL, {"type": "function"}]}, "tools[1].function"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
     "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"function": {"name": "f"}}]}, "tools[0].type"),
    ({"tools": [TOOL] * 129}, "tools"),
    ({"tool_choice": "always"}, "tool_choice"),
    ({"tool_choice": 3}, "tool_choice"),
    ({"tool_choice": {"type": "function"}}, "tool_choice.function"),
    ({"tool_choice": {"type": "function", "function": {"name": 5}}},
     "tool_choice.function.name"),
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"response_format": {}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": []}}},
     "response_format.json_schema.schema"),
    ({"logit_bias": [1, 2]}, "logit_bias"),
    ({"logit_bias": {str(i): 1 for i in range(50_000)}}, "logit_bias"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"50256": 101}}, "logit_bias.50256"),
    ({"logit_bias": {"50256": "x"}}, "logit_bias.50256"),
    ({"seed": 1.5}, "seed"),
    ({"seed": "42"}, "seed"),
    ({"seed": 2**64}, "seed"),
    ({"logprobs": 1}, "logprobs"),
    ({"top_logprobs": 5}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": "5"}, "top_logprobs"),
    ({"user": 7}, "user"),
    ({"metadata": {"a": 1}}, "metadata.a"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"messages": [{"role": "user", "content": [1]}]}, "messages[0].content[0]"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"n": 2}, "n"),
])
def test_known_field_of_wrong_shape_names_its_param(fields: dict[str, Any], param: str) -> None:
    assert chat_error(**fields).param == param


def test_valid_known_fields_and_unknown_fields_pass_through() -> None:
    chat_ok(tools=[TOOL], tool_choice="auto", parallel_tool_calls=False,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "r", "schema": {"type": "object"},
                                             "strict": True}},
            logit_bias={"50256": -100, "1": 2.5}, seed=-(2**63), logprobs=True, top_logprobs=20,
            user="u", metadata={"k": "v"}, top_k=40, repetition_penalty=1.1,
            tools_extra={"anything": [1, {"x": None}]})
    chat_ok(tool_choice={"type": "function", "function": {"name": "get_weather"}},
            tools=[TOOL, {"type": "custom", "custom": {"whatever": 1}}])
    chat_ok(response_format={"type": "json_object"})


def test_completion_fields() -> None:
    def error(**fields: Any) -> ApiError:
        body = {"model": "tidegate-sim", "prompt": "p", **fields}
        with pytest.raises(ApiError) as info:
            validate(json.dumps(body).encode(), Api.COMPLETIONS, MODELS)
        return info.value

    assert error(logprobs=6).param == "logprobs"
    assert error(logprobs=True).param == "logprobs"
    assert error(best_of=3).param == "best_of"
    assert error(echo="no").param == "echo"
    ok = {"model": "tidegate-sim", "prompt": "p", "logprobs": 5, "echo": True, "suffix": "s"}
    assert validate(json.dumps(ok).encode(), Api.COMPLETIONS, MODELS).body == ok
