"""The batch runner's collection: each line's session messages in, its outcome
settled (retried, or final) and recorded exactly once."""

from __future__ import annotations

import asyncio
import logging
import time

from nats.aio.msg import Msg

from dispatcher.batch import files as bf
from dispatcher.batch.session import Verdict
from dispatcher.batch.state import BatchRun, InFlight, LineFollower, Pending, RunnerState
from tidegate.errors import ProtocolError
from tidegate.wire.batch import error_line, output_line
from tidegate.wire.protocol import decode_session

log = logging.getLogger("tidegate.batch")


class Collection(RunnerState):
    # -- collection ----------------------------------------------------------------

    async def on_message(self, msg: Msg) -> None:
        rid = msg.subject[msg.subject.rfind(".") + 1:]
        flight = self.inflight.get(rid)
        if flight is None:
            return  # an attempt this runner no longer waits for (cancelled, old epoch)
        try:
            message = decode_session(msg.data)
        except ProtocolError as exc:
            log.error("batch line %s: malformed message: %s", rid, exc)
            return
        for control, ack in flight.session.feed(message, time.monotonic()):
            await self.nc.publish(control, ack.encode())
        if flight.session.control != flight.watched:
            self._probe_worker(rid, flight)
        if flight.session.outcome is not None:
            self.ended.append(rid)
            self.wake.set()

    def _probe_worker(self, rid: str, flight: InFlight) -> None:
        """Probe the worker that now runs ``flight`` (a Head named it)."""
        self._unprobe_worker(flight)
        flight.follower = flight.follower or LineFollower(self, rid)
        flight.watched = flight.session.control
        self.watch.follow(flight.follower, flight.watched)

    def _unprobe_worker(self, flight: InFlight) -> None:
        if flight.follower is not None and flight.watched:
            self.watch.unfollow(flight.follower, flight.watched)
        flight.watched = ""

    async def _hand_back_lost(self, now: float) -> None:
        """The lines whose worker the watch found dead: their jobs get a ``-NAK``
        so another worker restarts them now (``LineSession.worker_lost``)."""
        while self.lost:
            rid, control = self.lost.popleft()
            flight = self.inflight.get(rid)
            if flight is None:
                continue
            flight.watched = ""  # the watch dropped its followers of that worker
            subject = flight.session.worker_lost(control, now)
            if subject:
                log.info("batch line %s: worker %s died; job handed back", rid, control)
                try:
                    await self.nc.publish(subject, b"-NAK")
                except Exception as exc:  # redelivery after worker.ack_wait remains
                    log.warning("could not hand back batch line %s: %s", rid, exc)
            if flight.session.outcome is not None:
                self.ended.append(rid)

    def _tick(self, now: float) -> None:
        for rid, flight in self.inflight.items():
            for control, ack in flight.session.tick(now):
                task = asyncio.create_task(self.nc.publish(control, ack.encode()))
                task.add_done_callback(lambda t: None)
            if flight.session.outcome is not None:
                self.ended.append(rid)

    async def _settle_ended(self) -> None:
        while self.ended:
            rid = self.ended.popleft()
            flight = self.inflight.pop(rid, None)
            if flight is None:
                continue
            self._unprobe_worker(flight)
            flight.run.running -= 1
            await self._settle(rid, flight)

    async def _settle(self, rid: str, flight: InFlight) -> None:
        outcome, pending, run = flight.session.outcome, flight.pending, flight.run
        assert outcome is not None
        custom_id, now = pending.line.custom_id, time.monotonic()
        if outcome.verdict is Verdict.WAIT:
            pending.not_before = now + outcome.retry_after
            run.retry.append(pending)
            return
        if outcome.verdict is Verdict.RETRY:
            pending.failures += 1
            error = outcome.error
            if pending.failures <= self.config.batch.max_retries:
                log.info("batch %s line %d: %s; retrying", run.record.id, pending.line.line,
                         error.code if error else "failed")
                pending.not_before = now + min(0.5 * 2 ** pending.failures, 10.0)
                run.retry.append(pending)
                return
            value = bf.FAILED + error_line(rid, custom_id, error.code if error else "failed",
                                           error.message if error else "The request failed.")
        elif outcome.verdict is Verdict.OK:
            value = bf.OK + output_line(rid, custom_id, 200, bf.answer_body(outcome.body))
        else:
            error = outcome.error
            assert error is not None
            body = {"error": {"message": error.message, "type": error.type,
                              "param": None, "code": error.code or None}}
            value = bf.FAILED + output_line(rid, custom_id, outcome.status, body)
        await self._record(run, pending, rid, value)

    async def _record(self, run: BatchRun, pending: Pending, rid: str, value: bytes) -> None:
        assert self.stores is not None
        if len(value) > self.nc.max_payload - 4096:  # a KV entry is one NATS message
            value = bf.FAILED + error_line(rid, pending.line.custom_id, "response_too_large",
                                           "The response is too large for the batch output.")
        run.done[pending.line.line] = await bf.record_result(self.stores, run.record.id,
                                                             pending.line.line, value)
        if run.finished:
            run.ended.set()
