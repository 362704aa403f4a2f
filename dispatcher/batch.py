"""The batch runner: turns batches into requests of class ``batch``, only into
spare capacity, and collects their answers exactly once per line.

One runner at a time leads (a lease in the ``<P>_BATCHES`` bucket, renewed by
compare-and-set; every dispatcher runs a runner, the others stand by). The
leader:

* validates new batches (``validating``: every line, errors naming it) and
  moves them ``in_progress``, or ``failed``;
* releases lines as ``Request`` s on ``<p>.req.batch.<tenant>``: through the
  same dispatchers (quotas, queue mode), workers and backends as interactive
  traffic; a line is released only while its model has a free worker slot
  and **no job waits for a worker** (the model's worker consumer has nothing
  pending) and the model is not in queue mode, so an interactive request
  waits at most for one slot to turn over, never behind the batch; while
  interactive jobs run, batch holds only ``batch.share_under_load`` of the
  slots they leave free (``dispatcher.batch_room``). Lines of
  different tenants are released round robin (then batch by batch);
* reads each line's session messages on its own inbox (``<p>.out.batch.*``,
  ``dispatcher.batch_session``), retries transient failures (5xx, worker lost,
  silence) up to ``batch.max_retries`` and rate-limit rejections until the
  window ends, and records every final answer once (``dispatcher.batch_files``);
* ends a batch: ``completed`` when every line has a result, ``expired`` at
  ``expires_at`` (done lines in the output, the rest ``batch_expired`` in the
  error file), ``cancelled`` after a cancel (running lines cancelled upstream,
  partial results kept); output files are written while ``finalizing``.

Crash safety: all durable state is in KV (batch records, one entry per
finished line) and the object store. A successor (lease expired: after
``batch.lease`` seconds) takes a new *epoch*, reloads the finished lines and
releases the rest again under new request ids (``line_request_id``), so a line
whose answer was lost with its runner runs again, and one that was answered is
never written twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import secrets
import time
from collections import deque
from dataclasses import dataclass, field, replace

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from dispatcher import batch_files as bf
from dispatcher.batch_room import batch_room
from dispatcher.batch_session import Limits, LineSession, Verdict
from dispatcher.queueing import QueueMode
from tidegate.broker.kvwatch import follow_bucket
from tidegate.config import Config
from tidegate.control import workers_registry
from tidegate.control.batches import LEASE_KEY, Stores, open_stores
from tidegate.errors import ApiError, ProtocolError
from tidegate.telemetry import telemetry as tm
from tidegate.wire.batch import (
    BatchLine,
    BatchRecord,
    BatchStatus,
    Counts,
    error_line,
    line_request_id,
    output_line,
)
from tidegate.wire.protocol import Cancel, decode_session

log = logging.getLogger("tidegate.batch")

INBOX = "batch"  # the runner's edge id: its sessions' subjects are <p>.out.batch.<request>
_TICK = 0.05  # seconds between release rounds when nothing wakes the runner
_REFRESH = 0.5  # seconds between reads of the batch records (cancels, new batches)
# Seconds between reads of the worker registry. Workers put their entry
# early when an adaptive limit moves (workers.service), so a limit that grows
# under batch load is filled within about a second.
_SLOTS_EVERY = 0.5
_BUFFER = 64  # lines read ahead per batch
S = BatchStatus


@dataclass(slots=True)
class Pending:
    line: BatchLine
    model: str
    failures: int = 0
    attempts: int = 0
    not_before: float = 0.0


@dataclass(slots=True)
class InFlight:
    run: BatchRun
    pending: Pending
    session: LineSession


@dataclass(slots=True)
class BatchRun:
    """The runner's view of one active batch."""

    record: BatchRecord
    done: dict[int, bool] = field(default_factory=dict)
    buffer: deque[Pending] = field(default_factory=deque)  # read ahead, at most _BUFFER
    space: asyncio.Event = field(default_factory=asyncio.Event)  # the buffer has room
    retry: deque[Pending] = field(default_factory=deque)
    running: int = 0
    ready: bool = False  # validated and finished lines loaded: lines may be released
    exhausted: bool = False  # every input line went into the buffer
    stopping: str = ""  # "cancelled" / "expired": release nothing more
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    reported: Counts = field(default_factory=Counts)
    task: asyncio.Task[None] | None = None
    model: str = ""  # the model of its lines, as far as read (metrics; most batches have one)
    since: float = 0.0  # wall clock when this runner started it, and lines done by then:
    done_since: int = 0  # the rate the at-risk gauge projects from

    @property
    def finished(self) -> bool:
        return self.ready and len(self.done) >= self.record.counts.total

    def next_line(self, now: float) -> Pending | None:
        if self.retry and self.retry[0].not_before <= now:
            return self.retry[0]
        return self.buffer[0] if self.buffer else None

    def take(self, pending: Pending) -> None:
        if self.retry and self.retry[0] is pending:
            self.retry.popleft()
        else:
            self.buffer.popleft()
            self.space.set()


class Runner:
    def __init__(self, config: Config, nc: NATS, js: JetStreamContext,
                 queue: QueueMode | None = None) -> None:
        self.config = config
        self.nc = nc
        self.js = js
        self.queue = queue
        self.subjects = config.nats.subjects
        self.models = config.model_index()
        self.limits = Limits.of(config)
        self.owner = secrets.token_hex(6)
        self.epoch = 0
        self.leader = False
        self.lease_until = 0.0
        self.stores: Stores | None = None
        self.runs: dict[str, BatchRun] = {}
        self.inflight: dict[str, InFlight] = {}
        self.ended: deque[str] = deque()  # request ids whose session has an outcome
        self.wake = asyncio.Event()
        self.slots: dict[str, int] = {}
        self._last_tenant = ""  # the tenant the last released line belonged to
        self.records: dict[str, BatchRecord] = {}  # the batches bucket, followed live
        tm.get().metrics  # noqa: B018 - the process's telemetry exists before observers

    # -- the loop ------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        self.stores = await open_stores(self.js, self.config)
        registry = await workers_registry.ensure_bucket(self.js, self.config)
        sub = await self.nc.subscribe(self.subjects.edge_inbox(INBOX), cb=self.on_message)
        # The batch records, followed live: a refresh reads memory, not one
        # KV get per batch ever kept.
        follower = asyncio.create_task(follow_bucket(self.stores.batches, self._on_record,
                                                     self._on_record_gone))
        next_lease = next_refresh = next_slots = 0.0
        try:
            while not stop.is_set():
                now = time.monotonic()
                # The leader renews every third of the lease; a standby looks
                # at least every second, so a resigned lease is taken at once.
                every = self.config.batch.lease / 3
                if now >= next_lease:
                    next_lease = now + (every if self.leader else min(every, 1.0))
                    await self._lease()
                if not self.leader:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), max(0.0, next_lease - now))
                    continue
                try:
                    if now >= next_slots:
                        next_slots = now + _SLOTS_EVERY
                        self.slots = await self._slots(registry)
                    if now >= next_refresh:
                        next_refresh = now + _REFRESH
                        await self._refresh()
                    await self._settle_ended()
                    self._tick(now)
                    await self._release(now)
                except (nats.errors.Error, TimeoutError, nats.js.errors.Error) as exc:
                    log.warning("batch runner: broker error (%s); retrying", exc)
                    await asyncio.sleep(0.5)
                self.wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.wake.wait(), _TICK)
        finally:
            follower.cancel()
            await sub.unsubscribe()
            self._abandon()
            if self.leader:
                await self._resign()

    async def _resign(self) -> None:
        """A clean stop hands the lead over at once: the lease expires now
        (keeping its epoch, so the successor's is new: request ids never repeat)."""
        assert self.stores is not None
        with contextlib.suppress(Exception):
            entry = await self.stores.batches.get(LEASE_KEY)
            held = json.loads(entry.value or b"{}")
            if held.get("owner") == self.owner:
                await self.stores.batches.update(
                    LEASE_KEY, json.dumps({**held, "until": 0}).encode(), last=entry.revision)
                log.info("batch runner %s resigned the lead", self.owner)
        self.leader = False

    def _on_record_gone(self, key: str) -> None:
        self.records.pop(key, None)

    def _on_record(self, key: str, value: bytes) -> None:
        if key == LEASE_KEY:
            return
        try:
            self.records[key] = BatchRecord.decode(value)
        except (ValueError, KeyError, TypeError) as exc:
            log.error("unreadable batch record %s: %s", key, exc)

    # -- leadership ----------------------------------------------------------------

    async def _lease(self) -> None:
        assert self.stores is not None
        kv, now = self.stores.batches, time.time()
        value = {"owner": self.owner, "until": now + self.config.batch.lease}
        try:
            try:
                entry = await kv.get(LEASE_KEY)
            except nats.js.errors.KeyNotFoundError:
                await kv.create(LEASE_KEY, json.dumps({**value, "epoch": 1}).encode())
                self._lead(1)
                return
            assert entry.value is not None
            held = json.loads(entry.value)
            if held["owner"] != self.owner and held["until"] > now:
                self._follow()
                return
            epoch = held["epoch"] if held["owner"] == self.owner else held["epoch"] + 1
            await kv.update(LEASE_KEY, json.dumps({**value, "epoch": epoch}).encode(),
                            last=entry.revision)
            self._lead(epoch)
        except (nats.js.errors.KeyWrongLastSequenceError, nats.errors.Error, TimeoutError,
                nats.js.errors.Error) as exc:
            log.info("batch runner lease not renewed (%s)", type(exc).__name__)
            self._follow()

    def _lead(self, epoch: int) -> None:
        if not self.leader or epoch != self.epoch:
            log.info("batch runner %s leads (epoch %d)", self.owner, epoch)
            self._abandon()
        self.leader, self.epoch = True, epoch

    def _follow(self) -> None:
        if self.leader:
            log.warning("batch runner %s lost the lead", self.owner)
            self._abandon()
            tm.get().metrics.batch_at_risk.set(0)  # the new leader reports it now
        self.leader = False

    def _abandon(self) -> None:
        """Drop every in-memory batch: a (new) leader rebuilds from KV."""
        for run in self.runs.values():
            if run.task is not None:
                run.task.cancel()
        self.runs.clear()
        self.inflight.clear()
        self.ended.clear()

    # -- batches ---------------------------------------------------------------------

    async def _refresh(self) -> None:
        assert self.stores is not None
        wall = time.time()
        records = list(self.records.values())
        self._gauges(records, wall)
        for record in records:
            run = self.runs.get(record.id)
            if record.terminal:
                continue
            if run is None:
                run = self.runs[record.id] = BatchRun(record)
                run.task = asyncio.create_task(self._drive(run))
                run.task.add_done_callback(functools.partial(self._ended, record.id))
                continue
            run.record = replace(run.record, status=record.status)
            if record.status is S.CANCELLING and not run.stopping:
                self._stop(run, "cancelled")
            elif (wall >= record.expires_at and not run.stopping
                  and record.status in (S.VALIDATING, S.IN_PROGRESS)):
                self._stop(run, "expired")
            elif run.ready and run.reported != self._counts(run):
                await self._report(run)

    def _gauges(self, records: list[BatchRecord], wall: float) -> None:
        """Batches by status, lines per model, batch share of slots, and how
        many batches will miss their window at the rate they run now."""
        metrics = tm.get().metrics
        by_status = dict.fromkeys(S, 0)
        for record in records:
            by_status[record.status] += 1
        for status, n in by_status.items():
            metrics.batches.set(n, {tm.BATCH_STATUS: str(status)})
        lines: dict[str, dict[str, int]] = {}
        at_risk = 0
        for run in self.runs.values():
            if not run.ready or not run.model:
                continue
            per = lines.setdefault(run.model, {"pending": 0, "running": 0, "done": 0})
            total, done = run.record.counts.total, len(run.done)
            per["running"] += run.running
            per["done"] += done
            per["pending"] += max(0, total - done - run.running)
            elapsed, progress = wall - run.since, done - run.done_since
            if elapsed >= 60 and done < total and not run.stopping:
                eta = (total - done) * elapsed / progress if progress else float("inf")
                at_risk += wall + eta > run.record.expires_at
        for model in self.models.values():
            per = lines.get(model.name, {"pending": 0, "running": 0, "done": 0})
            for state, n in per.items():
                metrics.batch_lines.set(n, {tm.MODEL: model.name, tm.LINE_STATE: state})
            slots = self.slots.get(model.name, 0)
            metrics.batch_slot_share.set(per["running"] / slots if slots else 0.0,
                                         {tm.MODEL: model.name})
        metrics.batch_at_risk.set(at_risk)

    def _ended(self, batch_id: str, task: asyncio.Task[None]) -> None:
        run = self.runs.get(batch_id)
        if run is not None and run.task is task:
            del self.runs[batch_id]
        if not task.cancelled() and task.exception() is not None:
            log.error("batch %s: runner task failed; retrying", batch_id,
                      exc_info=task.exception())

    def _counts(self, run: BatchRun) -> Counts:
        ok = sum(1 for v in run.done.values() if v)
        return Counts(run.record.counts.total, ok, len(run.done) - ok)

    async def _report(self, run: BatchRun) -> None:
        assert self.stores is not None
        counts = self._counts(run)

        def change(current: BatchRecord) -> BatchRecord | None:
            return None if current.terminal else replace(current, counts=counts)

        await self.stores.update_batch(run.record.id, change)
        run.reported = counts

    def _stop(self, run: BatchRun, why: str) -> None:
        """No more lines; cancel the running ones upstream; then finalize."""
        log.info("batch %s: %s, stopping %d running lines", run.record.id, why, run.running)
        run.stopping = why
        for rid, flight in list(self.inflight.items()):
            if flight.run is run:
                del self.inflight[rid]
                run.running -= 1
                self._cancel_upstream(rid, flight, f"batch_{why}")
        run.ended.set()

    def _cancel_upstream(self, rid: str, flight: InFlight, reason: str) -> None:
        async def send() -> None:
            with contextlib.suppress(Exception):
                if flight.session.control:
                    await self.nc.publish(flight.session.control, Cancel(rid, reason).encode())
                await self.nc.publish(self.subjects.cancel_key(rid), reason.encode())
        task = asyncio.create_task(send())
        task.add_done_callback(lambda t: None)

    async def _drive(self, run: BatchRun) -> None:
        """One batch from its current status to its end."""
        assert self.stores is not None
        stores, batch_id = self.stores, run.record.id
        if run.record.status is S.VALIDATING:
            total, errors = await bf.validate_input(stores, run.record, self.models)
            now = int(time.time())

            def validated(current: BatchRecord) -> BatchRecord | None:
                if current.status is not S.VALIDATING:
                    return None  # cancelled meanwhile
                if errors:
                    return current.moved(S.FAILED, now, errors=tuple(errors))
                return current.moved(S.IN_PROGRESS, now, counts=Counts(total=total))

            run.record = await stores.update_batch(batch_id, validated)
            if run.record.status is S.FAILED:
                log.info("batch %s failed validation (%d errors)", batch_id, len(errors))
                return
            log.info("batch %s validated: %d requests", batch_id, total)
        if run.record.status is not S.FAILED:
            # A successor resumes here: what finished before it is final.
            run.done = await bf.load_results(stores, batch_id)
        if run.record.status is S.IN_PROGRESS:
            run.since, run.done_since = time.time(), len(run.done)
            run.ready = True
            self.wake.set()
            feeder = asyncio.create_task(self._feed(run))
            try:
                while not (run.finished or run.stopping):
                    run.ended.clear()
                    if run.finished or run.stopping:
                        break
                    await run.ended.wait()
            finally:
                feeder.cancel()
        await self._finalize(run)

    async def _feed(self, run: BatchRun) -> None:
        assert self.stores is not None
        async for line in bf.parsed_lines(self.stores, run.record):
            if line.line in run.done:
                continue
            template = bf.check_body(line, run.record.endpoint, self.models)
            while len(run.buffer) >= _BUFFER:
                run.space.clear()
                await run.space.wait()
            run.model = run.model or template.model
            run.buffer.append(Pending(line, template.model))
            self.wake.set()
        run.exhausted = True

    async def _finalize(self, run: BatchRun) -> None:
        assert self.stores is not None
        stores, record = self.stores, run.record
        cancelled = run.stopping == "cancelled" or record.status is S.CANCELLING
        now = int(time.time())

        def finalizing(current: BatchRecord) -> BatchRecord | None:
            if current.status is not S.IN_PROGRESS:
                return None
            return current.moved(S.FINALIZING, now)

        if not cancelled and record.status is S.IN_PROGRESS:
            record = await stores.update_batch(record.id, finalizing)
        cancelled = cancelled or record.status is S.CANCELLING
        final = (S.CANCELLED if cancelled else
                 S.COMPLETED if len(run.done) >= record.counts.total else S.EXPIRED)
        completed, failed = await bf.write_outputs(stores, record, run.done,
                                                   expired=final is S.EXPIRED)
        counts = Counts(record.counts.total, completed, failed)

        def end(current: BatchRecord) -> BatchRecord | None:
            if current.terminal:
                return None
            status = S.CANCELLED if current.status is S.CANCELLING else final
            return current.moved(status, int(time.time()), counts=counts, files_written=True)

        run.record = await stores.update_batch(record.id, end)
        log.info("batch %s %s: %d completed, %d failed", record.id, run.record.status,
                 completed, failed)

    # -- capacity and release -----------------------------------------------------------

    async def _slots(self, registry: object) -> dict[str, int]:
        slots: dict[str, int] = {}
        for worker in await workers_registry.read_all(registry):  # type: ignore[arg-type]
            if worker.draining:
                continue
            for model, info in worker.models.items():
                slots[model] = slots.get(model, 0) + info.slots
        return slots

    async def _free(self, model: str, started: int, unstarted: int) -> int:
        """Lines of ``model`` batch may start now (``dispatcher.batch_room``):
        0 while any job waits for a worker or the model is in queue mode, every
        free slot while no interactive job runs, else a share of them."""
        slots = self.slots.get(model, 0)
        if slots <= 0:
            return 0
        config = self.models[model]
        # A model with several replicas also has one queue per replica
        # (routing homes): a job waiting in any of them waits for a worker.
        consumers = [self.subjects.worker_consumer(model)]
        if len(config.replicas) > 1:
            consumers += [self.subjects.replica_consumer(model, r) for r in config.replica_names]
        running = 0
        for i, consumer in enumerate(consumers):
            try:
                info = await self.js.consumer_info(self.subjects.jobs_stream, consumer)
            except Exception:
                if i == 0:
                    return 0  # no worker consumer yet: nothing can run
                continue  # a replica whose workers have not started
            if info.num_pending:
                return 0
            running += int(info.num_ack_pending or 0)
        cfg = config.queue
        if self.queue is not None and cfg.ttft_p99 > 0:
            try:
                if (await self.queue.state(model)).queueing or await self.queue.queued(model):
                    return 0
            except Exception:
                return 0
        return batch_room(slots=slots, running=running, batch_running=started,
                          batch_unstarted=unstarted, share=self.config.batch.share_under_load,
                          waiting=False)

    async def _release(self, now: float) -> None:
        runs = [r for r in self.runs.values() if r.ready and not r.stopping]
        if not runs:
            return
        budget = self.config.batch.max_running - len(self.inflight)
        if budget <= 0:
            return
        wanted = {p.model for r in runs if (p := r.next_line(now)) is not None}
        if not wanted:
            return
        started: dict[str, int] = {}
        unstarted: dict[str, int] = {}
        for flight in self.inflight.values():
            # A line's worker is known (its head came) once control is set.
            count = unstarted if flight.session.control == "" else started
            count[flight.pending.model] = count.get(flight.pending.model, 0) + 1
        free = {m: await self._free(m, started.get(m, 0), unstarted.get(m, 0)) for m in wanted}
        by_tenant: dict[str, list[BatchRun]] = {}
        for run in sorted(runs, key=lambda r: r.record.created_at):
            by_tenant.setdefault(run.record.tenant, []).append(run)
        tenants = sorted(by_tenant)
        progress = True
        while progress and budget > 0 and any(v > 0 for v in free.values()):
            progress = False
            # Round robin: start after the tenant served last, whatever tick it was.
            last = self._last_tenant
            for tenant in [t for t in tenants if t > last] + [t for t in tenants if t <= last]:
                for run in by_tenant[tenant]:
                    pending = run.next_line(now)
                    if pending is None or free.get(pending.model, 0) <= 0:
                        continue
                    run.take(pending)
                    free[pending.model] -= 1
                    budget -= 1
                    await self._publish(run, pending, now)
                    self._last_tenant = tenant
                    progress = True
                    break  # one line per tenant per round: fair between tenants
                if budget <= 0:
                    break

    async def _publish(self, run: BatchRun, pending: Pending, now: float) -> None:
        record = run.record
        pending.attempts += 1
        rid = line_request_id(record.id, pending.line.line, self.epoch, pending.attempts)
        try:
            template = bf.check_body(pending.line, record.endpoint, self.models)
        except ApiError as error:  # the config changed since validation (a model went away)
            await self._record(run, pending, rid, bf.FAILED + output_line(
                rid, pending.line.custom_id, error.status, error.payload()))
            return
        now_ms = int(time.time() * 1000)
        session = self.config.session
        request = replace(template, id=rid, reply=self.subjects.out(INBOX, rid),
                          created_ms=now_ms, deadline_ms=record.expires_at * 1000,
                          window_bytes=session.window_bytes, window_msgs=session.window_msgs,
                          tenant=record.tenant, user=record.user, key_id=record.key_id,
                          edge=INBOX)
        self.inflight[rid] = InFlight(run, pending, LineSession(rid, self.limits, now))
        run.running += 1
        try:
            await self.js.publish(self.subjects.request("batch", record.tenant),
                                  request.encode(), headers={"Nats-Msg-Id": rid})
        except (nats.errors.Error, TimeoutError, nats.js.errors.Error) as exc:
            # Not accepted (or unknown): the session times out and retries,
            # under a new id; the same id would be a duplicate if it did land.
            log.warning("batch %s: could not publish line %d (%s)", record.id,
                        pending.line.line, exc)

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
        if flight.session.outcome is not None:
            self.ended.append(rid)
            self.wake.set()

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
