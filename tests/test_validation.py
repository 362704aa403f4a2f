"""OpenAI request body validation (tidegate.validation.generation)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tidegate.apis import validate_request as validate
from tidegate.config import ModelConfig
from tidegate.errors import ApiError
from tidegate.validation.generation import MAX_STOP_CHARS, Validated, parse_json
from tidegate.wire.protocol import Api

SIM = ModelConfig(name="tidegate-sim", aliases=("sim",))
LLAMA = ModelConfig(name="meta-llama/Llama-3.1-8B", aliases=("llama",))
# The two APIs these tests' bodies are for (chat() and completion()); each
# other API's validator has its own tests.
OPENAI = [Api.CHAT, Api.COMPLETIONS]
MODELS = {"tidegate-sim": SIM, "sim": SIM, LLAMA.name: LLAMA, "llama": LLAMA}

USER = [{"role": "user", "content": "hi"}]


def chat(**fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "tidegate-sim", "messages": USER}
    body.update(fields)
    return body


def completion(**fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "tidegate-sim", "prompt": "Once upon"}
    body.update(fields)
    return body


def ok(body: dict[str, Any], api: Api = Api.CHAT) -> Validated:
    return validate(json.dumps(body).encode(), api, MODELS)


def fails(raw: bytes | dict[str, Any], api: Api = Api.CHAT) -> ApiError:
    data = raw if isinstance(raw, bytes) else json.dumps(raw).encode()
    with pytest.raises(ApiError) as info:
        validate(data, api, MODELS)
    return info.value


def assert_400(error: ApiError, param: str | None, code: str) -> None:
    assert error.status == 400
    assert error.type == "invalid_request_error"
    assert error.param == param
    assert error.code == code
    assert error.message


# --------------------------------------------------------------------------
# The body itself
# --------------------------------------------------------------------------


@pytest.mark.parametrize("raw", [b"", b"{", b"not json", b'{"model": }', b"\xff\xfe\x00",
                                 b'{"a": 1} trailing'])
def test_body_not_json(raw: bytes) -> None:
    error = fails(raw)
    assert_400(error, None, "invalid_json")
    assert "JSON" in error.message


@pytest.mark.parametrize(
    ("raw", "described"),
    [(b"[]", "an array"), (b"null", "null"), (b"1", "a number"), (b"\"x\"", "a string"),
     (b"true", "a boolean"), (b"1.5", "a number")],
)
def test_json_not_an_object(raw: bytes, described: str) -> None:
    error = fails(raw)
    assert_400(error, None, "invalid_json")
    assert described in error.message


def test_parse_json_returns_the_object() -> None:
    assert parse_json(b'{"a": [1, {"b": null}]}') == {"a": [1, {"b": None}]}


# --------------------------------------------------------------------------
# model
# --------------------------------------------------------------------------


@pytest.mark.parametrize("api", OPENAI)
def test_model_missing(api: Api) -> None:
    body = chat() if api is Api.CHAT else completion()
    del body["model"]
    assert_400(fails(body, api), "model", "missing_required_parameter")


def test_model_null() -> None:
    assert_400(fails(chat(model=None)), "model", "missing_required_parameter")


@pytest.mark.parametrize("value", [5, ["tidegate-sim"], {"name": "x"}, True])
def test_model_not_a_string(value: Any) -> None:
    assert_400(fails(chat(model=value)), "model", "invalid_type")


@pytest.mark.parametrize("api", OPENAI)
def test_unknown_model_is_404(api: Api) -> None:
    body = chat(model="gpt-9") if api is Api.CHAT else completion(model="gpt-9")
    error = fails(body, api)
    assert error.status == 404
    assert error.type == "invalid_request_error"
    assert error.code == "model_not_found"
    assert error.param == "model"
    assert "'gpt-9'" in error.message
    # No list of the configured models: a restricted key must not learn them.
    assert "tidegate-sim" not in error.message
    assert "/v1/models" in error.message


def test_model_lookup_is_exact() -> None:
    assert fails(chat(model="Tidegate-Sim")).status == 404
    assert fails(chat(model="tidegate-sim ")).status == 404


def test_model_checked_before_messages() -> None:
    error = fails({"model": "gpt-9"})
    assert error.status == 404


# --------------------------------------------------------------------------
# messages
# --------------------------------------------------------------------------


def test_messages_missing() -> None:
    assert_400(fails({"model": "tidegate-sim"}), "messages", "missing_required_parameter")


@pytest.mark.parametrize("value", ["hi", {"role": "user"}, 3, None])
def test_messages_not_a_list(value: Any) -> None:
    assert_400(fails(chat(messages=value)), "messages", "invalid_type")


def test_messages_empty() -> None:
    assert_400(fails(chat(messages=[])), "messages", "empty_array")


@pytest.mark.parametrize("value", ["hi", 1, None, ["user", "hi"]])
def test_message_not_an_object(value: Any) -> None:
    assert_400(fails(chat(messages=[*USER, value])), "messages[1]", "invalid_type")


@pytest.mark.parametrize("role", [None, 1, ["user"]])
def test_role_missing_or_not_a_string(role: Any) -> None:
    message: dict[str, Any] = {"content": "hi"}
    if role is not None:
        message["role"] = role
    assert_400(fails(chat(messages=[message])), "messages[0].role", "invalid_type")


@pytest.mark.parametrize("role", ["bot", "User", "", "model"])
def test_role_unknown(role: str) -> None:
    error = fails(chat(messages=[*USER, {"role": role, "content": "x"}]))
    assert_400(error, "messages[1].role", "invalid_value")
    assert repr(role) in error.message


@pytest.mark.parametrize("content", [5, {"text": "hi"}, True, 1.5])
def test_content_bad_type(content: Any) -> None:
    error = fails(chat(messages=[{"role": "user", "content": content}]))
    assert_400(error, "messages[0].content", "invalid_type")


@pytest.mark.parametrize("role", ["system", "developer", "user"])
def test_content_required_for_roles(role: str) -> None:
    error = fails(chat(messages=[{"role": role}]))
    assert_400(error, "messages[0].content", "missing_required_parameter")
    error = fails(chat(messages=[{"role": role, "content": None}]))
    assert_400(error, "messages[0].content", "missing_required_parameter")


@pytest.mark.parametrize("role", ["assistant", "tool", "function"])
def test_content_optional_for_roles(role: str) -> None:
    ok(chat(messages=[*USER, {"role": role, "content": None, "tool_calls": []}]))


def test_content_parts_accepted() -> None:
    parts = [{"type": "text", "text": "hello"}]
    valid = ok(chat(messages=[{"role": "user", "content": parts}]))
    assert valid.body["messages"][0]["content"] == parts


def test_all_roles_accepted() -> None:
    messages = [{"role": r, "content": "x"}
                for r in ("system", "developer", "user", "assistant", "tool", "function")]
    ok(chat(messages=messages))


def test_completions_do_not_need_messages() -> None:
    ok(completion(), Api.COMPLETIONS)


# --------------------------------------------------------------------------
# prompt (completions)
# --------------------------------------------------------------------------


def test_prompt_missing() -> None:
    error = fails({"model": "tidegate-sim"}, Api.COMPLETIONS)
    assert_400(error, "prompt", "missing_required_parameter")


@pytest.mark.parametrize("prompt", [None, 5, [], [1, 2], ["a", 1], {"text": "a"}, True])
def test_prompt_bad(prompt: Any) -> None:
    assert_400(fails(completion(prompt=prompt), Api.COMPLETIONS), "prompt", "invalid_type")


@pytest.mark.parametrize("prompt", ["", "hello", ["a"], ["a", "b"]])
def test_prompt_good(prompt: Any) -> None:
    assert ok(completion(prompt=prompt), Api.COMPLETIONS).body["prompt"] == prompt


def test_chat_does_not_need_prompt() -> None:
    ok(chat())


# --------------------------------------------------------------------------
# stream / stream_options
# --------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["true", 1, 0, "false", [True], {}])
def test_stream_not_a_bool(value: Any) -> None:
    assert_400(fails(chat(stream=value)), "stream", "invalid_type")


def test_stream_options_without_stream() -> None:
    error = fails(chat(stream_options={"include_usage": True}))
    assert_400(error, "stream_options", "invalid_value")
    error = fails(chat(stream=False, stream_options={"include_usage": True}))
    assert_400(error, "stream_options", "invalid_value")


@pytest.mark.parametrize("value", [True, "yes", [1], 1])
def test_stream_options_not_an_object(value: Any) -> None:
    assert_400(fails(chat(stream=True, stream_options=value)), "stream_options", "invalid_type")


@pytest.mark.parametrize("value", ["true", 1, 0, [True], {}])
def test_include_usage_not_a_bool(value: Any) -> None:
    error = fails(chat(stream=True, stream_options={"include_usage": value}))
    assert_400(error, "stream_options.include_usage", "invalid_type")


@pytest.mark.parametrize(
    ("fields", "stream", "include_usage"),
    [
        ({}, False, False),
        ({"stream": None}, False, False),
        ({"stream": False}, False, False),
        ({"stream": True}, True, False),
        ({"stream": True, "stream_options": None}, True, False),
        ({"stream": True, "stream_options": {}}, True, False),
        ({"stream": True, "stream_options": {"include_usage": None}}, True, False),
        ({"stream": True, "stream_options": {"include_usage": False}}, True, False),
        ({"stream": True, "stream_options": {"include_usage": True}}, True, True),
        ({"stream": False, "stream_options": None}, False, False),
    ],
)
@pytest.mark.parametrize("api", OPENAI)
def test_stream_flags(fields: dict[str, Any], stream: bool, include_usage: bool, api: Api
                      ) -> None:
    body = chat(**fields) if api is Api.CHAT else completion(**fields)
    valid = ok(body, api)
    assert valid.stream is stream
    assert valid.include_usage is include_usage
    assert valid.api is api


# --------------------------------------------------------------------------
# numbers
# --------------------------------------------------------------------------


@pytest.mark.parametrize(("value", "code"), [
    (0, "invalid_value"),
    (-1, "invalid_value"),
    ("5", "invalid_type"),
    (1.5, "invalid_type"),
    (5.0, "invalid_type"),
    (True, "invalid_type"),
    ([5], "invalid_type"),
])
@pytest.mark.parametrize("api", OPENAI)
def test_max_tokens_bad(value: Any, code: str, api: Api) -> None:
    body = chat(max_tokens=value) if api is Api.CHAT else completion(max_tokens=value)
    assert_400(fails(body, api), "max_tokens", code)


@pytest.mark.parametrize("value", [0, -5, "5", 2.5, False])
def test_max_completion_tokens_bad(value: Any) -> None:
    error = fails(chat(max_completion_tokens=value))
    assert error.status == 400
    assert error.param == "max_completion_tokens"


@pytest.mark.parametrize("value", [1, 4096, None])
def test_max_tokens_good(value: Any) -> None:
    ok(chat(max_tokens=value, max_completion_tokens=value))


@pytest.mark.parametrize(("key", "value", "code"), [
    ("temperature", 2.01, "invalid_value"),
    ("temperature", -0.1, "invalid_value"),
    ("temperature", 3, "invalid_value"),
    ("temperature", "1", "invalid_type"),
    ("temperature", True, "invalid_type"),
    ("top_p", 1.5, "invalid_value"),
    ("top_p", -0.01, "invalid_value"),
    ("presence_penalty", 2.5, "invalid_value"),
    ("presence_penalty", -3, "invalid_value"),
    ("frequency_penalty", -2.1, "invalid_value"),
    ("frequency_penalty", [0], "invalid_type"),
])
def test_number_out_of_range_or_wrong_type(key: str, value: Any, code: str) -> None:
    assert_400(fails(chat(**{key: value})), key, code)


@pytest.mark.parametrize(("raw_value", "key"), [(b"NaN", "temperature"),
                                                (b"Infinity", "temperature"),
                                                (b"-Infinity", "top_p")])
def test_non_finite_numbers_rejected(raw_value: bytes, key: str) -> None:
    # NaN and Infinity are not JSON (RFC 8259); Python's parser accepts them, and
    # backends would then get a body they cannot parse, so anywhere in the body
    # they are a JSON error.
    raw = b'{"model": "sim", "messages": [{"role": "user", "content": "x"}], "' + \
        key.encode() + b'": ' + raw_value + b"}"
    error = fails(raw)
    assert error.status == 400
    assert error.code == "invalid_json"
    assert raw_value.decode().lstrip("-") in error.message


@pytest.mark.parametrize(("key", "value"), [
    ("temperature", 0), ("temperature", 2), ("temperature", 0.7), ("top_p", 0),
    ("top_p", 1), ("presence_penalty", -2), ("frequency_penalty", 2.0),
])
def test_numbers_at_range_bounds_accepted(key: str, value: float) -> None:
    assert ok(chat(**{key: value})).body[key] == value


def test_n_two_unsupported() -> None:
    assert_400(fails(chat(n=2)), "n", "unsupported_value")


@pytest.mark.parametrize(("value", "code"), [(0, "invalid_value"), ("1", "invalid_type"),
                                             (1.0, "invalid_type")])
def test_n_bad(value: Any, code: str) -> None:
    assert_400(fails(chat(n=value)), "n", code)


def test_n_one_accepted() -> None:
    ok(chat(n=1))


# --------------------------------------------------------------------------
# stop
# --------------------------------------------------------------------------


@pytest.mark.parametrize("stop", [5, True, [""], ["a", 1], ["a", "b", "c", "d", "e"],
                                  {"x": "y"}, [None]])
def test_stop_bad(stop: Any) -> None:
    assert_400(fails(chat(stop=stop)), "stop", "invalid_type")


@pytest.mark.parametrize("stop", [None, "\n", "", ["a"], ["a", "b", "c", "d"], [],
                                  "x" * MAX_STOP_CHARS, ["x" * MAX_STOP_CHARS] * 4])
def test_stop_good(stop: Any) -> None:
    ok(chat(stop=stop))


@pytest.mark.parametrize("api", [Api.CHAT, Api.COMPLETIONS])
@pytest.mark.parametrize("stop", ["x" * (MAX_STOP_CHARS + 1), ["a", "x" * 120_000],
                                  ["x" * 120_000] * 4])
def test_stop_string_too_long(api: Api, stop: Any) -> None:
    """Issue 44 row 2: four 120,000-character stop strings froze a worker's
    loop for 100 s; refused at the edge, naming the field and the bound."""
    body = chat(stop=stop) if api is Api.CHAT else completion(stop=stop)
    error = fails(body, api)
    assert_400(error, "stop", "invalid_value")
    assert str(MAX_STOP_CHARS) in error.message


# --------------------------------------------------------------------------
# Valid requests
# --------------------------------------------------------------------------


def test_valid_chat_request() -> None:
    body = chat(max_tokens=16, temperature=0.5)
    valid = ok(body)
    assert valid.api is Api.CHAT
    assert valid.model is SIM
    assert valid.body == body
    assert valid.stream is False
    assert valid.include_usage is False


@pytest.mark.parametrize(("name", "model"), [("sim", SIM), ("tidegate-sim", SIM),
                                             ("llama", LLAMA), (LLAMA.name, LLAMA)])
def test_alias_resolution(name: str, model: ModelConfig) -> None:
    valid = ok(chat(model=name))
    assert valid.model is model
    # The client's own spelling stays in the body.
    assert valid.body["model"] == name


def test_vendor_extensions_are_kept() -> None:
    extra = {"top_k": 40, "repetition_penalty": 1.1, "seed": 7, "logit_bias": {"50256": -100},
             "tools": [{"type": "function", "function": {"name": "f"}}], "user": "u-1"}
    valid = ok(chat(**extra))
    for key, value in extra.items():
        assert valid.body[key] == value


def test_valid_completions_request() -> None:
    body = completion(stream=True, stream_options={"include_usage": True}, max_tokens=8,
                      stop=["\n"], echo=False)
    valid = ok(body, Api.COMPLETIONS)
    assert valid.api is Api.COMPLETIONS
    assert valid.model is SIM
    assert valid.stream is True
    assert valid.include_usage is True
    assert valid.body == body


def test_validated_is_frozen() -> None:
    valid = ok(chat())
    with pytest.raises(AttributeError):
        valid.stream = True  # type: ignore[misc]
