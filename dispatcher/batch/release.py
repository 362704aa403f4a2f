"""The batch runner's capacity and release: how many lines of a model may start
now (``dispatcher.batch.room``), fairly across tenants, and publishing each as a
request of class ``batch``."""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import nats.errors
import nats.js.errors

from dispatcher.batch import files as bf
from dispatcher.batch.collect import Collection
from dispatcher.batch.room import batch_room, others_wait
from dispatcher.batch.session import LineSession
from dispatcher.batch.state import INBOX, BatchRun, InFlight, Pending
from tidegate.broker import bodies
from tidegate.control import workers_registry
from tidegate.errors import ApiError, BrokerError
from tidegate.wire.batch import line_request_id, output_line

log = logging.getLogger("tidegate.batch")


class Release(Collection):
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
        """Lines of ``model`` batch may start now (``dispatcher.batch.room``):
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
        running = pending = 0
        for i, consumer in enumerate(consumers):
            try:
                info = await self.js.consumer_info(self.subjects.jobs_stream, consumer)
            except Exception:
                if i == 0:
                    return 0  # no worker consumer yet: nothing can run
                continue  # a replica whose workers have not started
            pending += int(info.num_pending or 0)
            running += int(info.num_ack_pending or 0)
        waiting = others_wait(pending, unstarted)
        cfg = config.queue
        if not waiting and self.queue is not None and cfg.ttft_p99 > 0:
            try:
                waiting = (await self.queue.state(model)).queueing \
                    or bool(await self.queue.queued(model))
            except Exception:
                waiting = True  # queue state unknown: interactive traffic first
        return batch_room(slots=slots, running=running, batch_running=started,
                          batch_unstarted=unstarted, share=self.config.batch.share_under_load,
                          waiting=waiting)

    async def _release(self, now: float) -> None:
        runs = [r for r in self.runs.values() if r.ready and not r.stopping]
        if not runs or not self.keys.known():
            return  # (keys not read yet: no line can be held to its key's rules)
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
        now_ms = int(time.time() * 1000)
        session = self.config.session
        try:
            # Checked again at release: the config (a model went away) or the
            # key (revoked, expired, its models) may have changed since
            # validation. Lines already running are not touched (docs/batch.md).
            template = bf.check_body(pending.line, record.endpoint, self.models)
            self.keys.check(record.key_id, self.models[template.model])
            request = replace(template, id=rid, reply=self.subjects.out(INBOX, rid),
                              created_ms=now_ms, deadline_ms=record.expires_at * 1000,
                              window_bytes=session.window_bytes,
                              window_msgs=session.window_msgs, tenant=record.tenant,
                              user=record.user, key_id=record.key_id, edge=INBOX)
            payload = request.encode()
        except Exception as exc:
            await self._refuse(run, pending, exc, rid)
            return
        self.inflight[rid] = InFlight(run, pending, LineSession(rid, self.limits, now))
        run.running += 1
        try:
            max_payload = self.js._nc.max_payload
            if len(payload) > bodies.threshold(self.config, max_payload):
                # A line too large for a message crosses by claim check, as
                # at the edge (tidegate.broker.bodies).
                payload = (await bodies.check_in(self.js, self.config, request,
                                                 max_payload)).encode()
            await self.js.publish(self.subjects.request("batch", record.tenant),
                                  payload, headers={"Nats-Msg-Id": rid})
        except (nats.errors.Error, TimeoutError, nats.js.errors.Error, BrokerError) as exc:
            # Not accepted (or unknown): the session times out and retries,
            # under a new id; the same id would be a duplicate if it did land.
            log.warning("batch %s: could not publish line %d (%s)", record.id,
                        pending.line.line, exc)


    async def _refuse(self, run: BatchRun, pending: Pending, exc: Exception,
                      rid: str = "") -> None:
        """The line cannot run: its error goes to the error file now. An
        ApiError is the answer the edge would give (400, 401 ``revoked_api_key``,
        403 ``model_not_allowed``); anything else is a poison line
        (``tidegate.broker.poison``): a 400, counted and logged, and the
        runner goes on with the next line."""
        record = run.record
        rid = rid or line_request_id(record.id, pending.line.line, self.epoch, 0)
        if isinstance(exc, ApiError):
            status, body = exc.status, exc.payload()
        else:
            bf.BAD_LINE.drop("batch_line", "poison", f"{type(exc).__name__}: {exc}")
            status, body = 400, {"error": {
                "message": "The gateway could not process this request; it was not run.",
                "type": "invalid_request_error", "param": None,
                "code": "unprocessable_request"}}
        log.info("batch %s line %d not run: %s", record.id, pending.line.line, exc)
        await self._record(run, pending, rid, bf.FAILED + output_line(
            rid, pending.line.custom_id, status, body))
