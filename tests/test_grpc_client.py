"""A gRPC client as a user builds one: stubs generated from the published
proto (``tidegate/wire/gateway.proto``, copied alone into an empty directory)
with ``grpc_tools.protoc``, and a program that imports only them and grpcio,
never tidegate's checked-in stubs, run as its own process against a real
pipeline. It calls ``Generate`` (one streamed chat) and ``Session`` (a chat
and a Responses generation on one call); the test checks the text against
the simulator's for the same bodies and the usage against its length.

The other gRPC tests (``tests/test_grpc_pipeline.py``,
``tests/test_grpc_session.py``) use the checked-in stubs, which
``tests/test_grpc_proto.py`` holds equal to what the proto generates.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fleet.run.servers import free_port
from tests.clients import client_module, simulator_text
from tests.pipeline import DEV_KEY, Pipeline, running_pipeline
from tidegate.config import SimulatorConfig
from tidegate.wire.protocol import Api

pytestmark = pytest.mark.pipeline

PROTO = Path(__file__).resolve().parents[1] / "tidegate" / "wire" / "gateway.proto"
SIM = SimulatorConfig(ttft=0.01, tokens_per_second=400.0, length=24)
CHAT = {"model": "tidegate-sim", "stream": True, "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": "Say hello over gRPC"}]}
RESPONSES = {"model": "tidegate-sim", "stream": True, "input": "Say hello over a session"}

# The user's program: the generated stubs and grpcio, nothing of tidegate's.
CLIENT = '''
import asyncio, json, sys
import grpc
import gateway_pb2 as pb, gateway_pb2_grpc as pb_grpc

target, key, chat, responses = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
auth = (("authorization", "Bearer " + key),)


def record(out, msg):
    kind = msg.WhichOneof("event")
    out["events"].append(kind)
    if kind == "accepted":
        out["request_id"] = msg.accepted.request_id
    elif kind == "chunk":
        out["data"] += msg.chunk.data.decode()
    elif kind == "done":
        u = msg.done.usage
        out["usage"] = [u.prompt_tokens, u.completion_tokens, u.finish_reason]


def fresh():
    return {"events": [], "data": "", "usage": None, "request_id": ""}


async def main():
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.GatewayStub(channel)
        generate = fresh()
        call = stub.Generate(pb.GenerateRequest(route=pb.ROUTE_CHAT_COMPLETIONS,
                                                body=chat.encode()), metadata=auth, timeout=60)
        async for msg in call:
            record(generate, msg)
        generate["code"] = (await call.code()).name
        session = {"a": fresh(), "b": fresh()}
        call = stub.Session(metadata=auth, timeout=60)
        await call.write(pb.SessionRequest(id="a", generate=pb.GenerateRequest(
            route=pb.ROUTE_CHAT_COMPLETIONS, body=chat.encode())))
        await call.write(pb.SessionRequest(id="b", generate=pb.GenerateRequest(
            route=pb.ROUTE_RESPONSES, body=responses.encode())))
        await call.done_writing()
        async for msg in call:
            record(session[msg.id], msg)
        code = (await call.code()).name
    print(json.dumps({"generate": generate, "session": session, "session_code": code,
                      "tidegate_imported": "tidegate" in sys.modules}))


asyncio.run(main())
'''


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory, module_nats_url: str,
             module_redis_url: str) -> Iterator[Pipeline]:
    yield from running_pipeline(
        tmp_path_factory.mktemp("grpc_client"), module_nats_url, module_redis_url, overrides={
            "nats": {"subject_prefix": "gc" + uuid.uuid4().hex[:6]},
            "edge": {"grpc_port": free_port()},
            "models": [{"name": "tidegate-sim", "simulator": {
                "ttft": SIM.ttft, "tokens_per_second": SIM.tokens_per_second,
                "length": SIM.length}}]})


@pytest.fixture(scope="module")
def client_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The proto alone in a directory, the stubs protoc generates from it, the program."""
    protoc = client_module("grpc_tools.protoc")
    where = tmp_path_factory.mktemp("grpc_user")
    shutil.copy(PROTO, where / "gateway.proto")
    # What `python -m grpc_tools.protoc -I . --python_out=. --grpc_python_out=.
    # gateway.proto` runs, in this process.
    assert protoc.main(["protoc", f"-I{where}", f"--python_out={where}",
                        f"--grpc_python_out={where}", str(where / "gateway.proto")]) == 0
    assert {p.name for p in where.iterdir()} >= {"gateway_pb2.py", "gateway_pb2_grpc.py"}
    (where / "client.py").write_text(CLIENT)
    return where


def events(data: str) -> list[dict[str, Any]]:
    """The JSON of each SSE event's ``data:`` line (a Responses event has an ``event:`` too)."""
    return [json.loads(line[6:]) for line in data.split("\n") if line.startswith("data: ")]


async def test_generate_and_session_from_stubs_generated_from_the_proto(
        pipeline: Pipeline, client_dir: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "client.py", f"127.0.0.1:{pipeline.config.edge.grpc_port}", DEV_KEY,
        json.dumps(CHAT), json.dumps(RESPONSES), cwd=client_dir, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    async with asyncio.timeout(180):
        stdout, stderr = await proc.communicate()
    assert proc.returncode == 0, stderr.decode()
    out = json.loads(stdout)
    assert out["tidegate_imported"] is False
    chat_text = await simulator_text(Api.CHAT, CHAT, SIM)

    generate = out["generate"]
    assert generate["code"] == "OK"
    assert generate["events"][0] == "accepted"
    assert generate["events"][-1] == "done"
    assert generate["request_id"]
    chunks = events(generate["data"])
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks
                   if c["choices"]) == chat_text
    assert chunks[-1]["usage"]["completion_tokens"] == SIM.length
    assert generate["usage"][1:] == [SIM.length, "stop"]
    assert generate["usage"][0] == chunks[-1]["usage"]["prompt_tokens"] > 0

    assert out["session_code"] == "OK"
    a, b = out["session"]["a"], out["session"]["b"]
    assert a["events"][-1] == b["events"][-1] == "done"
    assert a["request_id"] != b["request_id"]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in events(a["data"])
                   if c["choices"]) == chat_text
    assert a["usage"][1] == SIM.length
    b_events = events(b["data"])
    assert b_events[-1]["type"] == "response.completed"
    assert "".join(e["delta"] for e in b_events if e["type"] == "response.output_text.delta") \
        == await simulator_text(Api.RESPONSES, RESPONSES, SIM)
    assert b["usage"][1] == b_events[-1]["response"]["usage"]["output_tokens"] == SIM.length
