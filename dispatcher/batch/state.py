"""The batch runner's in-memory state: one active batch (:class:`BatchRun`), one
line waiting for a slot (:class:`Pending`) or running (:class:`InFlight`), and
:class:`RunnerState`, what every part of the runner (``dispatcher.batch.runner``) shares.
Rebuilt from KV by each new leader; nothing here is durable."""

from __future__ import annotations

import asyncio
import secrets
from collections import deque
from dataclasses import dataclass, field

from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from dispatcher.batch.keys import BatchKeys
from dispatcher.batch.session import Limits, LineSession
from dispatcher.queueing import QueueMode
from tidegate.broker.liveness import WorkerWatch
from tidegate.config import Config
from tidegate.control.batches import Stores
from tidegate.telemetry import telemetry as tm
from tidegate.wire.batch import BatchLine, BatchRecord, Counts

INBOX = "batch"  # the runner's edge id: its sessions' subjects are <p>.out.batch.<request>


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
    follower: LineFollower | None = None  # followed in the watch, once its worker is known
    watched: str = ""  # the worker control subject it follows there


class LineFollower:
    """One running line as the runner's :class:`WorkerWatch` follows it: a
    death is queued for the runner's next round (``RunnerState.lost``)."""

    __slots__ = ("rid", "state")

    def __init__(self, state: RunnerState, rid: str) -> None:
        self.state = state
        self.rid = rid

    def worker_lost(self, control: str) -> None:
        self.state.lost.append((self.rid, control))
        self.state.wake.set()


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


class RunnerState:
    """What the runner's parts (leadership, release, collection) share."""

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
        # The workers running lines, probed for death (tidegate.broker.liveness),
        # and the deaths found, (request id, control subject), for the next round.
        self.watch = WorkerWatch(nc, config.session.liveness_interval,
                                 config.worker.fetch_timeout)
        self.lost: deque[tuple[str, str]] = deque()
        self.slots: dict[str, int] = {}
        self._last_tenant = ""  # the tenant the last released line belonged to
        self.records: dict[str, BatchRecord] = {}  # the batches bucket, followed live
        self.keys = BatchKeys(config)  # the keys bucket, followed live (per-key rules)
        tm.get().metrics  # noqa: B018 - the process's telemetry exists before observers

