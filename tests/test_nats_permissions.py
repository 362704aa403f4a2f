"""NATS least privilege against a real nats-server (tidegate.broker.permissions).

The server runs with the ``auth.conf`` that ``tidegate nats-config`` writes;
``tidegate setup`` provisions as admin, the whole pipeline serves under it
(each tier with its own credentials), and each tier's credentials are then
tried on what they must not do: the attacks of issue 24 among them. The walk
of the whole ``$JS.API.>`` surface is tests/test_nats_walk.py.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.aio.client import Client as NATS

from bench.fake_backend import FakeBackend
from fleet.run.servers import NatsServer
from tests.pipeline import (
    DEV_KEY,
    Pipeline,
    running_pipeline,
    threaded_fake_backend,
    wait_for,
)
from tidegate.broker import natsconfig
from tidegate.broker.auth import load_credentials
from tidegate.broker.kvwatch import snapshot
from tidegate.broker.permissions import ROLES, role_of, table
from tidegate.control.keys import KeyRecord, key_digest
from tidegate.wire.protocol import UsageRecord
from tidegate.wire.subjects import Subjects, encode_token

pytestmark = [pytest.mark.pipeline]

CHAT = "/v1/chat/completions"
ROUTED = "routed-model"
EDGE_ID = "permedge"


class AuthServer:
    """nats-server under ``tidegate nats-config``'s auth.conf (``edges``: one
    login per edge, as ``--edges`` writes)."""

    def __init__(self, workdir: Path, edges: tuple[str, ...] = ()) -> None:
        self.auth_dir = workdir / "auth"
        self.auth = natsconfig.write(self.auth_dir, Subjects(), edges=edges)
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
def replicas() -> Iterator[tuple[FakeBackend, FakeBackend]]:
    with threaded_fake_backend(ttft=0.01, itl=0.001, tokens=4) as a, \
            threaded_fake_backend(ttft=0.01, itl=0.001, tokens=4) as b:
        yield a, b


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory, auth_server: AuthServer,
             module_redis_url: str, replicas: tuple[FakeBackend, FakeBackend]
             ) -> Iterator[Pipeline]:
    # Besides the simulator: a queue-mode model (the dispatchers' grant
    # subjects) and a routed model of two replicas (the affinity and claims
    # buckets, the load subjects, a consumer per replica), so every feature's
    # subjects run under the rules.
    models: list[dict[str, Any]] = [
        {"name": "tidegate-sim", "aliases": ["sim"],
         "simulator": {"ttft": 0.01, "tokens_per_second": 400.0, "length": 32}},
        {"name": "queued-sim", "simulator": {"ttft": 0.01, "tokens_per_second": 400.0,
                                             "length": 8},
         "queue": {"ttft_p99": 30.0}},
        {"name": ROUTED, "backend": "openai", "base_urls": [f.base_url for f in replicas]},
    ]
    yield from running_pipeline(
        tmp_path_factory.mktemp("permpipe"), auth_server.url, module_redis_url,
        overrides={"nats": {"credentials": natsconfig.credentials_setting(auth_server.auth_dir)},
                   "edge": {"edge_id": EDGE_ID}, "models": models,
                   "routing": {"affinity": "auto", "max_affinity_wait": 3.0}})


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
    # A queue-mode model and a routed one (a conversation goes home).
    for model in ("queued-sim", ROUTED, ROUTED):
        status, data = pipeline.post(CHAT, {**body, "model": model})
        assert status == 200, data[:300]
        assert data.rstrip().endswith(b"data: [DONE]")
    assert auth_server.violations() == [], "\n".join(auth_server.violations())


def test_resume_batches_and_files_work_under_the_permissions(
        pipeline: Pipeline, auth_server: AuthServer) -> None:
    """The features whose streams and buckets the tiers only bind to (the
    stream log, the batch buckets, the files object store): each works, and
    the server reports no violation."""
    import io

    import openai

    body = {"model": "tidegate-sim", "stream": True, "max_tokens": 4,
            "messages": [{"role": "user", "content": "resume me"}]}
    status, headers, data = pipeline.post_full(CHAT, body,
                                               headers={"X-Tidegate-Resumable": "true"})
    assert status == 200, data[:300]
    request_id = headers["x-request-id"]
    replay = urllib.request.Request(f"{pipeline.url}/v1/streams/{request_id}?after=0",
                                    headers={"Authorization": f"Bearer {DEV_KEY}"})
    with urllib.request.urlopen(replay, timeout=30) as resp:
        assert resp.status == 200
        assert resp.read().rstrip().endswith(b"data: [DONE]")

    async def batch() -> list[str]:
        async with openai.AsyncOpenAI(base_url=pipeline.base_url, api_key=DEV_KEY,
                                      max_retries=0, timeout=30) as client:
            lines = b"".join(json.dumps(
                {"custom_id": f"c{i}", "method": "POST", "url": CHAT,
                 "body": {"model": "tidegate-sim", "max_tokens": 3,
                          "messages": [{"role": "user", "content": f"line {i}"}]}}).encode()
                + b"\n" for i in range(3))
            file = await client.files.create(file=("in.jsonl", io.BytesIO(lines)),
                                             purpose="batch")
            created = await client.batches.create(input_file_id=file.id,
                                                  endpoint="/v1/chat/completions",
                                                  completion_window="24h")
            done = created
            deadline = time.monotonic() + 90
            while done.status not in ("completed", "failed", "expired", "cancelled"):
                assert time.monotonic() < deadline, f"batch still {done.status}"
                await asyncio.sleep(0.3)
                done = await client.batches.retrieve(created.id)
            assert done.status == "completed", done
            assert done.output_file_id is not None
            output = await client.files.content(done.output_file_id)
            await client.files.delete(file.id)
            return sorted(json.loads(line)["custom_id"]
                          for line in output.content.splitlines() if line.strip())

    assert asyncio.run(batch()) == ["c0", "c1", "c2"]
    assert auth_server.violations() == [], "\n".join(auth_server.violations())


async def connect_as(auth_server: AuthServer, role: str, errors: list[str]) -> NATS:
    """A client with ``role``'s login (a credentials name: ``edge.<id>`` too),
    named as that tier's processes are (so its JetStream binds, never creates)."""
    creds = auth_server.creds(role)

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    return await nats.connect(auth_server.url, user=creds["user"], password=creds["password"],
                              inbox_prefix=creds["inbox_prefix"], error_cb=on_error,
                              allow_reconnect=False, name=f"tidegate-{role}-test")


async def _denied(auth_server: AuthServer, role: str,
                  action: Callable[[NATS], Awaitable[Any]]) -> str:
    """Run ``action`` as ``role``; the permissions violation the server reported."""
    errors: list[str] = []
    nc = await connect_as(auth_server, role, errors)
    async def attempt() -> None:
        try:
            await action(nc)
            await nc.flush()
        except Exception as exc:  # a request that got no answer, a refused subscribe
            errors.append(f"{type(exc).__name__}: {exc}")

    task = asyncio.ensure_future(attempt())
    try:
        # The server reports a violation asynchronously (-ERR); a denied
        # request gets no answer, so stop waiting for one once the violation
        # is in. A positive event: a loaded machine may take long, a pass
        # costs nothing.
        await wait_for(lambda: any("violation" in e.lower() for e in errors), 30)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await nc.close()
    found = [e for e in errors if "violation" in e.lower()]
    assert found, f"{role} was allowed: {errors}"
    return found[0]


async def _allowed(auth_server: AuthServer, role: str,
                   action: Callable[[NATS], Awaitable[Any]]) -> Any:
    errors: list[str] = []
    nc = await connect_as(auth_server, role, errors)
    try:
        result = await action(nc)
        # The positive event that gives a violation its chance: the server
        # answers a command's violation (-ERR) as it processes it, before the
        # flush's PING that follows it, and the client runs the error
        # callback before it reads the PONG. Once the flush returns, every
        # violation of the action has been recorded; no sleep to guess at.
        await nc.flush()
    finally:
        await nc.close()
    assert not [e for e in errors if "violation" in e.lower()], errors
    return result


def _api(subject: str, body: dict[str, Any] | None = None) -> Callable[[NATS], Awaitable[Any]]:
    async def call(nc: NATS) -> Any:
        reply = await nc.request(subject, json.dumps(body or {}).encode(), timeout=15)
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
    # A usage record bills a tenant (and settles a reservation): workers only.
    forged = UsageRecord(id="a" * 24, model="tidegate-sim", outcome="done",
                         completion_tokens=10**9, tenant="acme").encode()
    await _denied(auth_server, "edge", _publish(s.usage("tidegate-sim"), forged))
    # What an edge needs still works with the same credentials.
    await _allowed(auth_server, "edge", _api(f"$JS.API.STREAM.INFO.{s.requests_stream}"))
    await _allowed(auth_server, "edge", _subscribe(s.edge_inbox(EDGE_ID)))


@pytest.mark.asyncio
async def test_stolen_edge_credentials_cannot_give_away_forge_or_delete_files_and_batches(
        pipeline: Pipeline, auth_server: AuthServer) -> None:
    """Issue 44 row 7: an edge's records of files and batches are a
    dispatcher's to write (tidegate.control.desk). With the edge's login, a
    file record that gives a file to another tenant, a batch that bills one,
    an object's meta (which names its content) and a purge are refused; the
    chunks of an upload and a question to the desk are what it may send."""
    s = Subjects()
    files, meta, batches = "TG_FILES", "TG_FILEMETA", "TG_BATCHES"
    file_id = "file-" + "a" * 32
    owner_changed = json.dumps({"id": file_id, "tenant": "evil", "size": 1, "created_at": 0,
                                "filename": "x", "purpose": "batch"}).encode()
    await _denied(auth_server, "edge", _publish(f"$KV.{meta}.{file_id}", owner_changed))
    await _denied(auth_server, "edge", _publish(f"$KV.{batches}.batch_{'b' * 32}", b"{}"))
    await _denied(auth_server, "edge", _publish(f"$O.{files}.M.ZmlsZQ==", b"{}"))
    await _denied(auth_server, "edge", _api(f"$JS.API.STREAM.PURGE.OBJ_{files}"))
    await _allowed(auth_server, "edge", _publish(f"$O.{files}.C.{file_id}", b"chunk"))
    await _allowed(auth_server, "edge", _publish(s.desk, b"not an ask"))


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
async def test_a_worker_may_ask_another_whether_it_runs_a_job_but_not_command_it(
        pipeline: Pipeline, auth_server: AuthServer) -> None:
    """A redelivered job no edge speaks for asks its first worker, on that
    worker's presence subject, whether it still runs it (workers.resumable);
    the answer goes to the asking worker's inbox. Workers still cannot
    publish to each other's control subjects (a cancel, an ack)."""
    s = Subjects()
    await _allowed(auth_server, "worker", _subscribe(s.presence("w1")))
    await _allowed(auth_server, "worker", _publish(s.presence("w1"), b"request-id"))
    await _allowed(auth_server, "worker", _publish("_INBOX_worker.reply", b"1"))
    await _denied(auth_server, "worker", _publish(s.control("w1")))
    await _denied(auth_server, "edge", _publish("_INBOX_worker.reply", b"1"))


@pytest.mark.asyncio
async def test_dispatcher_cannot_write_keys_and_admin_can(
        pipeline: Pipeline, auth_server: AuthServer) -> None:
    s = Subjects()
    digest = key_digest("sk-tg-permission-test")
    record = KeyRecord(key_id=digest[:12], tenant="perm").encode()
    await _denied(auth_server, "dispatcher", _publish(f"$KV.{s.keys_bucket}.{digest}", record))
    await _denied(auth_server, "dispatcher", _subscribe("_INBOX_worker.>"))
    # ... but reads them: the batch runner holds each line to its key's rules
    # (dispatcher/batch/keys.py), through a KV watch like the edge's.

    async def watch_keys(nc: NATS) -> dict[str, bytes]:
        kv = await nc.jetstream().key_value(s.keys_bucket)
        return await asyncio.wait_for(snapshot(kv), 10)

    await _allowed(auth_server, "dispatcher", watch_keys)
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
    assert "$JS.API.DIRECT.GET.KV_ACME_KEYS.>" in rules["edge"].publish_allow
    assert not [a for a in rules["edge"].publish_allow if "ACME_KEYS" in a and "$KV" in a]
    # An allow list only: nothing relies on a deny rule.
    assert all(not r.publish_deny and not r.subscribe_deny for r in rules.values())
    # The batch runner's inbox name lives in the dispatcher; the table must agree.
    from dispatcher.batch.state import INBOX

    assert Subjects().edge_inbox(INBOX) in table(Subjects())["dispatcher"].subscribe_allow


# -- issue 24: what the edge's and worker's credentials did to JetStream ----------


def _mirror(name: str, source: str) -> dict[str, Any]:
    return {"name": name, "subjects": [], "mirror": {"name": source}, "storage": "memory"}


@pytest.mark.asyncio
async def test_tier_credentials_cannot_mirror_source_shrink_or_delete_consumers(
        pipeline: Pipeline, auth_server: AuthServer) -> None:
    s = Subjects()
    kv_policies, kv_keys = f"KV_{s.policies_bucket}", f"KV_{s.keys_bucket}"
    for source in (kv_policies, s.jobs_stream, s.requests_stream, s.usage_stream):
        await _denied(auth_server, "edge",
                      _api(f"$JS.API.STREAM.CREATE.STEAL_{source}", _mirror("STEAL", source)))
    await _denied(auth_server, "worker",
                  _api("$JS.API.STREAM.CREATE.STEAL_KEYS", _mirror("STEAL_KEYS", kv_keys)))
    # A source with a subject transform injected a forged job into TG_JOBS.
    forged = {"name": s.jobs_stream, "subjects": [s.jobs_wildcard], "retention": "workqueue",
              "sources": [{"name": s.requests_stream, "subject_transforms": [
                  {"src": f"{s.prefix}.req.>", "dest": f"{s.prefix}.job.x"}]}]}
    for role in ("edge", "worker", "dispatcher"):
        await _denied(auth_server, role, _api(f"$JS.API.STREAM.UPDATE.{s.jobs_stream}", forged))
        await _denied(auth_server, role, _api(
            f"$JS.API.STREAM.UPDATE.{s.usage_stream}",
            {"name": s.usage_stream, "subjects": [s.usage_wildcard], "max_msgs": 1}))
    for role in ("edge", "worker"):
        await _denied(auth_server, role,
                      _api(f"$JS.API.CONSUMER.DELETE.{s.jobs_stream}.{WORKERS}"))
        await _denied(auth_server, role, _api(
            f"$JS.API.CONSUMER.DELETE.{s.requests_stream}.{s.dispatcher_consumer}"))
    # The usage log is still whole, and the consumers still there.
    info = await _allowed(auth_server, "admin", _api(f"$JS.API.STREAM.INFO.{s.usage_stream}"))
    assert info["config"].get("max_msgs", -1) == -1
    await _allowed(auth_server, "admin",
                   _api(f"$JS.API.CONSUMER.INFO.{s.jobs_stream}.{WORKERS}"))


@pytest.mark.asyncio
async def test_a_reader_makes_only_ephemerals_and_the_dispatcher_reads_keys_read_only(
        pipeline: Pipeline, auth_server: AuthServer) -> None:
    """The grant that lets a tier watch a bucket (CONSUMER.CREATE.<stream>, no
    name) cannot make or change a durable: the server refuses a durable name on
    that subject, so the tiers' durables stay admin's."""
    s = Subjects()
    kv_keys = f"KV_{s.keys_bucket}"
    durable = {"stream_name": kv_keys,
               "config": {"durable_name": "stolen", "ack_policy": "explicit"}}
    with pytest.raises(RuntimeError, match=r"(?i)durable"):
        await _allowed(auth_server, "dispatcher", _api(f"$JS.API.CONSUMER.CREATE.{kv_keys}",
                                                       durable))
    # What the batch runner re-checks a line's key with: a direct get.
    digest = key_digest("sk-tg-permission-read")
    record = KeyRecord(key_id=digest[:12], tenant="perm").encode()
    await _allowed(auth_server, "admin", _publish(f"$KV.{s.keys_bucket}.{digest}", record))

    async def get(nc: NATS) -> bytes:
        js = nc.jetstream()
        kv = await js.key_value(s.keys_bucket)
        entry = await kv.get(digest)
        return entry.value or b""

    assert await _allowed(auth_server, "dispatcher", get) == record
    await _denied(auth_server, "worker", get)
    await _denied(auth_server, "dispatcher", _publish(f"$KV.{s.keys_bucket}.{digest}", b"{}"))


@pytest.mark.asyncio
async def test_the_routing_grants_are_the_ones_routing_uses(
        pipeline: Pipeline, auth_server: AuthServer) -> None:
    """Routing's KV use, through the product's own code under each tier's
    login: a worker claims a routed job's copy (a create, then a get when the
    other copy came first) and writes a conversation's home; a dispatcher's
    fallback reads a claim. What neither does is not granted: a worker
    watches no claims or homes and writes no cancels; a dispatcher writes no
    claims or homes."""
    from nats.aio.msg import Msg

    from tidegate.broker import broker
    from tidegate.control.affinity import ensure_buckets
    from tidegate.wire.affinity import CLAIM_HEADER
    from workers.routing import Claim, WorkerRouting

    config, s = pipeline.config, Subjects()
    request_id = "claimed" + "0" * 17

    def copy(name: str) -> Msg:
        return Msg(None, subject="x", data=b"", headers={CLAIM_HEADER: name})  # type: ignore[arg-type]

    async def claim_both(nc: NATS) -> list[str]:
        homes, claims = await ensure_buckets(broker.jetstream(nc, config.nats), config)
        routing = WorkerRouting(nc, homes, claims, s.affinity_bucket)
        verdicts = [await routing.claim(copy("routed"), request_id),
                    await routing.claim(copy("fallback"), request_id),
                    await routing.claim(copy("routed"), request_id)]  # its own, redelivered
        await nc.publish(f"$KV.{s.affinity_bucket}.grants-home", b"r1")  # note_home's write
        return verdicts

    assert await _allowed(auth_server, "worker", claim_both) == [Claim.RUN, Claim.DROP,
                                                                 Claim.RUN]

    async def read_claim(nc: NATS) -> bytes:
        _, claims = await ensure_buckets(broker.jetstream(nc, config.nats), config)
        return (await claims.get(request_id)).value or b""

    assert await _allowed(auth_server, "dispatcher", read_claim) == b"routed"
    for bucket in (s.claims_bucket, s.affinity_bucket):
        await _denied(auth_server, "worker", _api(f"$JS.API.CONSUMER.CREATE.KV_{bucket}",
                                                  {"stream_name": f"KV_{bucket}"}))
        await _denied(auth_server, "dispatcher", _publish(f"$KV.{bucket}.forged", b"r2"))
    await _denied(auth_server, "worker", _publish(s.cancel_key(request_id), b"forged"))


@pytest.mark.asyncio
async def test_a_worker_reads_and_records_response_owners_under_its_login(
        pipeline: Pipeline, auth_server: AuthServer) -> None:
    """workers.owners with the worker's login: a follow-up naming a response
    its tenant owns passes, another tenant's is refused as not found."""
    from tidegate.broker import broker
    from tidegate.errors import BackendError
    from tidegate.wire.protocol import Api, Request
    from workers.owners import ResponseOwners

    config = pipeline.config

    async def owners(nc: NATS) -> list[str]:
        kv = await broker.ensure_owners_bucket(broker.jetstream(nc, config.nats), config)
        table = ResponseOwners(kv, 15.0)
        await table.record("resp_grants1", "acme")
        outcomes = []
        for tenant in ("acme", "evil"):
            follow_up = Request(id="f" * 24, reply="x", model="tidegate-sim",
                                api=Api.RESPONSES, stream=False, created_ms=0, deadline_ms=0,
                                body={"previous_response_id": "resp_grants1"},
                                window_bytes=1024, window_msgs=8, tenant=tenant)
            try:
                await table.check(follow_up)
                outcomes.append("ok")
            except BackendError as exc:
                outcomes.append(str(exc.code))
        return outcomes

    assert await _allowed(auth_server, "worker", owners) == ["ok",
                                                            "previous_response_not_found"]


@pytest.mark.asyncio
async def test_only_a_dispatcher_asks_for_a_preemption_and_only_workers_hear_it(
        pipeline: Pipeline, auth_server: AuthServer) -> None:
    """workers.preemption: a stolen edge or worker login cannot make
    background work hand its slots back (each hand-back costs a delivery)."""
    s = Subjects()
    await _allowed(auth_server, "dispatcher", _publish(s.preempt("tidegate-sim")))
    await _allowed(auth_server, "worker", _subscribe(s.preempt("tidegate-sim")))
    await _denied(auth_server, "edge", _publish(s.preempt("tidegate-sim")))
    await _denied(auth_server, "worker", _publish(s.preempt("tidegate-sim")))
    await _denied(auth_server, "edge", _subscribe(s.preempt_wildcard))
