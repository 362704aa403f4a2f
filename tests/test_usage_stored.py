"""A job's usage record is stored before its job is acked, through a broker
that is briefly away (real nats-server).

The record used to be a plain publish: when every NATS node was killed at
once, one completed request of 259 had no record afterwards
(tests/test_nats_cluster.py), though its job was acked. Now it is an acked
publish, retried while JetStream cannot store it (here: its stream is gone
for a second, as a stream is during an election), and the job is acked
after it (workers.job_context.JobContext.report)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from tests.pipeline import fresh_streams
from tests.servers import ServerHandle
from tidegate.broker import broker
from tidegate.config import Config
from tidegate.wire.protocol import UsageRecord
from workers.job_context import JobContext


@pytest.fixture
async def usage_stream(nats_server: ServerHandle) -> AsyncIterator[tuple[NATS, JetStreamContext,
                                                                         Config]]:
    async with fresh_streams(nats_server.url, edge={"publish_patience": 30.0}) as streams:
        yield streams


async def _records(js: JetStreamContext, config: Config) -> list[UsageRecord]:
    stream = config.nats.subjects.usage_stream
    info = await js.stream_info(stream)
    return [UsageRecord.decode((await js.get_msg(stream, seq=seq)).data or b"")
            for seq in range(info.state.first_seq, info.state.last_seq + 1)
            if info.state.messages]


async def test_a_record_reported_while_its_stream_is_away_is_stored_once_it_is_back(
        usage_stream: tuple[NATS, JetStreamContext, Config]) -> None:
    nc, js, config = usage_stream
    ctx = JobContext(config=config, nc=nc, control_subject="ctl.w1")
    await js.delete_stream(config.nats.subjects.usage_stream)  # no stream answers now
    record = UsageRecord(id=uuid.uuid4().hex[:24], model="m", outcome="done",
                         prompt_tokens=3, completion_tokens=5)
    report = asyncio.create_task(ctx.report(record))
    await asyncio.sleep(1.0)
    assert not report.done()  # still trying: the job is not acked meanwhile
    await broker.ensure_streams(js, config)  # the stream is back (a leader elected)
    await asyncio.wait_for(report, 60)
    assert await _records(js, config) == [record]
    # A redelivered job's record (the same id) is stored once.
    await ctx.report(record)
    assert await _records(js, config) == [record]
