"""Hostile uploads to ``POST /v1/files`` on a live edge and a real nats-server
(issue 24, item 6): a trickled upload gets 408, an upload that times out or
is cut off leaves nothing in the object store, and a tenant's files are held
to a storage quota (413 ``storage_quota_exceeded``) that deleting files frees.

The deadlines are configured small (``body_timeout`` 1 s) and the tests wait
for outcomes (a reply, the store back to its size), never bound an elapsed time.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from tests.pipeline import DEV_KEY, Pipeline, running_pipeline
from tidegate.broker import broker
from tidegate.control.batches import bucket_names

pytestmark = pytest.mark.pipeline

QUOTA = 600_000
BOUNDARY = "tgboundary7f3a"
LINE = (b'{"custom_id": "x", "method": "POST", "url": "/v1/chat/completions", "body": '
        b'{"model": "tidegate-sim", "messages": [{"role": "user", "content": "hi"}]}}\n')


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory, module_nats_url: str,
             module_redis_url: str) -> Iterator[Pipeline]:
    # The Files API needs only the edge and the broker.
    yield from running_pipeline(
        tmp_path_factory.mktemp("uploads"), module_nats_url, module_redis_url, workers=0,
        overrides={"nats": {"subject_prefix": "u" + uuid.uuid4().hex[:8]},
                   "edge": {"body_timeout": 1.0, "body_min_rate": 65536.0},
                   "batch": {"max_file_bytes": 1 << 20, "tenant_storage_bytes": QUOTA}})


def content(size: int) -> bytes:
    return (LINE * (size // len(LINE) + 1))[:size]


def multipart(data: bytes, purpose: str = "batch") -> tuple[bytes, bytes]:
    """(everything up to the file's data, the rest: file data + final boundary)."""
    head = (f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\n"
            f"{purpose}\r\n--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"file\"; "
            f"filename=\"in.jsonl\"\r\nContent-Type: application/jsonl\r\n\r\n").encode()
    return head, data + f"\r\n--{BOUNDARY}--\r\n".encode()


def http_head(pipeline: Pipeline, length: int | None) -> bytes:
    framing = f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked"
    return (f"POST /v1/files HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {DEV_KEY}\r\n"
            f"Content-Type: multipart/form-data; boundary={BOUNDARY}\r\n{framing}\r\n\r\n"
            ).encode()


def chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def reply_of(sock: socket.socket) -> tuple[int, dict[str, Any]]:
    """Status and JSON body of the edge's reply (read until the body is whole)."""
    raw = b""
    while b"\r\n\r\n" not in raw:
        got = sock.recv(65536)
        assert got, f"the edge closed without a reply: {raw!r}"
        raw += got
    head, _, body = raw.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:")))
    while len(body) < length:
        got = sock.recv(65536)
        assert got, "the edge closed mid-reply"
        body += got
    return int(head.split()[1]), json.loads(body[:length])


def upload(pipeline: Pipeline, data: bytes, *, chunked: bool = False) -> tuple[int, Any]:
    head, rest = multipart(data)
    with socket.create_connection(("127.0.0.1", pipeline.port), timeout=60) as sock:
        if chunked:
            sock.sendall(http_head(pipeline, None) + chunk(head) + chunk(rest) + b"0\r\n\r\n")
        else:
            sock.sendall(http_head(pipeline, len(head) + len(rest)) + head + rest)
        return reply_of(sock)


def store_messages(pipeline: Pipeline) -> int:
    """Messages (chunks and metas) in the files' object store stream."""
    async def main() -> int:
        nc = await broker.connect(pipeline.config.nats, "tidegate-admin-test")
        try:
            js = broker.jetstream(nc, pipeline.config.nats)
            info = await js.stream_info(f"OBJ_{bucket_names(pipeline.config)[0]}")
            return int(info.state.messages)
        finally:
            await nc.close()
    return asyncio.run(main())


def until_store_has(pipeline: Pipeline, messages: int, *, at_least: bool = False) -> int:
    """Poll until the store holds ``messages`` (or, with ``at_least``, more)."""
    deadline = time.monotonic() + 60
    while True:
        now = store_messages(pipeline)
        if now == messages or (at_least and now >= messages):
            return now
        assert time.monotonic() < deadline, f"the store holds {now} messages, not {messages}"
        time.sleep(0.1)


@pytest.fixture
def empty_store(pipeline: Pipeline) -> int:
    """The store's message count with no file of this module's tenant in it."""
    req = urllib.request.Request(f"{pipeline.base_url}/files",
                                 headers={"Authorization": f"Bearer {DEV_KEY}"})
    with urllib.request.urlopen(req, timeout=60) as resp:  # opens the stores
        assert resp.status == 200
    return store_messages(pipeline)


def test_a_trickled_upload_gets_408_and_leaves_nothing(pipeline: Pipeline,
                                                       empty_store: int) -> None:
    head, rest = multipart(content(300_000))
    with socket.create_connection(("127.0.0.1", pipeline.port), timeout=60) as sock:
        # 300 kB at once (two chunks land in the store), then a byte at a time.
        sock.sendall(http_head(pipeline, len(head) + len(rest)) + head + rest[:290_000])
        until_store_has(pipeline, empty_store + 2, at_least=True)
        # Without a body deadline this trickle would go on for 30 s and more
        # with no reply; the deadline here is 1 s + 4.4 s for what arrived.
        sock.settimeout(0.2)
        status, body = 0, {}
        for byte in rest[290_000:290_150]:
            try:
                with contextlib.suppress(OSError):  # the edge may have closed already
                    sock.sendall(bytes([byte]))
                status, body = reply_of(sock)
                break
            except TimeoutError:
                continue
        sock.settimeout(60)
    assert status == 408, (status, body)
    assert body["error"]["code"] == "request_timeout"
    until_store_has(pipeline, empty_store)


def test_an_upload_cut_off_before_the_final_boundary_leaves_nothing(
        pipeline: Pipeline, empty_store: int) -> None:
    # The connection drops mid-file (Content-Length and chunked framing).
    for chunked in (False, True):
        head, rest = multipart(content(500_000))
        with socket.create_connection(("127.0.0.1", pipeline.port), timeout=60) as sock:
            if chunked:
                sock.sendall(http_head(pipeline, None) + chunk(head) + chunk(rest[:-200]))
            else:
                sock.sendall(http_head(pipeline, len(head) + len(rest)) + head + rest[:-200])
            until_store_has(pipeline, empty_store + 3, at_least=True)
        until_store_has(pipeline, empty_store)
    # The HTTP body is whole but the multipart body is not: it ends inside the
    # file, or after the file's part with a boundary that is not the last.
    head, _ = multipart(b"")
    data = content(500_000)
    for body in (head + data, head + data + f"\r\n--{BOUNDARY}\r\n".encode()):
        with socket.create_connection(("127.0.0.1", pipeline.port), timeout=60) as sock:
            sock.sendall(http_head(pipeline, len(body)) + body)
            status, reply = reply_of(sock)
        assert status == 400, reply
        assert reply["error"]["code"] == "invalid_body"
        until_store_has(pipeline, empty_store)


def test_storage_quota_413_and_deleting_frees_it(pipeline: Pipeline, empty_store: int) -> None:
    status, first = upload(pipeline, content(400_000))
    assert status == 200, first
    after_first = store_messages(pipeline)
    # Streamed (chunked, no Content-Length): refused once past the room left,
    # and what was written of it is removed.
    status, body = upload(pipeline, content(400_000), chunked=True)
    assert status == 413, body
    assert body["error"]["code"] == "storage_quota_exceeded"
    assert body["error"]["type"] == "invalid_request_error"
    assert str(QUOTA) in body["error"]["message"]
    until_store_has(pipeline, after_first)
    # With a Content-Length past the room: refused before the body is read.
    status, body = upload(pipeline, content(400_000))
    assert (status, body["error"]["code"]) == (413, "storage_quota_exceeded")
    # What still fits is accepted; deleting a file makes room again.
    status, small = upload(pipeline, content(100_000))
    assert status == 200, small
    _delete(pipeline, first["id"])
    status, second = upload(pipeline, content(400_000), chunked=True)
    assert status == 200, second
    for file in (small, second):
        _delete(pipeline, file["id"])
    until_store_has(pipeline, empty_store)


def _delete(pipeline: Pipeline, file_id: str) -> None:
    with socket.create_connection(("127.0.0.1", pipeline.port), timeout=60) as sock:
        sock.sendall(f"DELETE /v1/files/{file_id} HTTP/1.1\r\nHost: t\r\n"
                     f"Authorization: Bearer {DEV_KEY}\r\nContent-Length: 0\r\n\r\n".encode())
        status, body = reply_of(sock)
    assert (status, body.get("deleted")) == (200, True), body


def test_a_trickled_batch_create_body_gets_408(pipeline: Pipeline) -> None:
    body = json.dumps({"input_file_id": "file-x", "endpoint": "/v1/chat/completions",
                       "completion_window": "24h"}).encode()
    with socket.create_connection(("127.0.0.1", pipeline.port), timeout=60) as sock:
        sock.sendall(f"POST /v1/batches HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer "
                     f"{DEV_KEY}\r\nContent-Type: application/json\r\nContent-Length: "
                     f"{len(body)}\r\n\r\n".encode() + body[:5])
        status, reply = reply_of(sock)  # without a deadline: no reply (the socket times out)
    assert (status, reply["error"]["code"]) == (408, "request_timeout")
