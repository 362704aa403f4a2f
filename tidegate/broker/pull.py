"""Continuous pull from a durable JetStream consumer, one message at a time.

Unlike ``PullSubscription.fetch``, which holds a batch's first messages until
the whole batch or the expiry arrives, every message is handed to its handler
the moment it arrives.

Invariant (credit): the puller keeps at most ``capacity`` messages requested
or being handled, so a worker asks exactly for its free slots and queued work
stays in JetStream for any worker. An expired pull request's undelivered
credit (``Nats-Pending-Messages``) is requested again. A stopped puller
keeps its inbox until its requests expire and NAKs what still arrives
(delayed past them).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext

log = logging.getLogger("tidegate.pull")

Handler = Callable[[Msg], Coroutine[Any, Any, None]]
# How many more messages a puller may request now (its own capacity rule by
# default; pullers sharing slots pass one, see workers/routing.py).
Credit = Callable[["Puller"], int]


class Puller:
    def __init__(self, nc: NATS, stream: str, consumer: str, handler: Handler, *,
                 capacity: int, expires: float, api_prefix: str = "$JS.API",
                 credit: Credit | None = None,
                 on_done: Callable[[], None] | None = None) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self._nc = nc
        self._next_subject = f"{api_prefix}.CONSUMER.MSG.NEXT.{stream}.{consumer}"
        self._handler = handler
        self.capacity = capacity
        self._expires = expires
        self.outstanding = 0  # requested from the server, not yet delivered or expired
        self.tasks: set[asyncio.Task[None]] = set()  # handlers running
        self._wake = asyncio.Event()
        self._last_progress = time.monotonic()
        self._credit = credit
        # With a credit rule: messages the consumer still held at the last
        # delivery (its num_pending), for rules that ask for what is there.
        self.pending = 0
        self._done_hook = on_done
        self._stopping = False  # set once run() saw its stop: arrivals are given back

    @property
    def busy(self) -> int:
        return len(self.tasks)

    def wake(self) -> None:
        """Re-check the credit now (a slot shared with another puller freed)."""
        self._wake.set()

    def resize(self, capacity: int) -> None:
        """A new credit (an adaptive limit moved). Growth is requested at
        once; a shrink takes effect as running handlers finish, and pull
        requests already outstanding still deliver (at most until they
        expire), so the busy count may briefly exceed a lowered capacity."""
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        grew = capacity > self.capacity
        self.capacity = capacity
        if grew:
            self._wake.set()

    def _on_done(self, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        self._wake.set()
        if self._done_hook is not None:
            self._done_hook()

    async def _on_message(self, msg: Msg) -> None:
        self._last_progress = time.monotonic()
        status = JetStreamContext.is_status_msg(msg)
        if status:
            # 408 (request expired), 409 (e.g. consumer deleted, max waiting):
            # the undelivered part of that request comes back as credit.
            headers = msg.headers or {}
            pending = int(headers.get("Nats-Pending-Messages", 0) or 0)
            self.outstanding = max(0, self.outstanding - pending)
            if status not in ("408", "404"):
                log.debug("pull status %s: %s", status, headers.get("Description", ""))
            self._wake.set()
            return
        self.outstanding = max(0, self.outstanding - 1)
        if self._stopping:
            # Asked for before the stop, not to be started now: back to
            # another puller, rather than after the consumer's ack_wait. The
            # delay outlasts this puller's open requests (each sent before
            # the stop, so expired by then): an immediate redelivery could
            # land in one of them again, and each counts to max_deliver.
            self._wake.set()
            try:
                await msg.nak(delay=self._expires + 0.25)
            except nats.errors.Error:
                pass  # closing: redelivered after ack_wait, as before
            return
        task = asyncio.create_task(self._handler(msg))
        self.tasks.add(task)
        task.add_done_callback(self._on_done)
        if self._credit is not None:
            # A credit rule may ask for less than the free slots (a replica's
            # own queue asks for what it holds): ask again now, not only when
            # a job ends, knowing how many more the consumer has waiting.
            try:
                self.pending = msg.metadata.num_pending
            except Exception:  # not a JetStream delivery: no count
                self.pending = 0
            self._wake.set()

    async def run(self, stop: asyncio.Event) -> None:
        """Pull until ``stop`` is set. Handlers still running are left to the
        caller (see :attr:`tasks`), which decides how long to let them finish."""
        inbox = self._nc.new_inbox()
        sub = await self._nc.subscribe(inbox, cb=self._on_message)
        stop_wait = asyncio.ensure_future(stop.wait())
        try:
            while not stop.is_set():
                want = (self.capacity - self.busy - self.outstanding if self._credit is None
                        else self._credit(self))
                if want > 0:
                    request = {"batch": want, "expires": int(self._expires * 1e9)}
                    await self._nc.publish(self._next_subject, json.dumps(request).encode(),
                                           reply=inbox)
                    self.outstanding += want
                self._wake.clear()
                wake = asyncio.ensure_future(self._wake.wait())
                await asyncio.wait({wake, stop_wait}, timeout=self._expires + 1.0,
                                   return_when=asyncio.FIRST_COMPLETED)
                wake.cancel()
                if (self.outstanding
                        and time.monotonic() - self._last_progress > self._expires + 1.0):
                    # Every request must have expired by now; a lost status
                    # (e.g. across a reconnect) must not leak credit forever.
                    self.outstanding = 0
                    self._last_progress = time.monotonic()
        finally:
            stop_wait.cancel()
            try:
                if stop.is_set():
                    await self._give_back()
            finally:
                await sub.unsubscribe()

    async def _give_back(self) -> None:
        """Until the pull requests still open at the server are spent. One
        delivered into an inbox nobody reads any more would sit unacked for
        the consumer's ack_wait before redelivery, so the inbox stays until
        each request expires (its 408 returns the credit, at most
        ``expires`` s) and what still arrives is NAKed to another puller."""
        self._stopping = True
        deadline = time.monotonic() + self._expires + 1.0
        while self.outstanding > 0 and (left := deadline - time.monotonic()) > 0:
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), left)
            except TimeoutError:
                break
