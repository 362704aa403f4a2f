"""What one tenant (or a neighbour holding the edge's NATS credentials) does
to the edge, answered without harm to the connection, the log or the other
tenants: the edge rows of issue 44 (third pass), one test per row, each with
the row number in its docstring. One edge on a real nats-server.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from fleet.run.servers import free_port
from tests.pipeline import DEV_KEY, Pipeline, running_pipeline
from tidegate.broker import broker
from tidegate.control.batches import bucket_names
from tidegate.control.keys import create_key, ensure_keys_bucket
from tidegate.wire import gateway_pb2 as pb

pytestmark = pytest.mark.pipeline

BOUNDARY = "tghostile5b1c"
LINE = (b'{"custom_id": "x", "method": "POST", "url": "/v1/chat/completions", "body": '
        b'{"model": "tidegate-sim", "messages": [{"role": "user", "content": "hi"}]}}\n')
BIG = 10_900_000  # the row's file: larger than what the kernel buffers on loopback


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory, module_nats_url: str,
             module_redis_url: str) -> Iterator[Pipeline]:
    # The Files API needs only the edge and the broker; no generation runs.
    yield from running_pipeline(
        tmp_path_factory.mktemp("hostile"), module_nats_url, module_redis_url, workers=0,
        overrides={"nats": {"subject_prefix": "h" + uuid.uuid4().hex[:8]},
                   "edge": {"grpc_port": free_port()},
                   "models": [{"name": "tidegate-sim", "aliases": ["sim"]},
                              {"name": "hidden-model", "aliases": ["hidden"]}],
                   "batch": {"max_file_bytes": 16 << 20, "tenant_storage_bytes": 64 << 20}})


def call(pipeline: Pipeline, method: str, path: str, *, key: str = DEV_KEY,
         body: bytes | None = None, headers: dict[str, str] | None = None,
         ) -> tuple[int, Any]:
    req = urllib.request.Request(f"{pipeline.url}{path}", data=body, method=method,
                                 headers={"Authorization": f"Bearer {key}", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def multipart(data: bytes, *, file_headers: bytes = b"") -> bytes:
    return (f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\n"
            f"batch\r\n--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"file\"; "
            f"filename=\"in.jsonl\"\r\nContent-Type: application/jsonl\r\n").encode() \
        + file_headers + b"\r\n" + data + f"\r\n--{BOUNDARY}--\r\n".encode()


def upload(pipeline: Pipeline, data: bytes, *, file_headers: bytes = b"") -> tuple[int, Any]:
    return call(pipeline, "POST", "/v1/files", body=multipart(data, file_headers=file_headers),
                headers={"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"})


def test_a_download_whose_file_is_deleted_is_cut_short_never_answered_twice(
        pipeline: Pipeline) -> None:
    """Row 4: the 200's headers are out when the file goes; the edge closes
    the connection (a short body) instead of writing a 500 inside the body,
    which a kept-alive client would read as the next response."""
    status, file = upload(pipeline, (LINE * (BIG // len(LINE) + 1))[:BIG])
    assert status == 200, file
    sock = socket.socket()
    # A small receive buffer: the edge is soon paced by this client, with most
    # of the file still in the store when it is deleted.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)
    sock.settimeout(30)
    with sock:
        sock.connect(("127.0.0.1", pipeline.port))
        sock.sendall(f"GET /v1/files/{file['id']}/content HTTP/1.1\r\nHost: t\r\n"
                     f"Authorization: Bearer {DEV_KEY}\r\n\r\n".encode())
        raw = b""
        while b"\r\n\r\n" not in raw:
            raw += sock.recv(65536)
        head, _, body = raw.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), head
        assert f"content-length: {BIG}".encode() in head.lower()
        deleted, _ = call(pipeline, "DELETE", f"/v1/files/{file['id']}")
        assert deleted == 200
        sock.settimeout(10)
        closed = False
        with contextlib.suppress(TimeoutError):
            while got := sock.recv(1 << 20):
                body += got
            closed = True
    assert b"HTTP/1.1" not in body, "a second response was written inside the body"
    assert len(body) < BIG, "the whole file came although it was deleted mid-download"
    assert closed, "the edge kept the connection of a cut-short body open"
    log = pipeline.log_text()
    assert "failed after its response started" in log
    assert "Traceback" not in log
    # The edge serves on.
    assert call(pipeline, "GET", "/v1/files")[0] == 200


def _put(pipeline: Pipeline, bucket: str, entries: dict[str, bytes]) -> None:
    """Write ``entries`` into one of the batch API's KV buckets, as anyone
    holding the edge's NATS credentials may."""
    async def main() -> None:
        nc = await broker.connect(pipeline.config.nats, "tidegate-hostile-test")
        try:
            kv = await broker.jetstream(nc, pipeline.config.nats).key_value(bucket)
            for key, value in entries.items():
                await kv.put(key, value)
        finally:
            await nc.close()
    asyncio.run(main())


def test_an_unreadable_file_or_batch_record_hides_only_itself(pipeline: Pipeline) -> None:
    """Row 5: garbage in ``<P>_FILEMETA`` / ``<P>_BATCHES`` (not JSON, or
    JSON of the wrong types under the victim's own tenant) is skipped by
    every listing and reads as 404 by id; logged once per key."""
    status, mine = upload(pipeline, LINE)
    assert status == 200, mine
    _, meta_bucket, batches_bucket, _ = bucket_names(pipeline.config)
    ids = [uuid.uuid4().hex for _ in range(4)]
    files = {f"file-{ids[0]}": b"\xff not json",
             f"file-{ids[1]}": json.dumps({
                 "id": "x", "tenant": "default", "size": "big", "created_at": [],
                 "filename": "x", "purpose": "batch"}).encode()}
    batches = {f"batch_{ids[2]}": b"[1, 2",
               f"batch_{ids[3]}": json.dumps({
                   "id": 7, "tenant": "default", "status": "exploded", "counts": {}}).encode()}
    _put(pipeline, meta_bucket, files)
    _put(pipeline, batches_bucket, batches)
    for _ in range(2):
        status, listed = call(pipeline, "GET", "/v1/files")
        assert status == 200, listed
        assert mine["id"] in [f["id"] for f in listed["data"]]
        status, listed = call(pipeline, "GET", "/v1/batches")
        assert status == 200, listed
    # An upload counts the tenant's stored bytes (its quota) over the same listing.
    assert upload(pipeline, LINE)[0] == 200
    for file_id in files:
        for path in (f"/v1/files/{file_id}", f"/v1/files/{file_id}/content"):
            status, error = call(pipeline, "GET", path)
            assert status == 404, (path, error)
    for batch_id in batches:
        status, error = call(pipeline, "GET", f"/v1/batches/{batch_id}")
        assert status == 404, error
    log = pipeline.edge.log_path.read_text()
    for key in (*files, *batches):
        assert log.count(f"skipping the unreadable entry '{key}'") == 1, key
    assert "Traceback" not in log


GARBAGE = b"\xff\xff\xff\xff not protobuf"


def _code_and_details(error: grpc.aio.AioRpcError) -> tuple[grpc.StatusCode, str]:
    return error.code(), error.details() or ""


async def _generate_raw(channel: grpc.aio.Channel, body: bytes, key: str | None,
                        ) -> tuple[grpc.StatusCode, str]:
    call = channel.unary_stream("/tidegate.v1.Gateway/Generate",
                                response_deserializer=pb.GenerateResponse.FromString)
    metadata = (("authorization", f"Bearer {key}"),) if key else ()
    try:
        async for _ in call(body, metadata=metadata, timeout=30):
            pass
    except grpc.aio.AioRpcError as error:
        return _code_and_details(error)
    return grpc.StatusCode.OK, ""


async def _garbage_calls(pipeline: Pipeline) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{pipeline.config.edge.grpc_port}"
                                         ) as channel:
        keyless: list[tuple[grpc.StatusCode, str]] = []
        for _ in range(3):  # 100 at a time: within grpc.max_concurrent_streams
            keyless += await asyncio.gather(*(_generate_raw(channel, GARBAGE, None)
                                              for _ in range(100)))
        assert {code for code, _ in keyless} == {grpc.StatusCode.UNAUTHENTICATED}, [
            k for k in keyless if k[0] is not grpc.StatusCode.UNAUTHENTICATED][:3]
        code, details = await _generate_raw(channel, GARBAGE, DEV_KEY)
        assert code is grpc.StatusCode.INVALID_ARGUMENT, (code, details)
        error = json.loads(details)["error"]
        assert error["code"] == "invalid_message"
        assert error["message"] == "The message is not a valid tidegate.v1.GenerateRequest."
        # A Session: one garbage message gets an Error (no id), the call goes on.
        session = channel.stream_stream("/tidegate.v1.Gateway/Session",
                                        response_deserializer=pb.GenerateResponse.FromString)
        stream = session(metadata=(("authorization", f"Bearer {DEV_KEY}"),), timeout=30)
        await stream.write(GARBAGE)
        reply = await stream.read()
        assert isinstance(reply, pb.GenerateResponse), reply
        assert reply.WhichOneof("event") == "error"
        assert reply.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert json.loads(reply.error.error)["error"]["code"] == "invalid_message"
        await stream.write(pb.SessionRequest(id="g1", cancel=pb.Cancel()).SerializeToString())
        await stream.done_writing()
        while (reply := await stream.read()) is not grpc.aio.EOF:
            assert isinstance(reply, pb.GenerateResponse)
            assert reply.id == "g1", reply  # its cancel's answer, if any
        assert await stream.code() is grpc.StatusCode.OK


def test_garbage_grpc_requests_are_refused_with_a_fixed_status_and_no_log(
        pipeline: Pipeline) -> None:
    """Row 6: 300 keyless calls with a body that is not protobuf get
    UNAUTHENTICATED (the key is checked first), a keyed one INVALID_ARGUMENT
    with a fixed message; grpcio's UNKNOWN with the decoder's text, an ERROR
    line and a traceback per call are gone."""
    before = pipeline.edge.log_path.read_text()
    asyncio.run(_garbage_calls(pipeline))
    added = pipeline.edge.log_path.read_text()[len(before):]
    assert "Traceback" not in added
    assert len(added.splitlines()) <= 3, added[:2000]


@pytest.mark.parametrize("header", [b"X-Part: a\x01b\r\n", b"X-Part: a\x7fb\r\n",
                                    b"X-\x00Part: ab\r\n", b"X-Part: a\rb\r\n"])
def test_a_control_character_in_a_part_header_is_a_400(pipeline: Pipeline,
                                                       header: bytes) -> None:
    """Row 8: a multipart part header with a control character is 400 with
    the OpenAI error JSON (it was a 500 and a traceback)."""
    status, error = upload(pipeline, LINE, file_headers=header)
    assert status == 400, error
    assert error["error"]["code"] == "invalid_body"
    assert error["error"]["param"] == "file"
    assert "Traceback" not in pipeline.edge.log_path.read_text()


def raw_request(pipeline: Pipeline, method: str, path: str, headers: list[tuple[str, str]],
                body: bytes = b"") -> tuple[int, Any]:
    """One request with exactly these header lines (repeats included)."""
    lines = [f"{method} {path} HTTP/1.1", "Host: t", "Connection: close",
             f"Content-Length: {len(body)}", *(f"{k}: {v}" for k, v in headers)]
    with socket.create_connection(("127.0.0.1", pipeline.port), timeout=30) as sock:
        sock.sendall("\r\n".join(lines).encode() + b"\r\n\r\n" + body)
        raw = b""
        while got := sock.recv(65536):
            raw += got
    head, _, payload = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(payload)


CHAT_BODY = json.dumps({"model": "tidegate-sim", "max_tokens": 1,
                        "messages": [{"role": "user", "content": "hi"}]}).encode()
MESSAGES_BODY = json.dumps({"model": "tidegate-sim", "max_tokens": 1,
                            "messages": [{"role": "user", "content": "hi"}]}).encode()
WS_UPGRADE = [("Upgrade", "websocket"), ("Connection", "Upgrade"), ("Sec-WebSocket-Version", "13"),
              ("Sec-WebSocket-Key", "dGhlIHNhbXBsZSBub25jZQ==")]


@pytest.mark.parametrize(("method", "path", "name", "extra", "body"), [
    ("GET", "/v1/files", "Authorization", [], b""),
    ("GET", "/v1/models", "Authorization", [], b""),
    ("POST", "/v1/chat/completions", "Authorization", [("Content-Type", "application/json")],
     CHAT_BODY),
    ("GET", "/v1/ws", "Authorization", WS_UPGRADE, b""),
    ("POST", "/v1/messages", "x-api-key", [("Content-Type", "application/json")],
     MESSAGES_BODY),
], ids=["files", "models", "chat", "ws", "messages"])
@pytest.mark.parametrize("valid_first", [True, False], ids=["valid-first", "valid-second"])
def test_two_credential_headers_are_refused(pipeline: Pipeline, method: str, path: str,
                                            name: str, extra: list[tuple[str, str]],
                                            body: bytes, valid_first: bool) -> None:
    """Row 9: two ``Authorization`` (or, on the Messages API, ``x-api-key``)
    headers are a 400 ``duplicate_header``, whichever one is valid; the
    first one won before, as gRPC never let it."""
    valid = f"Bearer {DEV_KEY}" if name == "Authorization" else DEV_KEY
    other = "Bearer sk-not-a-key" if name == "Authorization" else "sk-not-a-key"
    keys = [(name, valid), (name, other)]
    status, answer = raw_request(pipeline, method, path,
                                 [*extra, *(keys if valid_first else keys[::-1])], body)
    assert status == 400, answer
    error = answer["error"]
    assert error["type"] == "invalid_request_error"
    if path != "/v1/messages":  # Anthropic's error shape has no code
        assert (error["code"], error["param"]) == ("duplicate_header", name)
    assert DEV_KEY not in json.dumps(answer)


def restricted_key(pipeline: Pipeline) -> str:
    """A key of its own tenant that may use ``tidegate-sim`` only, once the edge knows it."""
    async def main() -> str:
        nc = await broker.connect(pipeline.config.nats, "tidegate-hostile-keys")
        try:
            kv = await ensure_keys_bucket(broker.jetstream(nc, pipeline.config.nats),
                                          pipeline.config)
            return (await create_key(kv, "t" + uuid.uuid4().hex[:8],
                                     models=["tidegate-sim"]))[0]
        finally:
            await nc.close()
    key = asyncio.run(main())
    deadline = time.monotonic() + 30
    while call(pipeline, "GET", "/v1/models", key=key)[0] != 200:  # through the KV watch
        assert time.monotonic() < deadline, "the new key never reached the edge"
        time.sleep(0.1)
    return key


HELLO = [{"role": "user", "content": "hi"}]
ROUTE_BODIES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"messages": HELLO, "temperature": 9},
    "/v1/completions": {"prompt": "hi"},
    "/v1/responses": {"input": "hi"},
    "/v1/embeddings": {"input": "hi"},
    "/v1/messages": {"max_tokens": 1, "messages": HELLO},
    "/v1/messages/count_tokens": {"messages": HELLO},
}


async def _grpc_answer(pipeline: Pipeline, key: str, model: str) -> tuple[grpc.StatusCode, str]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{pipeline.config.edge.grpc_port}"
                                         ) as channel:
        body = json.dumps({"model": model, "messages": HELLO}).encode()
        return await _generate_raw(channel, pb.GenerateRequest(
            route=pb.ROUTE_CHAT_COMPLETIONS, body=body).SerializeToString(), key)


def test_a_model_the_key_may_not_use_reads_as_an_unknown_model(pipeline: Pipeline) -> None:
    """Row 10: a key restricted to ``tidegate-sim`` naming ``hidden-model``
    (or its alias) gets exactly the 404 ``model_not_found`` of a model that
    does not exist, on every route and over gRPC, even with another field
    invalid (the chat body's temperature): no 403 naming the model, and no
    later check that only a real model reaches."""
    key = restricted_key(pipeline)
    listed = call(pipeline, "GET", "/v1/models", key=key)[1]
    assert "hidden-model" not in json.dumps(listed)
    for path, body in ROUTE_BODIES.items():
        answers = {}
        for model in ("hidden-model", "hidden", "no-such-model"):
            status, answer = call(pipeline, "POST", path, key=key,
                                  body=json.dumps({"model": model, **body}).encode(),
                                  headers={"Content-Type": "application/json"})
            answers[model] = (status, json.dumps(answer).replace(model, "MODEL"))
        assert answers["hidden-model"] == answers["hidden"] == answers["no-such-model"], \
            (path, answers)
        assert answers["no-such-model"][0] == 404, (path, answers)
    hidden = asyncio.run(_grpc_answer(pipeline, key, "hidden-model"))
    unknown = asyncio.run(_grpc_answer(pipeline, key, "no-such-model"))
    assert hidden[0] is unknown[0] is grpc.StatusCode.NOT_FOUND, (hidden, unknown)
    assert hidden[1].replace("hidden-model", "M") == unknown[1].replace("no-such-model", "M")
