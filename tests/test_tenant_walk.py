"""Tenant isolation, route by route: every id-addressed route of the edge, walked
with a second tenant's key against the first tenant's real ids (404 each), with
the owner's answer (not 404) as the control that proves the ids were real.

``ROUTES`` is the one table. ``test_the_table_lists_every_id_route`` reads the
edge's route registrations, so a new id-addressed route (from any feature)
fails until it is added here with the kind of id it takes.
"""

from __future__ import annotations

import asyncio
import io
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.pipeline import Pipeline, running_pipeline, tenant_keys

pytestmark = pytest.mark.pipeline

EDGE = Path(__file__).resolve().parent.parent / "edge"

#: (method, path template, kind of id, destructive): every route with an id.
ROUTES: list[tuple[str, str, str, bool]] = [
    ("GET", "/v1/streams/{request_id}", "stream", False),
    ("POST", "/v1/streams/{request_id}/cancel", "stream", True),
    ("GET", "/v1/responses/{response_id}", "response", False),
    ("POST", "/v1/responses/{response_id}/cancel", "response", True),
    ("GET", "/v1/files/{file_id}", "file", False),
    ("GET", "/v1/files/{file_id}/content", "file", False),
    ("DELETE", "/v1/files/{file_id}", "file", True),
    ("GET", "/v1/batches/{batch_id}", "batch", False),
    ("POST", "/v1/batches/{batch_id}/cancel", "batch", True),
    ("GET", "/v1/messages/batches/{batch_id}", "message_batch", False),
    ("GET", "/v1/messages/batches/{batch_id}/results", "message_batch", False),
    ("POST", "/v1/messages/batches/{batch_id}/cancel", "message_batch", True),
]


def test_the_table_lists_every_id_route() -> None:
    registered = set()
    for source in EDGE.glob("*.py"):
        for method, path in re.findall(r'add_(get|post|delete|put|patch)\(\s*"([^"]*\{[^"]*)"',
                                       source.read_text()):
            registered.add((method.upper(), path))
    assert registered, "no id routes found: has the edge's route code moved?"
    assert registered == {(m, p) for m, p, _, _ in ROUTES}


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory, module_nats_url: str,
             module_redis_url: str) -> Iterator[Pipeline]:
    yield from running_pipeline(
        tmp_path_factory.mktemp("walk"), module_nats_url, module_redis_url,
        overrides={"models": [{"name": "tidegate-sim", "aliases": ["sim"], "resumable": True,
                               "simulator": {"ttft": 0.01, "tokens_per_second": 20.0,
                                             "length": 200}}]})


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def _ready(session: aiohttp.ClientSession, base: str, key: str) -> None:
    deadline = time.monotonic() + 10
    while True:  # a new key reaches the edge through its KV watch
        async with session.get(f"{base}/v1/models", headers=_auth(key)) as resp:
            if resp.status == 200:
                return
        assert time.monotonic() < deadline, "key never reached the edge"
        await asyncio.sleep(0.1)


async def _ids(session: aiohttp.ClientSession, base: str, key: str) -> dict[str, str]:
    """One real resource of each kind, owned by ``key``'s tenant."""
    ids: dict[str, str] = {}
    line = {"custom_id": "c1", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "sim", "max_tokens": 2,
                     "messages": [{"role": "user", "content": "x"}]}}
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    form.add_field("file", io.BytesIO(json.dumps(line).encode() + b"\n"),
                   filename="walk.jsonl", content_type="application/jsonl")
    async with session.post(f"{base}/v1/files", data=form, headers=_auth(key)) as resp:
        assert resp.status == 200, await resp.text()
        ids["file"] = (await resp.json())["id"]
    async with session.post(f"{base}/v1/batches", headers=_auth(key), json={
            "input_file_id": ids["file"], "endpoint": "/v1/chat/completions",
            "completion_window": "24h"}) as resp:
        assert resp.status == 200, await resp.text()
        ids["batch"] = (await resp.json())["id"]
    async with session.post(f"{base}/v1/messages/batches", headers=_auth(key), json={
            "requests": [{"custom_id": "c1", "params": {
                "model": "sim", "max_tokens": 2,
                "messages": [{"role": "user", "content": "x"}]}}]}) as resp:
        assert resp.status == 200, await resp.text()
        ids["message_batch"] = (await resp.json())["id"]
    async with session.post(f"{base}/v1/responses", headers=_auth(key), json={
            "model": "sim", "input": "walk", "background": True}) as resp:
        assert resp.status == 200, await resp.text()
        ids["response"] = (await resp.json())["id"]
    # A resumable stream, still running while the walk happens (200 tokens at 20/s).
    resp = await session.post(f"{base}/v1/chat/completions", headers=_auth(key), json={
        "model": "sim", "stream": True, "messages": [{"role": "user", "content": "walk"}]})
    assert resp.status == 200, await resp.text()
    ids["stream"] = resp.headers["x-request-id"]
    _OPEN.append(resp)
    return ids


_OPEN: list[Any] = []


def _random_bits(resource_id: str) -> int:
    """Bits of the random part of an id (after a ``file-`` / ``batch_`` style prefix)."""
    body = re.split(r"[-_]", resource_id, maxsplit=1)[-1] if re.match(
        r"^[a-z]+[-_]", resource_id) else resource_id
    if re.fullmatch(r"[0-9a-f]+", body):
        return 4 * len(body)
    return 6 * len(body)  # URL-safe base64


@pytest.mark.asyncio
async def test_every_id_route_is_404_for_another_tenant(pipeline: Pipeline) -> None:
    key_a, key_b = await tenant_keys(pipeline, "tenant-a", "tenant-b")
    base = pipeline.url
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        await _ready(session, base, key_a)
        await _ready(session, base, key_b)
        ids = await _ids(session, base, key_a)
        for kind in ("file", "batch", "message_batch", "response", "stream"):
            assert _random_bits(ids[kind]) >= 96, (kind, ids[kind])
        try:
            for method, template, kind, _ in ROUTES:
                path = re.sub(r"\{[^}]+\}", ids[kind], template)
                async with session.request(method, f"{base}{path}",
                                           headers=_auth(key_b)) as resp:
                    body = await resp.read()
                    assert resp.status == 404, (method, template, resp.status, body[:200])
                    assert json.loads(body)["error"]["message"]
            # The control: the owner gets an answer for each (non-destructive first).
            for method, template, kind, _ in sorted(ROUTES, key=lambda r: r[3]):
                path = re.sub(r"\{[^}]+\}", ids[kind], template)
                async with session.request(method, f"{base}{path}",
                                           headers=_auth(key_a)) as resp:
                    body = await resp.read()
                    assert resp.status != 404, (method, template, body[:200])
                    assert resp.status < 500, (method, template, resp.status, body[:200])
        finally:
            for resp in _OPEN:
                resp.close()
            _OPEN.clear()
