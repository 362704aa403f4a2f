"""workers/service.py's Pool with fakes (the job message, NATS publish, the
backend; see test_job_unit.py): what happens to a job before it runs
(malformed, expired, tombstoned, a reply outside the edge inboxes), and the
control demux that routes an edge's Ack and Cancel to the running job."""

from __future__ import annotations

import asyncio
import time

from tests.poll import eventually
from tests.test_job_unit import CONFIG, FakeBackend, FakeMsg, FakeNats, FakeStream, events
from tidegate.wire.protocol import Ack, Api, Cancel, Request
from workers.job_context import JobContext
from workers.service import Pool


def pool_and_nats() -> tuple[Pool, FakeNats]:
    nc = FakeNats()
    ctx = JobContext(config=CONFIG, nc=nc, control_subject="tg.ctl.w1")  # type: ignore[arg-type]
    return Pool(CONFIG, ctx), nc


def job_msg(delivered: int = 1, **changes: object) -> FakeMsg:
    now_ms = int(time.time() * 1000)
    fields: dict[str, object] = dict(
        id="r1", reply=CONFIG.nats.subjects.out("e1", "r1"), model="m", api=Api.CHAT,
        stream=True, body={}, created_ms=now_ms, deadline_ms=now_ms + 60_000,
        window_bytes=1 << 20, window_msgs=128, tenant="t")
    fields.update(changes)
    msg = FakeMsg(delivered)
    msg.data = Request(**fields).encode()  # type: ignore[arg-type]
    return msg


class Control:
    def __init__(self, data: bytes) -> None:
        self.data = data


async def test_tombstoned_job_is_dropped_with_a_zero_record_and_never_runs() -> None:
    pool, nc = pool_and_nats()
    backend = FakeBackend(FakeStream(events(2)))
    pool.on_cancel("r1", "client_disconnected")
    msg = job_msg(delivered=2)
    await pool.run_job(msg, backend)  # type: ignore[arg-type]
    assert backend.opened == 0
    [record] = nc.usage()
    assert (record.outcome, record.attempt, record.completion_tokens) == ("dropped", 2, 0)
    assert msg.fate == ["ack"]
    assert nc.session() == [], "no Head: nobody waits for this job"


async def test_expired_job_is_dropped() -> None:
    pool, nc = pool_and_nats()
    backend = FakeBackend(FakeStream(events(2)))
    msg = job_msg(deadline_ms=int(time.time() * 1000) - 1)
    await pool.run_job(msg, backend)  # type: ignore[arg-type]
    assert backend.opened == 0
    assert [r.outcome for r in nc.usage()] == ["dropped"]
    assert msg.fate == ["ack"]


async def test_malformed_job_and_foreign_reply_are_terminated() -> None:
    pool, nc = pool_and_nats()
    backend = FakeBackend(FakeStream(events(2)))
    malformed = FakeMsg()
    malformed.data = b"\x92garbage"
    await pool.run_job(malformed, backend)  # type: ignore[arg-type]
    foreign = job_msg(reply="$JS.API.STREAM.PURGE.X")
    await pool.run_job(foreign, backend)  # type: ignore[arg-type]
    assert (malformed.fate, foreign.fate) == (["term"], ["term"])
    assert backend.opened == 0
    assert nc.published == []


async def test_a_job_runs_and_leaves_the_pool() -> None:
    pool, nc = pool_and_nats()
    msg = job_msg()
    await asyncio.wait_for(pool.run_job(msg, FakeBackend(FakeStream(events(2)))), 5)  # type: ignore[arg-type]
    assert [type(m).__name__ for m in nc.session()] == ["Head", "Chunk", "Chunk", "Done"]
    assert msg.fate[-1] == "ack"
    assert pool.jobs == {}


async def test_control_messages_reach_the_running_job() -> None:
    pool, nc = pool_and_nats()
    stream = FakeStream(events(1), hang=True)
    msg = job_msg()
    task = asyncio.create_task(pool.run_job(msg, FakeBackend(stream)))  # type: ignore[arg-type]
    await eventually(lambda: "r1" in pool.jobs and nc.session()[-1:] and
                     type(nc.session()[-1]).__name__ == "Chunk", 2.0, "the job streams")
    job = pool.jobs["r1"]
    await pool.on_control(Control(Ack("r1", 2).encode()))  # type: ignore[arg-type]
    assert job.window.acked_seq == 2
    await pool.on_control(Control(Ack("other", 9).encode()))  # type: ignore[arg-type]
    await pool.on_control(Control(b"\x00junk"))  # type: ignore[arg-type]
    await pool.on_control(Control(Cancel("r1", "client_disconnected").encode()))  # type: ignore[arg-type]
    await asyncio.wait_for(task, 5)
    assert [r.outcome for r in nc.usage()] == ["cancelled"]
    assert "Error" not in [type(m).__name__ for m in nc.session()], "not the ack timeout"
    assert stream.closed
    assert msg.fate[-1] == "ack"
    assert pool.jobs == {}


async def test_a_tombstone_cancels_the_running_job() -> None:
    pool, nc = pool_and_nats()
    stream = FakeStream(events(1), hang=True)
    task = asyncio.create_task(pool.run_job(job_msg(), FakeBackend(stream)))  # type: ignore[arg-type]
    await eventually(lambda: "r1" in pool.jobs, 2.0, "the job runs")
    pool.on_cancel("r1", "client_disconnected")
    await asyncio.wait_for(task, 5)
    assert stream.closed
    assert [r.outcome for r in nc.usage()] == ["cancelled"]
    # Ended by the tombstone, not by the ack timeout (which sends an Error).
    assert "Error" not in [type(m).__name__ for m in nc.session()]
