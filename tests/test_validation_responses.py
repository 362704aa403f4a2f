"""Validation of Responses and Embeddings bodies (sans-I/O), and their token
estimates and simulator answers."""

from __future__ import annotations

import asyncio
import base64
import json
import struct
import threading
from typing import Any

import pytest

from tidegate.apis import completion_cap, estimate_prompt_tokens, reservation, validate_request
from tidegate.config import ModelConfig, SimulatorConfig, WorkerConfig
from tidegate.errors import ApiError, BackendError
from tidegate.validation.responses import embeddings_size
from tidegate.wire.protocol import Api, Request
from workers.backends import simulator_responses
from workers.backends.simulator import SimulatorBackend
from workers.backends.simulator_responses import embed

MODELS = {"m": ModelConfig(name="m")}


def ok(api: Api, body: dict[str, Any]) -> Any:
    return validate_request(json.dumps(body).encode(), api, MODELS)


def bad(api: Api, body: dict[str, Any]) -> ApiError:
    with pytest.raises(ApiError) as info:
        ok(api, body)
    return info.value


@pytest.mark.parametrize("body", [
    {"model": "m", "input": "hi"},
    {"model": "m", "input": [{"role": "user", "content": "hi"}], "stream": True,
     "instructions": "be brief", "max_output_tokens": 16, "tools": [{"type": "web_search"}],
     "tool_choice": "auto", "reasoning": {"effort": "low"}, "truncation": "auto",
     "include": ["reasoning.encrypted_content"], "stream_options": {"include_obfuscation": False},
     "unknown_vendor_field": [1, 2]},
    {"model": "m", "input": [{"type": "function_call_output", "call_id": "c", "output": "4"}]},
    {"model": "m", "previous_response_id": "resp_1"},
])
def test_valid_responses_bodies_pass_untouched(body: dict[str, Any]) -> None:
    valid = ok(Api.RESPONSES, body)
    assert valid.body == body
    assert valid.stream is bool(body.get("stream"))
    assert valid.api is Api.RESPONSES


@pytest.mark.parametrize(("body", "param", "code"), [
    ({"input": "x"}, "model", "missing_required_parameter"),
    ({"model": "m"}, "input", "missing_required_parameter"),
    ({"model": "m", "input": 5}, "input", "invalid_type"),
    ({"model": "m", "input": ["x"]}, "input[0]", "invalid_type"),
    ({"model": "m", "input": [{"content": "x"}]}, "input[0]", "missing_required_parameter"),
    ({"model": "m", "input": [{"role": "user", "content": 3}]}, "input[0].content",
     "invalid_type"),
    ({"model": "m", "input": "x", "instructions": 1}, "instructions", "invalid_type"),
    ({"model": "m", "input": "x", "max_output_tokens": 0}, "max_output_tokens",
     "invalid_value"),
    ({"model": "m", "input": "x", "temperature": 3}, "temperature", "invalid_value"),
    ({"model": "m", "input": "x", "tools": [{"name": "f"}]}, "tools[0]", "invalid_type"),
    ({"model": "m", "input": "x", "tool_choice": "sometimes"}, "tool_choice", "invalid_value"),
    ({"model": "m", "input": "x", "stream": "yes"}, "stream", "invalid_type"),
    ({"model": "m", "input": "x", "stream_options": {}}, "stream_options", "invalid_value"),
    ({"model": "m", "input": "x", "background": 1}, "background", "invalid_type"),
    ({"model": "m", "input": "x", "truncation": "maybe"}, "truncation", "invalid_value"),
    ({"model": "m", "input": "x", "metadata": []}, "metadata", "invalid_type"),
])
def test_invalid_responses_bodies(body: dict[str, Any], param: str, code: str) -> None:
    error = bad(Api.RESPONSES, body)
    assert error.status == 400
    assert (error.param, error.code) == (param, code)


def test_unknown_model_is_404() -> None:
    assert bad(Api.RESPONSES, {"model": "zz", "input": "x"}).status == 404
    assert bad(Api.EMBEDDINGS, {"model": "zz", "input": "x"}).status == 404


@pytest.mark.parametrize("body", [
    {"model": "m", "input": "hi"},
    {"model": "m", "input": ["a", "b"], "encoding_format": "base64", "dimensions": 8},
    {"model": "m", "input": [1, 2, 3]},
    {"model": "m", "input": [[1, 2], [3]], "user": "u", "vendor": True},
])
def test_valid_embeddings_bodies(body: dict[str, Any]) -> None:
    valid = ok(Api.EMBEDDINGS, body)
    assert valid.body == body
    assert not valid.stream


@pytest.mark.parametrize(("body", "param"), [
    ({"model": "m"}, "input"),
    ({"model": "m", "input": ""}, "input"),
    ({"model": "m", "input": []}, "input"),
    ({"model": "m", "input": ["a", 3]}, "input[1]"),
    ({"model": "m", "input": ["a", ""]}, "input[1]"),
    ({"model": "m", "input": [[1], []]}, "input[1]"),
    ({"model": "m", "input": ["a"] * 2049}, "input"),
    ({"model": "m", "input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"model": "m", "input": "x", "dimensions": 0}, "dimensions"),
    ({"model": "m", "input": "x", "stream": True}, "stream"),
])
def test_invalid_embeddings_bodies(body: dict[str, Any], param: str) -> None:
    error = bad(Api.EMBEDDINGS, body)
    assert error.status == 400
    assert error.param == param


def test_chat_still_goes_through_the_chat_validator() -> None:
    assert bad(Api.CHAT, {"model": "m"}).param == "messages"


def test_token_estimates() -> None:
    text = "The quick brown fox jumps over the lazy dog. " * 10
    chat = estimate_prompt_tokens(Api.CHAT, {"messages": [{"role": "user", "content": text}]})
    resp_str = estimate_prompt_tokens(Api.RESPONSES, {"input": text})
    resp_items = estimate_prompt_tokens(Api.RESPONSES, {
        "input": [{"role": "user", "content": [{"type": "input_text", "text": text}]}]})
    assert resp_str == resp_items == chat
    with_instructions = estimate_prompt_tokens(Api.RESPONSES, {"input": text,
                                                               "instructions": text})
    assert with_instructions > resp_str
    emb = estimate_prompt_tokens(Api.EMBEDDINGS, {"input": text})
    assert emb == estimate_prompt_tokens(Api.COMPLETIONS, {"prompt": text})
    # One ceil over the sum, not per input.
    assert estimate_prompt_tokens(Api.EMBEDDINGS, {"input": [text, text]}) in (2 * emb - 1,
                                                                                2 * emb)
    assert estimate_prompt_tokens(Api.EMBEDDINGS, {"input": [1, 2, 3]}) == 3
    assert completion_cap(Api.EMBEDDINGS, {"input": text}, 1024) == 0
    assert reservation(Api.EMBEDDINGS, {"input": text}, 1024) == emb
    assert completion_cap(Api.RESPONSES, {"max_output_tokens": 50}, 1024) == 50
    assert completion_cap(Api.RESPONSES, {}, 1024) == 1024


def _request(api: Api, body: dict[str, Any], stream: bool) -> Request:
    return Request(id="abc", reply="r", model="m", api=api, stream=stream, body=body,
                   created_ms=0, deadline_ms=0, window_bytes=1, window_msgs=1)


async def _run(api: Api, body: dict[str, Any], stream: bool) -> bytes:
    backend = SimulatorBackend(ModelConfig(name="m", simulator=SimulatorConfig(
        ttft=0.0, tokens_per_second=10000.0, length=6)))
    s = await backend.open(_request(api, body, stream))
    out = b""
    while data := await s.read(1 << 16):
        out += data
    return out


def test_simulator_responses_stream_is_deterministic_and_numbered() -> None:
    body = {"model": "m", "input": "hello", "stream": True}
    a = asyncio.run(_run(Api.RESPONSES, body, True))
    b = asyncio.run(_run(Api.RESPONSES, body, True))
    assert a == b
    events = [json.loads(e.split(b"data: ", 1)[1]) for e in a.split(b"\n\n")[:-1]]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert len(events) == 4 + 6 + 4
    assert events[-1]["response"]["usage"]["output_tokens"] == 6
    other = asyncio.run(_run(Api.RESPONSES, {**body, "input": "bye"}, True))
    assert other != a


def test_simulator_embeddings_float_equals_base64() -> None:
    body: dict[str, Any] = {"model": "m", "input": ["a", "b"], "dimensions": 5}
    floats = json.loads(asyncio.run(_run(Api.EMBEDDINGS, body, False)))
    b64 = json.loads(asyncio.run(_run(Api.EMBEDDINGS, {**body, "encoding_format": "base64"},
                                      False)))
    for f, b in zip(floats["data"], b64["data"], strict=True):
        decoded = list(struct.unpack("<5f", base64.b64decode(b["embedding"])))
        assert f["embedding"] == decoded
    assert floats["data"][0]["embedding"] == embed("a", "m", 5)
    assert abs(sum(v * v for v in embed("a", "m", 5)) - 1.0) < 1e-6
    assert floats["usage"]["prompt_tokens"] == estimate_prompt_tokens(Api.EMBEDDINGS, body)



# -- issue 44 row 3: inputs x dimensions bounded before any vector is made ------------------


def _embeddings(body: dict[str, Any], cap: int) -> Any:
    return validate_request(json.dumps({"model": "m", **body}).encode(), Api.EMBEDDINGS,
                            MODELS, max_response_bytes=cap)


def test_embeddings_past_the_response_cap_are_a_400_at_the_edge() -> None:
    """2,048 inputs x 8,192 dimensions grew a worker from 53 MB to 1.4 GB and
    held its loop 18 s, for a body the edge would then refuse to relay."""
    error = bad(Api.EMBEDDINGS, {"model": "m", "input": ["x"] * 2048, "dimensions": 8192})
    assert (error.status, error.code, error.param) == (400, "invalid_value", "dimensions")
    assert "edge.max_response_bytes" in error.message
    assert str(8 << 20) in error.message
    # The bound is the response's size, so it moves with the cap and the encoding.
    cap = 1 << 20
    admitted = max(n for n in range(1, 2049) if embeddings_size(n, 1024, False) <= cap)
    _embeddings({"input": ["x"] * admitted, "dimensions": 1024}, cap)
    with pytest.raises(ApiError):
        _embeddings({"input": ["x"] * (admitted + 1), "dimensions": 1024}, cap)
    _embeddings({"input": ["x"] * (admitted + 1), "dimensions": 1024,
                 "encoding_format": "base64"}, cap)
    # Without `dimensions`, a simulator model's default size counts; `param` is the input.
    with pytest.raises(ApiError) as info:
        _embeddings({"input": ["x"] * 2048}, 64 << 10)
    assert info.value.param == "input"
    # A backend model's own size is unknown at the edge: its worker bounds the body it reads.
    openai_model = {"o": ModelConfig(name="o", backend="openai", base_url="http://127.0.0.1:1")}
    validate_request(json.dumps({"model": "o", "input": ["x"] * 2048}).encode(),
                     Api.EMBEDDINGS, openai_model, max_response_bytes=64 << 10)


@pytest.mark.parametrize("b64", [False, True])
def test_embeddings_size_bounds_the_simulators_body(b64: bool) -> None:
    for inputs, dims in ((1, 1), (3, 7), (40, 300), (2, 8192)):
        body: dict[str, Any] = {"input": [f"text {i}" * i for i in range(inputs)],
                                "dimensions": dims, "encoding_format": "base64" if b64
                                else "float"}
        raw = asyncio.run(_run(Api.EMBEDDINGS, body, False))
        assert len(raw) <= embeddings_size(inputs, dims, b64), (inputs, dims)


async def test_simulator_embeddings_are_bounded_by_the_worker_and_off_the_loop() -> None:
    """The worker's own cap (it may be smaller than the edge's) refuses before
    any vector is made; the largest admitted body is built in a thread."""
    small = SimulatorBackend(ModelConfig(name="m", simulator=SimulatorConfig(ttft=0.0)),
                             WorkerConfig(max_response_bytes=64 << 10))
    with pytest.raises(BackendError) as info:
        await small.open(_request(Api.EMBEDDINGS, {"input": ["x"] * 64, "dimensions": 256},
                                  False))
    assert (info.value.status, info.value.code) == (400, "invalid_value")
    assert "worker.max_response_bytes" in str(info.value)
    backend = SimulatorBackend(ModelConfig(name="m", simulator=SimulatorConfig(ttft=0.0)))
    inputs = max(n for n in range(1, 2049) if embeddings_size(n, 3072, False) <= 8 << 20)
    body = {"input": ["x"] * inputs, "dimensions": 3072}
    # Off the loop: every vector is made in another thread than the loop's
    # (a check of where, not of how long: a loaded box bounds no duration).
    threads: set[int] = set()
    real_embed = simulator_responses.embed

    def embed(*args: Any) -> list[float]:
        threads.add(threading.get_ident())
        return real_embed(*args)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(simulator_responses, "embed", embed)
        await backend.open(_request(Api.EMBEDDINGS, body, False))
    assert threads
    assert threading.get_ident() not in threads
