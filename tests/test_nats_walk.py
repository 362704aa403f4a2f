"""The whole JetStream API surface, walked with each tier's NATS credentials.

Against a real nats-server running the ``auth.conf`` that ``tidegate
nats-config`` writes: every verb nats-server answers on every stream, bucket
and consumer tidegate makes (and ones it does not), plus acks, flow control
and KV/object writes, published with each tier's login. The test fails on any
subject where the server's answer and the ACCESS table
(tidegate.broker.permissions) disagree, either way, and independently if a
tier gets an admin verb or reads another role's streams. Also: with
restricted credentials a tier only binds to what ``tidegate setup`` made.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import nats
import nats.aio.msg
import pytest

from tests.pipeline import wait_for
from tests.test_nats_permissions import WORKERS, AuthServer
from tidegate.broker import natsconfig
from tidegate.broker.permissions import access, is_admin_verb, table
from tidegate.wire.subjects import Subjects

pytestmark = [pytest.mark.pipeline]


# -- the walk ------------------------------------------------------------------

# Every JetStream API subject nats-server answers (server/jetstream_api.go), with
# {s} a stream, {c} a consumer, {f} a filter or message subject.
API_SURFACE = (
    "INFO", "STREAM.NAMES", "STREAM.LIST", "META.LEADER.STEPDOWN", "SERVER.REMOVE",
    "ACCOUNT.PURGE.$G", "ACCOUNT.STREAM.MOVE.{s}.$G", "ACCOUNT.STREAM.CANCEL_MOVE.{s}.$G",
    "STREAM.CREATE.{s}", "STREAM.UPDATE.{s}", "STREAM.INFO.{s}", "STREAM.DELETE.{s}",
    "STREAM.PURGE.{s}", "STREAM.SNAPSHOT.{s}", "STREAM.RESTORE.{s}", "STREAM.MSG.DELETE.{s}",
    "STREAM.MSG.GET.{s}", "STREAM.LEADER.STEPDOWN.{s}", "STREAM.PEER.REMOVE.{s}",
    "DIRECT.GET.{s}", "DIRECT.GET.{s}.{f}",
    "CONSUMER.CREATE.{s}", "CONSUMER.CREATE.{s}.{c}", "CONSUMER.CREATE.{s}.{c}.{f}",
    "CONSUMER.DURABLE.CREATE.{s}.{c}", "CONSUMER.NAMES.{s}", "CONSUMER.LIST.{s}",
    "CONSUMER.INFO.{s}.{c}", "CONSUMER.DELETE.{s}.{c}", "CONSUMER.PAUSE.{s}.{c}",
    "CONSUMER.UNPIN.{s}.{c}", "CONSUMER.RESET.{s}.{c}", "CONSUMER.MSG.NEXT.{s}.{c}",
    "CONSUMER.LEADER.STEPDOWN.{s}.{c}",
)


def _buckets(s: Subjects) -> list[str]:
    p = s.prefix.upper()
    return [s.keys_bucket, s.policies_bucket, s.cancels_bucket, s.workers_bucket,
            s.affinity_bucket, s.claims_bucket, f"{p}_KEYUSE", f"{p}_TENANTS", f"{p}_EDGES",
            f"{p}_FILEMETA", f"{p}_BATCHES", f"{p}_BATCHOUT"]


def _streams(s: Subjects) -> dict[str, list[str]]:
    """Every stream tidegate makes (and one it does not), with its consumers
    (and one that does not exist)."""
    from tidegate.wire import streamlog

    streams = {s.requests_stream: [s.dispatcher_consumer],
               s.jobs_stream: [WORKERS, f"{WORKERS}__r1"],
               s.usage_stream: ["reconcilers"], streamlog.stream_name(s): [],
               f"OBJ_{s.prefix.upper()}_FILES": [], "EVIL_NEW": []}
    streams.update({f"KV_{b}": [] for b in _buckets(s)})
    return {name: [*consumers, "evil"] for name, consumers in streams.items()}


def _surface(s: Subjects) -> list[str]:
    """The concrete subjects the walk publishes to: the whole API surface over
    every stream and consumer, plus acks, flow control, KV and object writes."""
    out: list[str] = []
    for template in API_SURFACE:
        for stream, consumers in _streams(s).items():
            for consumer in consumers if "{c}" in template else [""]:
                subject = "$JS.API." + template.format(s=stream, c=consumer, f="x.y")
                if subject not in out:
                    out.append(subject)
        for stream, consumers in _streams(s).items():
            for consumer in consumers:
                out.append(f"$JS.ACK.{stream}.{consumer}.1.2.3.4.5")
            out.append(f"$JS.FC.{stream}.x.y")
    out += [f"$KV.{b}.key" for b in _buckets(s)]
    out.append(f"$O.{s.prefix.upper()}_FILES.C.x")
    return list(dict.fromkeys(out))


def _matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: ``*`` is one token, ``>`` one or more."""
    want, have = pattern.split("."), subject.split(".")
    for i, token in enumerate(want):
        if token == ">":
            return len(have) > i
        if i >= len(have) or (token != "*" and token != have[i]):
            return False
    return len(want) == len(have)


async def _walk(url: str, creds: dict[str, str], subjects: list[str]) -> set[str]:
    """Publish (no reply, empty body) to every subject; those the server let
    through, i.e. reported no permissions violation for. (nats-py lower-cases
    the server's -ERR text, so subjects are compared lower-cased.)"""
    end = "_WALK.END"  # denied to every tier: the last -ERR to wait for
    by_lower = {subject.lower(): subject for subject in [*subjects, end]}
    assert len(by_lower) == len(subjects) + 1
    denied: set[str] = set()
    other: list[str] = []

    async def on_error(exc: Exception) -> None:
        text = str(exc)
        m = re.search(r'(?i)permissions violation for publish to "([^"]+)"', text)
        if m:
            denied.add(by_lower[m.group(1).lower()])
        else:
            other.append(text)

    nc = await nats.connect(url, user=creds["user"], password=creds["password"],
                            inbox_prefix=creds["inbox_prefix"], error_cb=on_error,
                            allow_reconnect=False)
    try:
        for subject in [*subjects, end]:
            await nc.publish(subject, b"")
        await nc.flush(timeout=30)
        # The server checks in order: once the last one's -ERR is in, all are.
        assert await wait_for(lambda: end in denied, 30), "the server never answered the walk"
    finally:
        await nc.close()
    assert not other, other
    return set(subjects) - denied


@pytest.fixture(scope="module")
def walk_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AuthServer]:
    """A server of its own: a grant the table must not have (STREAM.DELETE)
    would run while walking, and must not break the pipeline's."""
    server = AuthServer(tmp_path_factory.mktemp("natswalk"))
    try:
        yield server
    finally:
        server.server.stop()


@pytest.mark.asyncio
@pytest.mark.parametrize("role", ["edge", "dispatcher", "worker"])
async def test_the_whole_jetstream_api_walk_matches_the_access_table(
        walk_server: AuthServer, role: str) -> None:
    s = Subjects()
    surface = _surface(s)
    allowed = await _walk(walk_server.url, walk_server.creds(role), surface)
    granted = table(s)[role].publish_allow
    expected = {subject for subject in surface if any(_matches(g, subject) for g in granted)}
    assert sorted(allowed - expected) == [], "the server allows what the table does not name"
    assert sorted(expected - allowed) == [], "the table names what the server denies"
    api = sorted(a.removeprefix("$JS.API.") for a in allowed if a.startswith("$JS.API."))
    # Independent of the table: no tier changes or destroys JetStream state...
    assert [a for a in api if is_admin_verb(a)] == []
    assert not [a for a in api if a.startswith(("STREAM.PURGE.", "ACCOUNT."))
                and not a.startswith("STREAM.PURGE.OBJ_")]
    # ...nor reads what its role has no business reading.
    never = {"edge": [s.jobs_stream, s.usage_stream, f"KV_{s.policies_bucket}",
                      f"KV_{s.workers_bucket}", f"KV_{s.prefix.upper()}_BATCHOUT"],
             "worker": [f"KV_{s.keys_bucket}", f"KV_{s.policies_bucket}", s.requests_stream,
                        s.usage_stream, f"OBJ_{s.prefix.upper()}_FILES"],
             "dispatcher": [s.jobs_stream]}[role]
    reads = ("STREAM.MSG.GET.", "DIRECT.GET.", "CONSUMER.CREATE.", "CONSUMER.MSG.NEXT.")
    # (The dispatcher reads jobs by sequence only: the queue-mode depth.)
    exempt = f"STREAM.MSG.GET.{s.jobs_stream}" if role == "dispatcher" else None
    leaks = [a for a in api for stream in never
             if a.startswith(reads) and f".{stream}" in f".{a}" and a != exempt]
    assert leaks == []
    if role == "edge":
        assert not [a for a in api if a.startswith(reads) and s.requests_stream in a]
    # Writes to the control buckets: admin only.
    for bucket in (s.keys_bucket, s.policies_bucket):
        assert f"$KV.{bucket}.key" not in allowed
    # The dispatcher reads the keys bucket (per-key rules of batch lines); no
    # other tier but the edge does.
    keys_get = f"DIRECT.GET.KV_{s.keys_bucket}.x.y"
    assert (keys_get in api) == (role in ("edge", "dispatcher"))


def test_the_access_table_names_exact_api_subjects() -> None:
    """No catch-all left: every API grant names a verb and a stream."""
    for role, line in access(Subjects()).items():
        for api in line.api:
            tokens = api.split(".")
            assert len(tokens) >= 3, (role, api)
            assert ">" not in tokens[:3], (role, api)


@pytest.mark.asyncio
async def test_a_tier_only_binds_and_names_setup_until_admin_has_run_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With restricted credentials a tier never tries to create (the server
    would log a violation and the request would hang until its timeout): it
    looks up, waits, and says to run ``tidegate setup``; after admin's setup
    the same calls bind."""
    from tidegate import config as tgconfig
    from tidegate.broker import broker
    from tidegate.control import provision
    from tidegate.control.keys import ensure_keys_bucket

    monkeypatch.setattr(broker, "_SETUP_PATIENCE", 1.0)
    server = AuthServer(tmp_path)
    try:
        config = tgconfig.from_dict({
            "nats": {"url": server.url,
                     "credentials": natsconfig.credentials_setting(server.auth_dir)},
            "models": [{"name": "tidegate-sim"}]})
        model = config.models[0]
        edge = await broker.connect(config.nats, "tidegate-edge-bind")
        worker = await broker.connect(config.nats, "tidegate-worker-bind")
        admin = await broker.connect(config.nats, "tidegate-admin")
        try:
            edge_js, worker_js = broker.jetstream(edge, config.nats), broker.jetstream(
                worker, config.nats)
            assert not broker.provisions(edge_js)
            assert broker.provisions(broker.jetstream(admin, config.nats))
            with pytest.raises(broker.NotProvisioned, match="tidegate setup"):
                await broker.ensure_streams(edge_js, config)
            with pytest.raises(broker.NotProvisioned, match="tidegate setup"):
                await ensure_keys_bucket(edge_js, config)
            with pytest.raises(broker.NotProvisioned, match="tidegate setup"):
                await provision.worker_consumer(worker_js, config, model)
            assert server.violations() == [], server.violations()

            await provision.provision(broker.jetstream(admin, config.nats), config)
            await broker.ensure_streams(edge_js, config)
            await ensure_keys_bucket(edge_js, config)
            assert await provision.worker_consumer(worker_js, config, model) == WORKERS
            assert server.violations() == [], server.violations()
        finally:
            for nc in (edge, worker, admin):
                await nc.close()
    finally:
        server.server.stop()


@pytest.mark.asyncio
async def test_known_gap_a_reader_push_consumer_delivers_where_it_may_not_publish(
        tmp_path: Path) -> None:
    """nats-server issue 8274, pinned as docs/security.md describes it: an edge
    (which may write the stream log and read it) can have the server deliver a
    log entry it wrote to another edge's ``<p>.out.<edge>.<request>``, which it
    may not publish to; a stream's own subjects are not a push consumer's
    interest, so nothing lands in the jobs stream that way. When the server
    starts checking deliver subjects this test fails: update the doc."""
    import json

    from tidegate import config as tgconfig
    from tidegate.broker import broker
    from tidegate.control import provision
    from tidegate.wire import streamlog

    server = AuthServer(tmp_path)
    s = Subjects()
    try:
        config = tgconfig.from_dict({
            "nats": {"url": server.url,
                     "credentials": natsconfig.credentials_setting(server.auth_dir)},
            "models": [{"name": "tidegate-sim"}]})
        admin = await broker.connect(config.nats, "tidegate-admin")
        edge = await broker.connect(config.nats, "tidegate-edge-gap")
        try:
            admin_js = broker.jetstream(admin, config.nats)
            await provision.provision(admin_js, config)
            victim = s.out("another-edge", "r" * 24)
            got: list[bytes] = []

            async def on_msg(msg: nats.aio.msg.Msg) -> None:
                got.append(msg.data)

            await admin.subscribe(victim, cb=on_msg)
            await admin.flush()
            await edge.jetstream().publish(streamlog.subject(s, "gap"), b"forged")
            for deliver in (s.job("tidegate-sim"), victim):
                reply = await edge.request(
                    f"$JS.API.CONSUMER.CREATE.{streamlog.stream_name(s)}",
                    json.dumps({"stream_name": streamlog.stream_name(s), "config": {
                        "deliver_subject": deliver, "ack_policy": "none",
                        "filter_subject": streamlog.subject(s, "gap")}}).encode(), timeout=5)
                assert "error" not in json.loads(reply.data), reply.data
            assert await wait_for(lambda: got == [b"forged"], 10), got
            jobs = await admin_js.stream_info(s.jobs_stream)
            assert jobs.state.messages == 0
        finally:
            await edge.close()
            await admin.close()
    finally:
        server.server.stop()
