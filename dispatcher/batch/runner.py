"""The batch runner: turns batches into requests of class ``batch``, only into
spare capacity, and collects their answers exactly once per line.

One runner leads (a lease in ``<P>_BATCHES``; the others stand by). It
validates new batches, releases lines as ``Request`` s on
``<p>.req.batch.<tenant>`` while the model has room (``dispatcher.batch.room``),
tenants round robin, reads each line's answer on its own inbox, retries
transient failures, records every final answer once, and ends the batch
(``completed``, ``expired``, ``cancelled``).

Crash safety: all durable state is in KV and the object store; a successor
takes a new epoch and releases unfinished lines under new request ids, so a
lost answer runs again and none is written twice. Parts: ``dispatcher.batch.lease``,
``.release``, ``.collect``, ``.state``. Docs: docs/batch.md#exactly-once-whatever-dies.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from dataclasses import replace

import nats.errors
import nats.js.errors

from dispatcher.batch import files as bf
from dispatcher.batch.desk import Desk
from dispatcher.batch.lease import Leadership
from dispatcher.batch.release import Release
from dispatcher.batch.state import INBOX, BatchRun, InFlight, Pending
from tidegate.broker.kvwatch import follow_bucket
from tidegate.control import workers_registry
from tidegate.control.batches import LEASE_KEY, open_stores
from tidegate.control.keys import ensure_keys_bucket, watch_keys
from tidegate.errors import ProtocolError
from tidegate.telemetry import telemetry as tm
from tidegate.wire.batch import BatchRecord, BatchStatus, Counts
from tidegate.wire.protocol import Cancel

log = logging.getLogger("tidegate.batch")

_TICK = 0.05  # seconds between release rounds when nothing wakes the runner
_REFRESH = 0.5  # seconds between reads of the batch records (cancels, new batches)
# Seconds between reads of the worker registry. Workers put their entry
# early when an adaptive limit moves (workers.service), so a limit that grows
# under batch load is filled within about a second.
_SLOTS_EVERY = 0.5
_BUFFER = 64  # lines read ahead per batch
S = BatchStatus


class Runner(Leadership, Release):
    # -- the loop ------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        self.stores = await open_stores(self.js, self.config)
        registry = await workers_registry.ensure_bucket(self.js, self.config)
        sub = await self.nc.subscribe(self.subjects.edge_inbox(INBOX), cb=self.on_message)
        # The batch records, followed live: a refresh reads memory, not one
        # KV get per batch ever kept.
        follower = asyncio.create_task(follow_bucket(self.stores.batches, self._on_record,
                                                     self._on_record_gone))
        # The keys, followed live: each line is held to its batch key's rules.
        keys_kv = await ensure_keys_bucket(self.js, self.config)
        keys = asyncio.create_task(watch_keys(keys_kv, self.keys.on_put, self.keys.on_delete,
                                              on_synced=self.keys.on_synced))
        # Every dispatcher, leader or not, writes file and batch records for edges.
        desk = await self.nc.subscribe(self.subjects.desk, queue="desk",
                                       cb=Desk(self.config, self.nc, self.stores,
                                               self.keys).on_message)
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
                # Cleared before the round, not after: a line that ends while
                # the round awaits the broker sets it again, and the next
                # round starts at once instead of a tick later (cleared after
                # the round, that wake-up was lost: on a busy machine, where
                # rounds take longest, slots stood idle for up to a tick).
                self.wake.clear()
                try:
                    if now >= next_slots:
                        next_slots = now + _SLOTS_EVERY
                        self.slots = await self._slots(registry)
                    if now >= next_refresh:
                        next_refresh = now + _REFRESH
                        await self._refresh()
                    await self._hand_back_lost(now)
                    await self._settle_ended()
                    self._tick(now)
                    await self._release(now)
                except (nats.errors.Error, TimeoutError, nats.js.errors.Error) as exc:
                    log.warning("batch runner: broker error (%s); retrying", exc)
                    await asyncio.sleep(0.5)
                except Exception:
                    # A bug or a record nobody foresaw must not stop the
                    # dispatcher (its task group would end the process, and
                    # `tidegate up` would restart it into the same failure).
                    log.exception("batch runner: a round failed; retrying")
                    await asyncio.sleep(0.5)
                with contextlib.suppress(TimeoutError):
                    # Not wait_for: Python 3.11's drops a cancel that lands as
                    # the wake is set (tidegate.control.registry.heartbeat).
                    async with asyncio.timeout(_TICK):
                        await self.wake.wait()
        finally:
            self.watch.close()
            follower.cancel()
            keys.cancel()
            await desk.unsubscribe()
            await sub.unsubscribe()
            self._abandon()
            if self.leader:
                await self._resign()


    def _on_record_gone(self, key: str) -> None:
        self.records.pop(key, None)

    def _on_record(self, key: str, value: bytes) -> None:
        if key == LEASE_KEY:
            return
        try:
            self.records[key] = BatchRecord.decode(value)
        except ProtocolError as exc:
            log.error("unreadable batch record %s: %s", key, exc)

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
                self._unprobe_worker(flight)
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
            await self.keys.synced.wait()  # the key's rules are part of validation
            key_id = run.record.key_id
            total, errors = await bf.validate_input(
                stores, run.record, self.models, lambda model: self.keys.check(key_id, model))
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
            while len(run.buffer) >= _BUFFER:
                run.space.clear()
                await run.space.wait()
            try:
                model = bf.check_body(line, run.record.endpoint, self.models).model
            except Exception as exc:
                # Valid at validation, not now (the config changed): the
                # line's error is recorded at once, it never waits for a slot.
                await self._refuse(run, Pending(line, ""), exc)
                continue
            run.model = run.model or model
            run.buffer.append(Pending(line, model))
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
        expired = record.counts.total - len(run.done) if final is S.EXPIRED else 0
        counts = Counts(record.counts.total, completed, failed, expired)

        def end(current: BatchRecord) -> BatchRecord | None:
            if current.terminal:
                return None
            status = S.CANCELLED if current.status is S.CANCELLING else final
            return current.moved(status, int(time.time()), counts=counts, files_written=True)

        run.record = await stores.update_batch(record.id, end)
        log.info("batch %s %s: %d completed, %d failed", record.id, run.record.status,
                 completed, failed)
