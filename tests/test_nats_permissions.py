"""NATS least privilege against a real nats-server (tidegate.broker.permissions).

The server runs with the ``auth.conf`` that ``tidegate nats-config`` writes;
the whole pipeline serves under it (each tier with its own credentials), and
each tier's credentials are then tried on what they must not do.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.aio.client import Client as NATS

from tests.pipeline import Pipeline, running_pipeline, wait_for
from tidegate.broker import natsconfig
from tidegate.broker.auth import load_credentials
from tidegate.broker.permissions import ROLES, role_of, table
from tidegate.control.keys import KeyRecord, key_digest
from tidegate.run.servers import NatsServer
from tidegate.wire.subjects import Subjects, encode_token

pytestmark = [pytest.mark.pipeline]

CHAT = "/v1/chat/completions"
EDGE_ID = "permedge"


class AuthServer:
    def __init__(self, workdir: Path) -> None:
        self.auth_dir = workdir / "auth"
        self.auth = natsconfig.write(self.auth_dir, Subjects())
        self.server = NatsServer(workdir / "nats", extra_args=["-c", str(self.auth)])
        self.server.start()

    @property
    def url(self) -> str:
        return self.server.url

    def creds(self, role: str) -> dict[str, str]:
        return load_credentials(natsconfig.creds_file(self.auth_dir, role))

    def violations(self) -> list[str]:
        text = Path(self.server.log_path).read_text(errors="replace")
        return [line for line in text.splitlines() if "Violation" in line]


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AuthServer]:
    server = AuthServer(tmp_path_factory.mktemp("natsauth"))
    try:
        yield server
    finally:
        server.server.stop()


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory, auth_server: AuthServer,
             module_redis_url: str) -> Iterator[Pipeline]:
    yield from running_pipeline(
        tmp_path_factory.mktemp("permpipe"), auth_server.url, module_redis_url,
        overrides={"nats": {"credentials": natsconfig.credentials_setting(auth_server.auth_dir)},
                   "edge": {"edge_id": EDGE_ID}})


def test_the_pipeline_serves_under_its_permissions_without_a_violation(
        pipeline: Pipeline, auth_server: AuthServer) -> None:
    body = {"model": "tidegate-sim", "stream": True, "max_tokens": 4,
            "messages": [{"role": "user", "content": "hi"}]}
    for _ in range(3):
        status, data = pipeline.post(CHAT, body)
        assert status == 200, data[:300]
        assert data.rstrip().endswith(b"data: [DONE]")
    # A cancelled stream too (acks, cancel, tombstone, usage).
    status, _ = pipeline.post(CHAT, {**body, "stream": False})
    assert status == 200
    assert auth_server.violations() == [], "\n".join(auth_server.violations())


async def _connect(auth_server: AuthServer, role: str,
                   errors: list[str]) -> NATS:
    creds = auth_server.creds(role)

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    return await nats.connect(auth_server.url, user=creds["user"], password=creds["password"],
                              inbox_prefix=creds["inbox_prefix"], error_cb=on_error,
                              allow_reconnect=False)


async def _denied(auth_server: AuthServer, role: str,
                  action: Callable[[NATS], Awaitable[Any]]) -> str:
    """Run ``action`` as ``role``; the permissions violation the server reported."""
    errors: list[str] = []
    nc = await _connect(auth_server, role, errors)
    try:
        try:
            await action(nc)
            await nc.flush()
        except Exception as exc:  # a request that got no answer, a refused subscribe
            errors.append(f"{type(exc).__name__}: {exc}")
        # The server reports a violation asynchronously (-ERR).
        await wait_for(lambda: any("violation" in e.lower() for e in errors), 5)
    finally:
        await nc.close()
    found = [e for e in errors if "violation" in e.lower()]
    assert found, f"{role} was allowed: {errors}"
    return found[0]


async def _allowed(auth_server: AuthServer, role: str,
                   action: Callable[[NATS], Awaitable[Any]]) -> Any:
    errors: list[str] = []
    nc = await _connect(auth_server, role, errors)
    try:
        result = await action(nc)
        await nc.flush()
        await asyncio.sleep(0.2)
    finally:
        await nc.close()
    assert not [e for e in errors if "violation" in e.lower()], errors
    return result


def _api(subject: str, body: dict[str, Any] | None = None) -> Callable[[NATS], Awaitable[Any]]:
    async def call(nc: NATS) -> Any:
        reply = await nc.request(subject, json.dumps(body or {}).encode(), timeout=2)
        answer = json.loads(reply.data)
        if "error" in answer:
            raise RuntimeError(answer["error"])
        return answer
    return call


def _publish(subject: str, data: bytes = b"x") -> Callable[[NATS], Awaitable[Any]]:
    async def pub(nc: NATS) -> None:
        await nc.publish(subject, data)
    return pub


def _subscribe(subject: str) -> Callable[[NATS], Awaitable[Any]]:
    async def sub(nc: NATS) -> None:
        await nc.subscribe(subject)
        await nc.flush()
        await asyncio.sleep(0.3)
    return sub


WORKERS = f"workers_{encode_token('tidegate-sim')}"


@pytest.mark.asyncio
async def test_edge_credentials_cannot_pull_jobs_read_policies_write_keys_or_spoof_output(
        pipeline: Pipeline, auth_server: AuthServer) -> None:
    s = Subjects()
    await _denied(auth_server, "edge",
                  _api(f"$JS.API.CONSUMER.MSG.NEXT.{s.jobs_stream}.{WORKERS}", {"batch": 1}))
    await _denied(auth_server, "edge", _api(f"$JS.API.CONSUMER.CREATE.{s.jobs_stream}",
                                            {"stream_name": s.jobs_stream, "config": {}}))
    await _denied(auth_server, "edge",
                  _api(f"$JS.API.DIRECT.GET.KV_{s.policies_bucket}",
                       {"last_by_subj": f"$KV.{s.policies_bucket}.tenant.acme"}))
    await _denied(auth_server, "edge",
                  _api(f"$JS.API.STREAM.MSG.GET.KV_{s.policies_bucket}", {"seq": 1}))
    await _denied(auth_server, "edge", _api(f"$JS.API.CONSUMER.CREATE.KV_{s.policies_bucket}",
                                            {"stream_name": f"KV_{s.policies_bucket}"}))
    await _denied(auth_server, "edge", _subscribe(f"$KV.{s.policies_bucket}.>"))
    await _denied(auth_server, "edge", _subscribe(f"{s.prefix}.req.>"))
    await _denied(auth_server, "edge", _subscribe("_INBOX_dispatcher.>"))
    await _denied(auth_server, "edge", _subscribe("_INBOX.>"))
    # Forging a key, or another edge's (or its own) stream output.
    record = KeyRecord(key_id="f" * 12, tenant="evil").encode()
    await _denied(auth_server, "edge", _publish(f"$KV.{s.keys_bucket}.{'f' * 64}", record))
    await _denied(auth_server, "edge", _publish(s.out("another-edge", "a" * 24)))
    await _denied(auth_server, "edge", _publish(s.edge_mux(EDGE_ID)))
    await _denied(auth_server, "edge", _api(f"$JS.API.STREAM.DELETE.{s.jobs_stream}"))
    await _denied(auth_server, "edge", _api(f"$JS.API.STREAM.PURGE.KV_{s.keys_bucket}"))
    # What an edge needs still works with the same credentials.
    await _allowed(auth_server, "edge", _api(f"$JS.API.STREAM.INFO.{s.requests_stream}"))
    await _allowed(auth_server, "edge", _subscribe(s.edge_inbox(EDGE_ID)))


@pytest.mark.asyncio
async def test_worker_credentials_cannot_publish_requests_or_touch_keys(
        pipeline: Pipeline, auth_server: AuthServer) -> None:
    s = Subjects()
    await _denied(auth_server, "worker", _publish(s.request("interactive", "acme")))
    await _denied(auth_server, "worker", _publish(f"$KV.{s.keys_bucket}.{'e' * 64}", b"{}"))
    await _denied(auth_server, "worker", _publish(f"$KV.{s.policies_bucket}.tenant.x", b"{}"))
    await _denied(auth_server, "worker",
                  _api(f"$JS.API.CONSUMER.MSG.NEXT.{s.requests_stream}.dispatchers",
                       {"batch": 1}))
    await _denied(auth_server, "worker", _api(f"$JS.API.CONSUMER.CREATE.KV_{s.keys_bucket}",
                                              {"stream_name": f"KV_{s.keys_bucket}"}))
    await _denied(auth_server, "worker", _subscribe(f"{s.prefix}.out.>"))
    await _denied(auth_server, "worker", _subscribe("_INBOX_edge.>"))


@pytest.mark.asyncio
async def test_dispatcher_cannot_write_keys_and_admin_can(
        pipeline: Pipeline, auth_server: AuthServer) -> None:
    s = Subjects()
    digest = key_digest("sk-tg-permission-test")
    record = KeyRecord(key_id=digest[:12], tenant="perm").encode()
    await _denied(auth_server, "dispatcher", _publish(f"$KV.{s.keys_bucket}.{digest}", record))
    await _denied(auth_server, "dispatcher", _subscribe("_INBOX_worker.>"))
    # The control: admin may, and the edge then accepts the key it wrote.
    await _allowed(auth_server, "admin", _publish(f"$KV.{s.keys_bucket}.{digest}", record))
    deadline = time.monotonic() + 10
    while pipeline.post(CHAT, {"model": "sim", "max_tokens": 1,
                               "messages": [{"role": "user", "content": "x"}]},
                        key="sk-tg-permission-test")[0] != 200:
        assert time.monotonic() < deadline, "admin's key never reached the edge"
        await asyncio.sleep(0.2)


@pytest.mark.asyncio
async def test_unauthenticated_and_wrong_password_are_refused(auth_server: AuthServer) -> None:
    for kwargs in ({}, {"user": "tidegate-edge", "password": "wrong"}):
        with pytest.raises(Exception, match="Authorization Violation"):
            await nats.connect(auth_server.url, allow_reconnect=False,
                               max_reconnect_attempts=0, connect_timeout=2, **kwargs)


def test_roles_and_table_cover_every_tier() -> None:
    assert role_of("tidegate-edge-abc") == "edge"
    assert role_of("tidegate-dispatcher-stats") == "dispatcher"
    assert role_of("tidegate-worker-1") == "worker"
    assert role_of("tidegate-status") == "admin"
    assert role_of("something") == "admin"
    rules = table(Subjects("acme"))
    assert set(rules) == set(ROLES)
    # Derived from the prefix: a second deployment's rules name its own subjects.
    assert "acme.req.>" in rules["edge"].publish_allow
    assert "$KV.ACME_KEYS.>" in rules["edge"].publish_deny
    # The batch runner's inbox name lives in the dispatcher; the table must agree.
    from dispatcher.batch_state import INBOX

    assert Subjects().edge_inbox(INBOX) in table(Subjects())["dispatcher"].subscribe_allow
