"""Every bad input gets an OpenAI-style error with the right status, from the
real edge process (the unit tests in test_validation.py cover each rule; this
checks the HTTP surface end to end: status, JSON shape, headers)."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from collections.abc import Iterator
from email.message import Message
from typing import Any

import pytest

from tests.pipeline import DEV_KEY, Pipeline, running_pipeline

pytestmark = pytest.mark.pipeline

GOOD: dict[str, Any] = {"model": "tidegate-sim", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory, module_nats_url: str,
             module_redis_url: str) -> Iterator[Pipeline]:
    yield from running_pipeline(tmp_path_factory.mktemp("errors"), module_nats_url,
                                module_redis_url, overrides={"edge": {"max_body_bytes": 4096}})


def check_error(status: int, body: bytes, want_status: int, want_code: str | None,
                want_param: str | None = None,
                headers: Message | None = None) -> dict[str, Any]:
    """The OpenAI error shape; with ``headers``, also what they must say: a
    JSON body, and no ``Retry-After`` (retrying a 4xx input error never helps)."""
    assert status == want_status, body
    if headers is not None:
        assert headers["Content-Type"].startswith("application/json"), headers
        assert "Retry-After" not in headers, headers
        assert "x-request-id" not in headers, "no request exists for a refused input"
    payload = json.loads(body)
    error = payload["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    assert isinstance(error["message"], str)
    assert error["message"]
    if want_code is not None:
        assert error["code"] == want_code, error
    if want_param is not None:
        assert error["param"] == want_param, error
    return dict(error)


@pytest.mark.parametrize(
    ("raw", "status", "code", "param"),
    [
        (b"{not json", 400, "invalid_json", None),
        (b"[1, 2]", 400, "invalid_json", None),
        (json.dumps({"messages": GOOD["messages"]}).encode(), 400,
         "missing_required_parameter", "model"),
        (json.dumps({**GOOD, "model": "no-such-model"}).encode(), 404, "model_not_found",
         "model"),
        (json.dumps({**GOOD, "model": 42}).encode(), 400, "invalid_type", "model"),
        (json.dumps({**GOOD, "messages": []}).encode(), 400, "empty_array", "messages"),
        (json.dumps({**GOOD, "messages": "hi"}).encode(), 400, "invalid_type", "messages"),
        (json.dumps({**GOOD, "messages": [{"role": "user", "content": 5}]}).encode(), 400,
         "invalid_type", "messages[0].content"),
        (json.dumps({**GOOD, "stream": "true"}).encode(), 400, "invalid_type", "stream"),
        (json.dumps({**GOOD, "stream": 1}).encode(), 400, "invalid_type", "stream"),
        (json.dumps({**GOOD, "max_tokens": "5"}).encode(), 400, "invalid_type", "max_tokens"),
        (json.dumps({**GOOD, "temperature": 9}).encode(), 400, "invalid_value", "temperature"),
    ],
)
def test_bad_chat_bodies(pipeline: Pipeline, raw: bytes, status: int, code: str,
                         param: str | None) -> None:
    got_status, headers, body = pipeline.post_full("/v1/chat/completions", None, raw=raw)
    check_error(got_status, body, status, code, param, headers)


def test_body_over_limit_is_413(pipeline: Pipeline) -> None:
    big = {**GOOD, "messages": [{"role": "user", "content": "x" * 10_000}]}
    status, headers, body = pipeline.post_full("/v1/chat/completions", big)
    check_error(status, body, 413, "request_too_large", headers=headers)


def test_chunked_body_over_limit_is_413(pipeline: Pipeline) -> None:
    """No Content-Length to check up front: the limit holds while reading."""
    big = json.dumps({**GOOD, "messages": [{"role": "user", "content": "x" * 10_000}]})
    parts = [big[i:i + 1000].encode() for i in range(0, len(big), 1000)]
    req = urllib.request.Request(f"{pipeline.url}/v1/chat/completions", data=iter(parts),
                                 method="POST")
    req.add_header("Content-Type", "application/json")
    req.add_header("Transfer-Encoding", "chunked")
    req.add_header("Authorization", f"Bearer {DEV_KEY}")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            status, body = resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        status, body = exc.code, exc.read()
    check_error(status, body, 413, "request_too_large")


def test_chunked_body_under_limit_is_served(pipeline: Pipeline) -> None:
    raw = json.dumps({**GOOD, "max_tokens": 2}).encode()
    req = urllib.request.Request(f"{pipeline.url}/v1/chat/completions",
                                 data=iter([raw[:10], raw[10:]]), method="POST")
    req.add_header("Content-Type", "application/json")
    req.add_header("Transfer-Encoding", "chunked")
    req.add_header("Authorization", f"Bearer {DEV_KEY}")
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert resp.status == 200
        assert json.loads(resp.read())["object"] == "chat.completion"


def test_completions_without_prompt(pipeline: Pipeline) -> None:
    status, headers, body = pipeline.post_full("/v1/completions", {"model": "tidegate-sim"})
    check_error(status, body, 400, "missing_required_parameter", "prompt", headers)


@pytest.mark.parametrize(("key", "code"), [(None, "missing_api_key"),
                                           ("sk-wrong-key-000000", "invalid_api_key")])
def test_bad_keys_are_401(pipeline: Pipeline, key: str | None, code: str) -> None:
    status, headers, body = pipeline.post_full("/v1/chat/completions", GOOD, key=key)
    error = check_error(status, body, 401, code, headers=headers)
    assert error["type"] == "authentication_error"
    assert "sk-wrong-key-000000" not in error["message"]


def test_models_needs_a_key(pipeline: Pipeline) -> None:
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(f"{pipeline.url}/v1/models", timeout=10)
    check_error(err.value.code, err.value.read(), 401, "missing_api_key")


def test_unknown_route_and_method(pipeline: Pipeline) -> None:
    status, body = pipeline.post("/v1/nothing-here", GOOD)
    check_error(status, body, 404, "not_found")
    req = urllib.request.Request(f"{pipeline.url}/v1/chat/completions",
                                 headers={"Authorization": f"Bearer {DEV_KEY}"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=10)
    check_error(err.value.code, err.value.read(), 405, "method_not_allowed")


def test_health_and_readiness(pipeline: Pipeline) -> None:
    with urllib.request.urlopen(f"{pipeline.url}/healthz", timeout=10) as resp:
        assert resp.status == 200
    with urllib.request.urlopen(f"{pipeline.url}/readyz", timeout=10) as resp:
        ready = json.loads(resp.read())
    assert ready == {"ready": True, "checks": {"nats_connected": True, "streams": True,
                                               "accepting": True}}


def test_good_request_still_works(pipeline: Pipeline) -> None:
    status, headers, body = pipeline.post_full("/v1/chat/completions", {**GOOD, "max_tokens": 2})
    assert status == 200, body
    assert json.loads(body)["usage"]["completion_tokens"] == 2
    assert headers["Content-Type"].startswith("application/json")
    # The request id: >= 96 random bits, and the body's id is built from it.
    request_id = headers["x-request-id"]
    assert re.fullmatch(r"[0-9A-Za-z_-]{16,}", request_id), request_id
    assert int(headers["x-tidegate-request-seq"]) >= 1
    assert int(headers["x-tidegate-job-seq"]) >= 1
    second, again, _ = pipeline.post_full("/v1/chat/completions", {**GOOD, "max_tokens": 1})
    assert second == 200
    assert again["x-request-id"] != request_id
