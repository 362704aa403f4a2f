"""What one tenant (or a neighbour holding the edge's NATS credentials) does
to the edge, answered without harm to the connection, the log or the other
tenants: the edge rows of issue 44 (third pass), one test per row, each with
the row number in its docstring. One edge on a real nats-server.
"""

from __future__ import annotations

import contextlib
import json
import socket
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from tests.pipeline import DEV_KEY, Pipeline, running_pipeline

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
