"""A resumable stream's log keeps its end through a JetStream stream with no
leader, against a real nats-server (workers.resumable, ``_confirm_end``).

Log entries are plain publishes, and JetStream drops what reaches a stream
nobody leads (a NATS node's death: seconds until its followers elect
another). Here the log's stream is deleted, which a server answers the same
way ("no responders"), and made again while the job's end waits for it:
the end's re-publish on its own, and as the worker schedules it at a job's
end (``ResumableJob._send``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from types import SimpleNamespace

import nats
import nats.js.errors
import pytest
from nats.js import JetStreamContext

from tidegate import config as tgconfig
from tidegate.broker import broker, patient
from tidegate.wire import streamlog
from tidegate.wire.mux import Outbox, StoredOutbox, decode_mux
from tidegate.wire.protocol import Api, Done, Request, decode_session
from workers import resumable
from workers.job_context import JobContext
from workers.resumable import ResumableJob

pytestmark = pytest.mark.usefixtures("clean_env")


def _config(nats_url: str) -> tgconfig.Config:
    # Patience well past anything a loaded machine needs here: the end's own
    # give-up, not the machine, bounds the test.
    return tgconfig.from_dict({"nats": {"url": nats_url,
                                        "subject_prefix": "le" + uuid.uuid4().hex[:8]},
                               "edge": {"publish_patience": 60.0}})


def _job(nc: nats.NATS, config: tgconfig.Config, outbox: Outbox) -> ResumableJob:
    """A resumable job at its end (seq 5), its log through ``outbox``."""
    now_ms = int(time.time() * 1000)
    request = Request(id="r" + uuid.uuid4().hex[:23], reply="tg.out.e.r", model="m",
                      api=Api.CHAT, stream=True, body={}, created_ms=now_ms,
                      deadline_ms=now_ms + 60_000, window_bytes=1 << 20,
                      window_msgs=128, resumable=True)
    ctx = JobContext(config=config, nc=nc,
                     control_subject=f"{config.nats.subject_prefix}.ctl.w1", log_outbox=outbox)
    msg = SimpleNamespace(metadata=SimpleNamespace(num_delivered=1), headers={})
    job = ResumableJob(msg, request, None, ctx)  # type: ignore[arg-type]
    job.seq = 5
    return job


@contextlib.asynccontextmanager
async def _leaderless(module_nats_url: str) -> AsyncIterator[
        tuple[JetStreamContext, tgconfig.Config, str, ResumableJob, Outbox]]:
    """A resumable job at its end whose log's stream is gone (as with no leader:
    JetStream drops a plain publish to it); ``ensure_streams`` brings it back."""
    config = _config(module_nats_url)
    nc = await nats.connect(module_nats_url)
    try:
        js = nc.jetstream()
        await broker.ensure_streams(js, config)
        name = streamlog.stream_name(config.nats.subjects)
        await js.delete_stream(name)
        outbox = Outbox(nc.publish)
        outbox.start()
        yield js, config, name, _job(nc, config, outbox), outbox
        await outbox.close()
    finally:
        await nc.close()


async def test_the_end_waits_for_a_stream_with_no_leader_and_lands_once(
        module_nats_url: str) -> None:
    async with _leaderless(module_nats_url) as (js, config, name, job, _):
        request = job.request
        end = Done(5, 3, 3, "stop").encode()
        storing = asyncio.create_task(job._confirm_end(end))
        await asyncio.sleep(1.0)
        assert not storing.done(), "nobody stored it, yet it gave up"
        await broker.ensure_streams(js, config)  # a leader again
        await asyncio.wait_for(storing, 90)
        subject = streamlog.subject(config.nats.subjects, request.id)
        last = await js.get_last_msg(name, subject)
        assert isinstance(decode_session(last.data), Done)
        # Its id deduplicates a second store (a retry whose ack was lost).
        await job._confirm_end(end)
        info = await js.stream_info(name, subjects_filter=subject)
        assert info.state.messages == 1


async def test_a_jobs_end_is_stored_again_by_the_worker_when_its_plain_copy_was_dropped(
        module_nats_url: str) -> None:
    """A job's end, sent as at every job's end (``_send``): its plain copy
    reaches the log's stream while nobody leads it and is dropped; the
    worker has scheduled the acked re-publish, which lands once a leader is
    back, so the log keeps its end, once."""
    async with _leaderless(module_nats_url) as (js, config, name, job, outbox):
        before = set(resumable._ending)
        await job._send(Done(5, 3, 3, "stop").encode())
        storing = resumable._ending - before
        assert storing, "the worker scheduled no acked copy of its log's end"
        await outbox.flush()
        await job.ctx.nc.flush()  # the plain copy reached the server, which dropped it
        await broker.ensure_streams(js, config)  # a leader again
        done, _ = await asyncio.wait(storing, timeout=90)
        assert done == storing, "the end's acked copy did not land"
        subject = streamlog.subject(config.nats.subjects, job.request.id)
        assert isinstance(decode_session((await js.get_last_msg(name, subject)).data), Done)
        info = await js.stream_info(name, subjects_filter=subject)
        assert info.state.messages == 1


async def _stored_entries(js: JetStreamContext, stream: str, subject: str) -> list[bytes]:
    """Every entry on ``subject`` in the log's stream, in stream order."""
    state = (await js.stream_info(stream)).state
    out: list[bytes] = []
    for seq in range(state.first_seq or 1, state.last_seq + 1):
        with contextlib.suppress(nats.js.errors.NotFoundError):
            msg = await js.get_msg(stream, seq)
            if msg.subject == subject and msg.data:
                out.extend(message for _, message in decode_mux(msg.data))
    return out


async def test_entries_put_while_the_log_has_no_leader_land_once_in_order(
        module_nats_url: str) -> None:
    """The worker's log outbox (StoredOutbox) holds what reaches a log with
    no leader and stores it once the stream is back: a later reader reads
    every entry once, in order, and no stream_gap. A plain publish outbox
    loses entries 6-15 here."""
    config = _config(module_nats_url)
    nc = await nats.connect(module_nats_url)
    try:
        js = nc.jetstream()
        await broker.ensure_streams(js, config)
        name = streamlog.stream_name(config.nats.subjects)
        subject = streamlog.subject(config.nats.subjects, "r" + uuid.uuid4().hex[:23])

        async def store(subj: str, payload: bytes, msg_id: str) -> None:
            await patient.publish(js, nc, subj, payload, {"Nats-Msg-Id": msg_id}, 60.0)

        outbox = StoredOutbox(store)
        outbox.start()
        try:
            for i in range(1, 6):
                outbox.put(subject, "r", b"%d" % i)
            await outbox.flush()
            await js.delete_stream(name)  # from here on, nobody leads the log
            for i in range(6, 16):
                outbox.put(subject, "r", b"%d" % i)
                await asyncio.sleep(0.05)  # several batches, each one waiting
            await broker.ensure_streams(js, config)
            for i in range(16, 21):
                outbox.put(subject, "r", b"%d" % i)
            await outbox.flush()
        finally:
            await outbox.close()
        # 1-5 went with the deleted stream; every later entry once, in order.
        assert await _stored_entries(js, name, subject) == [b"%d" % i for i in range(6, 21)]
    finally:
        await nc.close()
