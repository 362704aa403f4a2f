"""tidegate.mux against real servers: the Outbox on a nats-server (also one
with a small max_payload), and the whole pipeline (edge, dispatcher, worker,
nats-server, redis-server) with coalescing on and off."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import nats
import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from bench.fake_backend import FakeBackend
from edge.session import SessionTable
from fleet.run.servers import NatsServer
from tests.pipeline import DEV_KEY, Pipeline, record_for, threaded_fake_backend, wait_for
from tests.servers import ServerHandle
from tidegate.errors import ProtocolError
from tidegate.wire.mux import Outbox, batch_limit, decode_mux
from tidegate.wire.protocol import (
    Chunk,
    Done,
    Head,
    Heartbeat,
    decode_session,
    encode_chunk,
)
from tidegate.wire.subjects import MUX_TOKEN, Subjects

NEVER = 3600.0  # a session tick interval that never fires within a test

# --------------------------------------------------------------------------
# Against a real nats-server
# --------------------------------------------------------------------------


@pytest.fixture
async def nc_pair(nats_server: ServerHandle) -> AsyncIterator[tuple[NATS, NATS]]:
    """(publisher, subscriber): two connections, as worker and edge have."""
    pub = await nats.connect(nats_server.url)
    sub = await nats.connect(nats_server.url)
    try:
        yield pub, sub
    finally:
        await pub.close()
        await sub.close()


async def subscribed(nc: NATS) -> None:
    """Return once the server has every subscription made on ``nc``. One
    flush is not enough with nats-py 2.16: its PING is written to the socket
    at once while the SUBs wait in the client's pending buffer for the flusher
    task, so the PONG can come back before the server has the SUBs. A second
    flush's PING goes out behind them."""
    await nc.flush()
    await nc.flush()


class Inbox:
    """A subscription that keeps every message it gets."""

    def __init__(self) -> None:
        self.messages: list[Msg] = []

    async def cb(self, m: Msg) -> None:
        self.messages.append(m)

    def frames(self) -> list[tuple[str, bytes]]:
        return [frame for m in self.messages for frame in decode_mux(m.data)]

    async def wait_frames(self, n: int, within: float = 5.0) -> None:
        await wait_for(lambda: len(self.frames()) >= n, within)


async def test_real_nats_one_iteration_is_one_message(nc_pair: tuple[NATS, NATS]) -> None:
    pub, sub = nc_pair
    subject = Subjects("mx").edge_mux("edge1")
    inbox = Inbox()
    await sub.subscribe(subject, cb=inbox.cb)
    await subscribed(sub)
    box = Outbox(pub.publish)
    box.start()
    try:
        sent = [(f"{i % 20:024x}", encode_chunk(i + 2, b'data: {"token": %d}\n\n' % i))
                for i in range(200)]
        for rid, m in sent:
            box.put(subject, rid, m)
        await box.flush()
        await pub.flush()
        await inbox.wait_frames(200)
    finally:
        await box.close()
    assert inbox.frames() == sent
    assert len(inbox.messages) == 1
    assert inbox.messages[0].subject == subject
    assert (box.published, box.frames) == (1, 200)


async def test_real_nats_each_edge_gets_only_its_frames_in_order(
        nc_pair: tuple[NATS, NATS]) -> None:
    pub, sub = nc_pair
    subjects = Subjects("mx")
    edges = ["e1", "e2", "e3"]
    inboxes = {e: Inbox() for e in edges}
    for e in edges:
        await sub.subscribe(subjects.edge_mux(e), cb=inboxes[e].cb)
    await subscribed(sub)
    box = Outbox(pub.publish, max_bytes=4096)  # small: several cut batches per edge
    box.start()
    sent: dict[str, list[tuple[str, bytes]]] = defaultdict(list)
    try:
        for i in range(600):
            e = edges[i % 3] if i % 5 else edges[(i // 5) % 3]  # interleaved, unevenly
            frame = (f"{e}-{i % 4}", encode_chunk(i, b"x" * (i % 97)))
            sent[e].append(frame)
            box.put(subjects.edge_mux(e), *frame)
            if i % 50 == 49:
                await asyncio.sleep(0)  # and over several loop iterations
        await box.flush()
        await pub.flush()
        for e in edges:
            await inboxes[e].wait_frames(len(sent[e]))
    finally:
        await box.close()
    for e in edges:
        assert inboxes[e].frames() == sent[e], f"edge {e} got the wrong frames"
        assert all(m.subject == subjects.edge_mux(e) for m in inboxes[e].messages)
        assert all(len(m.data) <= 4096 for m in inboxes[e].messages)
    total = sum(len(i.messages) for i in inboxes.values())
    assert box.published == total
    assert box.frames == 600
    assert total < 600 // 4  # coalesced


async def test_real_nats_outbox_to_edge_session_table(nc_pair: tuple[NATS, NATS]) -> None:
    """Worker-side Outbox -> nats-server -> the edge's inbox wildcard and table."""
    pub, sub = nc_pair
    subjects = Subjects("mx")
    table = SessionTable(subjects.edge_inbox("edge9")[:-1])
    ids = [uuid.uuid4().hex[:24] for _ in range(5)]
    sessions = {rid: table.open(rid, NEVER) for rid in ids}
    got: dict[str, list[Any]] = defaultdict(list)

    async def on_out(m: Msg) -> None:
        table.dispatch(m.subject, m.data)
        for rid, s in sessions.items():
            got[rid].extend(s.take())

    await sub.subscribe(subjects.edge_inbox("edge9"), cb=on_out)
    await subscribed(sub)
    box = Outbox(pub.publish)
    box.start()
    try:
        mux = subjects.edge_mux("edge9")
        for rid in ids:
            box.put(mux, rid, Head(1, "mx.ctl.w").encode())
        for seq in range(2, 42):
            for rid in ids:
                box.put(mux, rid, encode_chunk(seq, f"{rid}:{seq}".encode()))
            if seq % 10 == 0:
                await asyncio.sleep(0)
        for rid in ids:
            box.put(mux, rid, Done(42, 1, 40, "stop").encode())
        # A plain per-request message on the same wildcard still works.
        await pub.publish(subjects.out("edge9", ids[0]), Heartbeat(43).encode())
        await box.flush()
        await pub.flush()
        await wait_for(lambda: sum(len(v) for v in got.values()) >= 5 * 42 + 1, 5.0)
    finally:
        await box.close()
        for s in sessions.values():
            table.close(s)
    for rid in ids:
        expected: list[Any] = [Head(1, "mx.ctl.w"),
                               *(Chunk(seq, f"{rid}:{seq}".encode()) for seq in range(2, 42)),
                               Done(42, 1, 40, "stop")]
        if rid == ids[0]:
            # Different subject, different publish call: only its place among
            # this session's worker messages is not ordered against the mux.
            assert Heartbeat(43) in got[rid]
            got[rid].remove(Heartbeat(43))
        assert got[rid] == expected


# --------------------------------------------------------------------------
# The whole pipeline: edge, dispatcher, worker on real nats-server and redis
# --------------------------------------------------------------------------

TOKEN_TEXTS = [" " + c * 3 for c in "abcdefghijklmnopqrstuvwxyz"]  # the fake's 4-byte tokens


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeBackend]:
    with threaded_fake_backend(models=["fake"], ttft=0.01, itl=0.004, tokens=10**6) as backend:
        yield backend


def start_pipeline(workdir: Path, nats_url: str, redis_url: str, backend: FakeBackend,
                   worker: dict[str, Any] | None = None) -> Pipeline:
    pipeline = Pipeline(workdir, nats_url, redis_url, overrides={
        "nats": {"subject_prefix": "m" + uuid.uuid4().hex[:8]},
        "worker": {"ack_wait": 3.0, "shutdown_timeout": 3.0, **(worker or {})},
        "edge": {"shutdown_timeout": 3.0},
        "models": [{"name": "fake", "backend": "openai", "base_url": backend.base_url,
                    "max_streams": 64}],
    })
    pipeline.start()
    return pipeline


class OutTap:
    """A separate NATS connection watching everything sent to edges."""

    def __init__(self) -> None:
        self.mux_messages = 0
        self.mux_frames = 0
        self.mux_kinds: dict[str, int] = defaultdict(int)  # session message kinds in mux
        self.direct_kinds: dict[str, int] = defaultdict(int)  # on per-request subjects
        self.errors: list[str] = []

    async def cb(self, m: Msg) -> None:
        try:
            if m.subject.rsplit(".", 1)[1] == MUX_TOKEN:
                self.mux_messages += 1
                for _, message in decode_mux(m.data):
                    self.mux_frames += 1
                    self.mux_kinds[type(decode_session(message)).__name__] += 1
            else:
                self.direct_kinds[type(decode_session(m.data)).__name__] += 1
        except ProtocolError as exc:
            self.errors.append(f"{m.subject}: {exc}")


async def stream_chat(session: aiohttp.ClientSession, pipeline: Pipeline, marker: str,
                      max_tokens: int) -> list[str]:
    body = {"model": "fake", "stream": True, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": marker}]}
    async with session.post(f"{pipeline.url}/v1/chat/completions", json=body,
                            headers={"Authorization": f"Bearer {DEV_KEY}"}) as resp:
        text = await resp.text()
        assert resp.status == 200, text
    return [line[6:] for line in text.split("\n") if line.startswith("data: ")]


def check_stream(backend: FakeBackend, marker: str, max_tokens: int, events: list[str]) -> None:
    """Every token, in order, from this request's own backend response, then [DONE]."""
    assert events, f"{marker}: no events"
    assert events[-1] == "[DONE]", f"{marker}: ends with {events[-1][:200]!r}"
    payloads = [json.loads(e) for e in events[:-1]]
    assert not [p for p in payloads if "error" in p], f"{marker}: error event"
    [record] = record_for(backend, marker)
    ids = {p["id"] for p in payloads}
    assert ids == {f"chatcmpl-fake{record.id}"}, f"{marker}: events of another stream: {ids}"
    content = "".join(c["delta"].get("content") or "" for p in payloads for c in p["choices"])
    assert content == "".join(TOKEN_TEXTS[i % 26] for i in range(max_tokens)), marker
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"


async def run_load(pipeline: Pipeline, backend: FakeBackend, nats_url: str,
                   n: int = 20) -> OutTap:
    tap = OutTap()
    nc = await nats.connect(nats_url)
    try:
        prefix = pipeline.config.nats.subject_prefix
        await nc.subscribe(f"{prefix}.out.>", cb=tap.cb)
        await subscribed(nc)
        run = uuid.uuid4().hex[:8]
        # Distinct lengths, so a stream that got another's output would show.
        jobs = {f"mux-{run}-{i}-end": 40 + i for i in range(n)}
        timeout = aiohttp.ClientTimeout(total=30)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                         timeout=timeout) as session:
            results = await asyncio.gather(
                *(stream_chat(session, pipeline, m, k) for m, k in jobs.items()))
        await nc.flush()
        await asyncio.sleep(0.2)  # the tap's last messages
    finally:
        await nc.close()
    for (marker, max_tokens), events in zip(jobs.items(), results, strict=True):
        check_stream(backend, marker, max_tokens, events)
    assert not tap.errors, tap.errors[:3]
    return tap


@pytest.mark.pipeline
async def test_pipeline_streams_are_coalesced_and_complete(
        tmp_path: Path, module_nats_url: str, module_redis_url: str, fake: FakeBackend) -> None:
    pipeline = start_pipeline(tmp_path, module_nats_url, module_redis_url, fake)
    try:
        tap = await run_load(pipeline, fake, module_nats_url)
    finally:
        pipeline.stop()
    print(f"mux: {tap.mux_frames} frames in {tap.mux_messages} messages; "
          f"kinds {dict(tap.mux_kinds)}; per-request {dict(tap.direct_kinds)}")
    assert tap.mux_messages > 0
    assert tap.mux_frames > tap.mux_messages, "no two session messages ever shared a message"
    # Every worker -> edge message of these jobs went through the outbox; only
    # the dispatcher's Status messages use the per-request subjects.
    assert set(tap.direct_kinds) <= {"Status"}
    assert tap.mux_kinds["Head"] == tap.mux_kinds["Done"] == 20
    assert tap.mux_kinds["Chunk"] >= 20


@pytest.mark.pipeline
async def test_pipeline_without_coalescing_sends_no_mux_messages(
        tmp_path: Path, module_nats_url: str, module_redis_url: str, fake: FakeBackend) -> None:
    pipeline = start_pipeline(tmp_path, module_nats_url, module_redis_url, fake,
                              worker={"coalesce_bytes": 0})
    try:
        tap = await run_load(pipeline, fake, module_nats_url)
    finally:
        pipeline.stop()
    assert tap.mux_messages == 0
    assert tap.mux_frames == 0
    assert tap.direct_kinds["Head"] == tap.direct_kinds["Done"] == 20
    assert tap.direct_kinds["Chunk"] >= 20



@pytest.mark.pipeline
async def test_a_latency_budget_gathers_more_streams_per_message(
        tmp_path: Path, module_nats_url: str, module_redis_url: str, fake: FakeBackend) -> None:
    """``worker.coalesce_delay``: every stream still arrives whole and in order,
    and a batch waits for other streams' chunks, so one NATS message carries
    more of them than without the budget, measured in the same run."""
    per_message = {}
    for delay in (0.0, 0.05):
        pipeline = start_pipeline(tmp_path / f"d{delay}", module_nats_url, module_redis_url,
                                  fake, worker={"coalesce_delay": delay})
        try:
            tap = await run_load(pipeline, fake, module_nats_url)
        finally:
            pipeline.stop()
        per_message[delay] = tap.mux_frames / tap.mux_messages
    print(f"frames per mux message: {per_message}")
    assert per_message[0.05] > 3 * per_message[0.0], per_message


@pytest.mark.pipeline
async def test_batches_fit_a_server_with_a_small_max_payload(tmp_path: Path) -> None:
    """Against a real nats-server whose max_payload (8 KiB) is below the
    configured coalesce_bytes: every batch is accepted and nothing is lost."""
    conf = tmp_path / "small.conf"
    conf.write_text("max_payload: 8192\n")
    server = NatsServer(tmp_path / "nats", extra_args=["-c", str(conf)])
    server.start()
    try:
        pub, sub = await nats.connect(server.url), await nats.connect(server.url)
        try:
            got: list[bytes] = []

            async def on_msg(msg: Any) -> None:
                got.append(msg.data)

            await sub.subscribe("small.mux", cb=on_msg)
            await sub.flush()
            await sub.flush()
            assert pub.max_payload == 8192
            outbox = Outbox(pub.publish, batch_limit(128 << 10, pub.max_payload))
            outbox.start()
            for i in range(200):
                outbox.put("small.mux", f"r{i:03d}", b"x" * 200)
            await outbox.close()
            await pub.flush()
            await wait_for(lambda: sum(len(decode_mux(d)) for d in got) >= 200, 5.0)
            frames = [rid for d in got for rid, _ in decode_mux(d)]
            assert frames == [f"r{i:03d}" for i in range(200)]
            assert len(got) > 1
            assert all(len(d) <= 8192 for d in got)
        finally:
            await pub.close()
            await sub.close()
    finally:
        server.stop()
