"""An ended job is freed by reference counting, not left for the cyclic GC.

A worker's heap holds many long-lived objects, so Python's full collection
runs rarely: a job left in a cycle kept its request (a claimed 2 MiB body),
its stream and its log state until then. The soak's never-killed worker
held 86 ended resumable jobs after 12 minutes (tracemalloc), its RSS rising
about 20 % an hour. Each kind of job runs to its end here as the worker runs
it (``job.run()``, then ``release()``), and the collector, saving what it
finds, must find none of ours.
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Iterator

import pytest

from tests.poll import eventually
from tests.test_job_unit import (
    CONFIG,
    REPLY,
    FakeBackend,
    FakeMsg,
    FakeNats,
    FakeStream,
    LogOutbox,
    events,
    make_job,
)
from tidegate.wire.protocol import Api, Request
from workers.job import Job
from workers.job_context import JobContext
from workers.resumable import ResumableJob, ends_stored

OURS = (Job, ResumableJob)


@pytest.fixture
def no_collector() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


def left_for_the_collector() -> list[str]:
    gc.set_debug(gc.DEBUG_SAVEALL)
    gc.collect()
    return [type(o).__name__ for o in gc.garbage if isinstance(o, OURS)]


def resumable_request(**extra: object) -> Request:
    now_ms = int(time.time() * 1000)
    return Request(id="r1", reply=REPLY, model="m", api=Api.CHAT, stream=True, body={},
                   created_ms=now_ms, deadline_ms=now_ms + 60_000, window_bytes=1 << 20,
                   window_msgs=128, resumable=True, extra=dict(extra))


async def run_to_the_end(job: Job, how: str) -> None:
    """As the worker runs it: to its end, or cancelled by its client mid-stream."""
    if how == "ended":
        await asyncio.wait_for(job.run(), 5)
    else:
        task = asyncio.create_task(job.run())
        await eventually(lambda: job.chunks_sent >= 2, 5.0, "two chunks out")
        job.cancel("client_disconnected")
        await asyncio.wait_for(task, 5)
    await ends_stored(5)  # the log's end task lets the job go when it is done


@pytest.mark.parametrize("how", ["ended", "cancelled"])
async def test_a_plain_job_leaves_no_cycle(no_collector: None, how: str) -> None:
    job, _, _ = make_job(FakeBackend(FakeStream(events(3), hang=how == "cancelled")))
    await run_to_the_end(job, how)
    job.release()
    del job
    assert left_for_the_collector() == []


@pytest.mark.parametrize("how", ["ended", "cancelled"])
@pytest.mark.parametrize("background", [False, True])
async def test_a_resumable_job_leaves_no_cycle(no_collector: None, background: bool,
                                               how: str) -> None:
    ctx = JobContext(config=CONFIG, nc=FakeNats(), control_subject="tg.ctl.w1",  # type: ignore[arg-type]
                     log_outbox=LogOutbox())  # type: ignore[arg-type]
    request = resumable_request(**({"background": True} if background else {}))
    stream = FakeStream(events(3), hang=how == "cancelled")
    job = ResumableJob(FakeMsg(), request, FakeBackend(stream), ctx)  # type: ignore[arg-type]
    await run_to_the_end(job, how)
    job.release()
    del job
    assert left_for_the_collector() == []
