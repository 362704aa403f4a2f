"""What the operator console shows, kept current in its process's memory.

* :class:`Sampler`: ``tidegate status --json``'s document
  (:func:`fleet.run.status.document`, computed by the same reader,
  :class:`fleet.run.status.Source`), taken every ``interval`` seconds, and
  15 minutes of per-model points (queue depth, in flight, TTFT, tokens/s) for
  the charts. A NATS that goes away leaves the last document marked stale and
  the sampler retrying; nothing is lost but the points it could not take.
* :class:`UsageFollower`: the ``<P>_USAGE`` stream, read from its start by
  an ephemeral ordered consumer into a :class:`~tidegate.control.usage_stats.UsageStats`.

Both run as tasks owned by the console's ``TaskGroup`` (fleet.run.console).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from pathlib import Path
from typing import Any

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.api import DeliverPolicy

from fleet.run import status
from tidegate.broker import broker
from tidegate.config import Config
from tidegate.control.queue_stats import Snapshot
from tidegate.control.usage_stats import UsageStats
from tidegate.errors import ProtocolError
from tidegate.wire.protocol import UsageRecord

log = logging.getLogger("tidegate.console")

HISTORY = 15 * 60.0  # seconds of chart points kept


class Sampler:
    """The status document every ``interval`` seconds and the chart points."""

    def __init__(self, nc: NATS, config: Config, data_dir: Path | None,
                 usage: UsageStats, interval: float = 2.0) -> None:
        self.nc, self.config, self.data_dir = nc, config, data_dir
        self.usage = usage
        self.interval = interval
        self.document: dict[str, Any] | None = None
        self.error = ""  # why the last sample failed; "" when it worked
        self.history: deque[dict[str, Any]] = deque(maxlen=int(HISTORY / interval) + 1)
        self.ready = asyncio.Event()  # set once the first document is there

    def _point(self, doc: dict[str, Any], live: dict[str, dict[str, float | None]]) -> None:
        self.history.append({"t": doc["taken"], "models": {
            m["model"]: {"depth": m["queue"]["depth"], "in_flight": m["slots"]["used"],
                         **live.get(m["model"], {})} for m in doc["models"]}})

    async def run(self) -> None:
        """Until cancelled. A failed sample is logged once per outage."""
        source: status.Source | None = None
        previous: Snapshot | None = None
        while True:
            try:
                if source is None:
                    source = status.Source(self.nc, self.config, self.data_dir)
                    previous = await source.open()
                    await asyncio.sleep(self.interval)
                snap = await source.snapshot()
                doc = await source.document(snap, previous)
                previous = snap
                now = time.time()
                self.usage.prune(now)
                live = self.usage.live(now)
                for model in doc["models"]:
                    model["live"] = live.get(model["model"], {
                        "ttft_p50_ms": None, "ttft_p99_ms": None, "tokens_per_s": 0.0})
                self.document, self.error = doc, ""
                self._point(doc, live)
                self.ready.set()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # NATS or Redis away: keep the last document, retry
                if not self.error:
                    log.warning("console: status sample failed: %s", exc)
                self.error = f"{type(exc).__name__}: {exc}".strip()[:300]
                source = None
            await asyncio.sleep(self.interval)

    def view(self) -> dict[str, Any]:
        return {"status": self.document, "stale": bool(self.error), "error": self.error,
                "interval": self.interval, "history": list(self.history),
                "usage_records": self.usage.records}


class UsageFollower:
    """Feeds every record of the usage stream, past and new, to ``stats``."""

    def __init__(self, nc: NATS, config: Config, stats: UsageStats) -> None:
        self.nc, self.config, self.stats = nc, config, stats

    def _on_record(self, msg: Msg) -> None:
        try:
            record = UsageRecord.decode(msg.data)
        except ProtocolError as exc:
            log.debug("console: skipping a usage record: %s", exc)
            return
        at = msg.metadata.timestamp.timestamp() if msg.metadata.timestamp else time.time()
        self.stats.add(record, at)

    async def run(self) -> None:
        subjects = self.config.nats.subjects
        js = broker.jetstream(self.nc, self.config.nats)

        async def on_msg(msg: Msg) -> None:
            self._on_record(msg)

        while True:
            try:
                sub = await js.subscribe(subjects.usage_wildcard, stream=subjects.usage_stream,
                                         cb=on_msg, ordered_consumer=True,
                                         deliver_policy=DeliverPolicy.ALL, idle_heartbeat=5.0,
                                         pending_msgs_limit=1_000_000,
                                         pending_bytes_limit=256 * 1024 * 1024)
                break
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the stream not there yet, NATS away
                log.warning("console: cannot follow %s yet: %s", subjects.usage_stream, exc)
                await asyncio.sleep(2.0)
        try:
            await asyncio.Event().wait()  # the subscription delivers; the task owns it
        finally:
            try:
                await sub.unsubscribe()
            except Exception as exc:
                log.debug("console: unsubscribe: %s", exc)
