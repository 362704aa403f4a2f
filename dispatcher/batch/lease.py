"""The batch runner's leadership: one runner at a time leads, by a lease in the
batches bucket renewed by compare-and-set; each new lead is a new epoch."""

from __future__ import annotations

import contextlib
import json
import logging
import time

import nats.errors
import nats.js.errors

from dispatcher.batch.state import RunnerState
from tidegate.control.batches import LEASE_KEY
from tidegate.telemetry import telemetry as tm

log = logging.getLogger("tidegate.batch")


class Leadership(RunnerState):
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
        self.watch.close()  # it follows no line now; follow() starts probes again
        self.lost.clear()

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
