"""Hostile inputs a tenant can send with a valid key (issue 24, items 5 and 7),
against a real pipeline: output token limits past any model, header values
echoed back, content parts of the wrong shape, the model list of a restricted
key, and ``/metrics`` on the public port."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from websockets.asyncio.client import connect as ws_connect

from tests.pipeline import DEV_KEY, Pipeline, running_pipeline
from tests.test_batch_pipeline import chat_line, poll, submit
from tidegate.broker import broker
from tidegate.control import keys as tgkeys

pytestmark = pytest.mark.pipeline

MSG = [{"role": "user", "content": "hi"}]
TINY_CAP = 16


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory, module_nats_url: str,
             module_redis_url: str) -> Iterator[Pipeline]:
    sim = {"ttft": 0.01, "tokens_per_second": 400.0, "length": 8}
    yield from running_pipeline(
        tmp_path_factory.mktemp("bounds"), module_nats_url, module_redis_url,
        overrides={"models": [{"name": "tidegate-sim", "aliases": ["sim"], "simulator": sim},
                              {"name": "tiny", "max_output_tokens": TINY_CAP,
                               "simulator": sim}]})


def _error(pipeline: Pipeline, path: str, body: dict[str, Any], status: int = 400,
           key: str = DEV_KEY) -> dict[str, Any]:
    got, raw = pipeline.post(path, body, key=key)
    assert got == status, raw
    return dict(json.loads(raw)["error"])


# -- item 5: max_tokens and friends are bounded per model -----------------------------------


@pytest.mark.parametrize(("path", "field", "extra"), [
    ("/v1/chat/completions", "max_tokens", {"messages": MSG}),
    ("/v1/chat/completions", "max_completion_tokens", {"messages": MSG}),
    ("/v1/completions", "max_tokens", {"prompt": "hi"}),
    ("/v1/responses", "max_output_tokens", {"input": "hi"}),
])
def test_output_limit_past_the_model_is_a_400(pipeline: Pipeline, path: str, field: str,
                                              extra: dict[str, Any]) -> None:
    """10^12 once made the simulator plan 10^12 tokens and the worker die of OOM."""
    error = _error(pipeline, path, {"model": "tidegate-sim", field: 10**12, **extra})
    assert (error["code"], error["param"]) == ("invalid_value", field)
    assert "262144" in error["message"]
    assert "max_output_tokens" in error["message"]
    # The model's own bound is the config's.
    error = _error(pipeline, path, {"model": "tiny", field: TINY_CAP + 1, **extra})
    assert (error["code"], error["param"]) == ("invalid_value", field)
    assert str(TINY_CAP) in error["message"]
    status, raw = pipeline.post(path, {"model": "tiny", field: TINY_CAP, **extra})
    assert status == 200, raw


async def test_websocket_requests_are_bounded_too(pipeline: Pipeline) -> None:
    async with ws_connect(f"ws://127.0.0.1:{pipeline.port}/v1/ws",
                          additional_headers={"Authorization": f"Bearer {DEV_KEY}"}) as ws:
        await ws.send(json.dumps({"type": "request", "id": "big", "path": "/v1/chat/completions",
                                  "body": {"model": "sim", "max_tokens": 10**12,
                                           "messages": MSG}}))
        answer = json.loads(await asyncio.wait_for(ws.recv(), 30))
    assert answer["type"] == "error", answer
    assert (answer["id"], answer["error"]["code"]) == ("big", "invalid_value")
    assert answer["error"]["param"] == "max_tokens"


async def test_batch_lines_are_bounded_too(pipeline: Pipeline) -> None:
    """Batch lines are validated with the same rules (and 2^64 once crashed
    the dispatcher when it re-encoded the line)."""
    huge = chat_line("huge", "hi")
    huge["body"]["max_tokens"] = 10**12
    async with openai.AsyncOpenAI(base_url=pipeline.base_url, api_key=DEV_KEY,
                                  max_retries=0, timeout=30) as client:
        batch = await submit(client, [chat_line("ok", "hi"), huge])
        failed = await poll(client, batch.id, {"failed", "completed"})
    assert failed.status == "failed"
    errors = [(e.code, e.line, e.param) for e in failed.errors.data or []]
    assert errors == [("invalid_value", 2, "max_tokens")], errors


def test_pipeline_still_serves_after_huge_limits(pipeline: Pipeline) -> None:
    for _ in range(3):
        _error(pipeline, "/v1/chat/completions",
               {"model": "sim", "max_tokens": 10**12, "messages": MSG})
    status, raw = pipeline.post("/v1/chat/completions",
                                {"model": "sim", "max_tokens": 4, "messages": MSG})
    assert status == 200, raw
    assert json.loads(raw)["usage"]["completion_tokens"] == 4


# -- item 7: header values are never echoed -------------------------------------------------


def _raw_request(port: int, head: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    return data


@pytest.mark.parametrize("name", ["Authorization", "X-Api-Key"])
def test_an_oversize_header_is_named_not_echoed(pipeline: Pipeline, name: str) -> None:
    """A 9 KB Authorization header once came back (and went to the log) with
    ~100 bytes of its value: enough to hold a whole key."""
    secret = "sk-SECRETSECRET" + "".join(f"{i:04d}" for i in range(2500))
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n{name}: Bearer {secret}\r\n"
            "Content-Length: 2\r\n\r\n{}").encode()
    answer = _raw_request(pipeline.port, head)
    status_line, _, rest = answer.partition(b"\r\n")
    assert b" 400 " in status_line, answer[:300]
    body = json.loads(rest.partition(b"\r\n\r\n")[2])
    message = body["error"]["message"]
    assert "8190" in message  # the limit (edge.max_field_size)
    assert f"header '{name}'" in message  # and which line it was
    for piece in ("SECRET", "0001", "0100", "Bearer"):
        assert piece not in message, message
    time.sleep(0.3)  # the edge writes its log line as it answers
    assert "SECRET" not in pipeline.log_text()
    assert "00010002" not in pipeline.log_text()


def test_an_oversize_request_line_is_named_not_echoed(pipeline: Pipeline) -> None:
    path = "/v1/models?key=sk-SECRETSECRET" + "x" * 9000
    answer = _raw_request(pipeline.port, f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    assert b" 400 " in answer.partition(b"\r\n")[0], answer[:300]
    message = json.loads(answer.partition(b"\r\n\r\n")[2])["error"]["message"]
    assert "request line" in message
    assert "SECRET" not in message


@pytest.mark.parametrize("header", ["X-Tidegate-Resumable", "X-Tidegate-Resume-Grace"])
def test_a_bad_header_value_is_not_echoed(pipeline: Pipeline, header: str) -> None:
    status, raw = pipeline.post("/v1/chat/completions",
                                {"model": "sim", "stream": True, "messages": MSG},
                                headers={"X-Tidegate-Resumable": "true",
                                         header: "sk-SECRETSECRET-0123456789"})
    assert status == 400, raw
    message = json.loads(raw)["error"]["message"]
    assert header in message
    assert "SECRET" not in message


def test_a_wrong_key_is_not_echoed(pipeline: Pipeline) -> None:
    wrong = "sk-WRONGKEY-abcdefghijklmnop-0123456789"
    error = _error(pipeline, "/v1/chat/completions",
                   {"model": "sim", "messages": MSG}, status=401, key=wrong)
    assert error["code"] == "invalid_api_key"
    for piece in (wrong[:6], wrong[-4:], "WRONG"):
        assert piece not in error["message"], error


# -- item 7: content parts have the shape of their type -------------------------------------


@pytest.mark.parametrize(("part", "param"), [
    ({"type": "image_url", "image_url": 5}, "messages[0].content[0].image_url"),
    ({"type": "image_url"}, "messages[0].content[0].image_url"),
    ({"type": "image_url", "image_url": {"url": 5}}, "messages[0].content[0].image_url.url"),
    ({"type": "image_url", "image_url": {"url": "http://x/i.png", "detail": 3}},
     "messages[0].content[0].image_url.detail"),
    ({"type": "text"}, "messages[0].content[0].text"),
    ({"type": "text", "text": ["a"]}, "messages[0].content[0].text"),
    ({"type": "input_audio", "input_audio": "x"}, "messages[0].content[0].input_audio"),
    ({"type": "input_audio", "input_audio": {"data": "x", "format": 1}},
     "messages[0].content[0].input_audio.format"),
    ({"type": "file", "file": {"file_id": 7}}, "messages[0].content[0].file.file_id"),
    ({"type": "refusal", "refusal": None}, "messages[0].content[0].refusal"),
])
def test_content_parts_of_the_wrong_shape_are_400(pipeline: Pipeline, part: dict[str, Any],
                                                  param: str) -> None:
    error = _error(pipeline, "/v1/chat/completions",
                   {"model": "sim", "messages": [{"role": "user", "content": [part]}]})
    assert error["param"] == param, error
    assert error["code"] in ("invalid_type", "missing_required_parameter", "invalid_value")


def test_responses_content_parts_are_checked_too(pipeline: Pipeline) -> None:
    error = _error(pipeline, "/v1/responses", {"model": "sim", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": 5}]}]})
    assert (error["param"], error["code"]) == ("input[0].content[0].text", "invalid_type")
    error = _error(pipeline, "/v1/responses", {"model": "sim", "input": [
        {"role": "user", "content": [{"type": "input_image", "image_url": {"u": 1}}]}]})
    assert error["param"] == "input[0].content[0].image_url"


def test_content_parts_of_the_right_shape_pass(pipeline: Pipeline) -> None:
    parts = [{"type": "text", "text": "hi"},
             {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA",
                                                 "detail": "low"}},
             {"type": "image_url", "image_url": "https://example.com/a.png"},
             {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
             {"type": "file", "file": {"file_id": "file-1"}},
             {"type": "vendor_thing", "anything": 1}]
    status, raw = pipeline.post("/v1/chat/completions", {
        "model": "sim", "max_tokens": 2, "messages": [{"role": "user", "content": parts}]})
    assert status == 200, raw


# -- item 7: /v1/models lists what the key may use ------------------------------------------


def test_models_list_follows_the_keys_model_list(pipeline: Pipeline) -> None:
    async def make() -> str:
        nc = await broker.connect(pipeline.config.nats, "tidegate-admin-test")
        try:
            js = broker.jetstream(nc, pipeline.config.nats)
            kv = await tgkeys.ensure_keys_bucket(js, pipeline.config)
            return (await tgkeys.create_key(kv, "acme", "", ["tiny"]))[0]
        finally:
            await nc.close()

    key = asyncio.run(make())

    def listed(key: str) -> tuple[int, list[str]]:
        request = urllib.request.Request(f"{pipeline.base_url}/models",
                                         headers={"Authorization": f"Bearer {key}"})
        try:
            with urllib.request.urlopen(request, timeout=10) as resp:
                return resp.status, [m["id"] for m in json.loads(resp.read())["data"]]
        except urllib.error.HTTPError as exc:
            exc.close()
            return exc.code, []

    deadline = time.monotonic() + 15
    while (got := listed(key))[0] == 401:  # until the edge's key watch has it
        assert time.monotonic() < deadline, got
        time.sleep(0.1)
    assert got == (200, ["tiny"])
    assert sorted(listed(DEV_KEY)[1]) == ["sim", "tidegate-sim", "tiny"]
    # Nor does a 404 for an unknown model list the others.
    error = _error(pipeline, "/v1/chat/completions",
                   {"model": "nope", "messages": MSG}, status=404, key=key)
    assert "tidegate-sim" not in error["message"]


# -- item 7: /metrics is not on the public API port -----------------------------------------


def test_metrics_are_on_their_own_port_not_the_api_port(pipeline: Pipeline) -> None:
    """/metrics takes no key; on the API port anyone could read every model's
    traffic. It is on edge.metrics_port (127.0.0.1) instead."""
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(f"{pipeline.url}/metrics", timeout=10).close()
    info.value.close()
    assert info.value.code == 404
    assert pipeline.metrics_ports["edge"] != pipeline.port
    text = pipeline.scrape("edge")
    assert "tidegate_edge_connections_active" in text
    with urllib.request.urlopen(pipeline.metrics_url("edge").replace("/metrics", "/healthz"),
                                timeout=10) as resp:
        assert resp.status == 200


def test_metrics_public_keeps_the_old_place(
        tmp_path_factory: pytest.TempPathFactory, module_nats_url: str,
        module_redis_url: str) -> None:
    for public in running_pipeline(tmp_path_factory.mktemp("public"), module_nats_url,
                                   module_redis_url, workers=0,
                                   overrides={"edge": {"metrics_public": True,
                                                       "metrics_port": 0}}):
        with urllib.request.urlopen(f"{public.url}/metrics", timeout=10) as resp:
            assert "target_info" in resp.read().decode()


def test_a_taken_metrics_port_is_one_clear_line(tmp_path: Path) -> None:
    """Two edges of one host on the default metrics port: the second says
    what to change instead of dying with a traceback."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        env = {k: v for k, v in os.environ.items() if not k.startswith("TIDEGATE")}
        env.update({"TIDEGATE__EDGE__METRICS_PORT": str(taken.getsockname()[1]),
                    "TIDEGATE_NATS_URL": "nats://127.0.0.1:1"})
        done = subprocess.run([sys.executable, "-m", "fleet", "edge"], env=env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "edge.metrics_port" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
