"""Which workers a process follows, and whether they are still connected.

Followers: each edge (the workers its open streams come from) and the batch
runner (the workers running its lines). Once per ``session.liveness_interval``
per followed *worker* (not per stream), an empty request goes to the worker's
control subject ``<p>.ctl.<worker>``:

* "no responders" for :data:`CONFIRM_AFTER`: the subscription is gone, the
  worker is dead; every follower is told (``worker_lost``) and acts at once.
* a timeout: the worker is subscribed and alive (it never replies). A slow or
  stopped worker is never declared dead by this rule; the heartbeat rule
  still applies to it.

Docs: docs/lifecycle.md#fast-death-detection.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

import nats.errors
from nats.aio.client import Client as NATS

log = logging.getLogger("tidegate.liveness")

# How long every probe must find no responders before the worker is taken
# for dead. A worker whose NATS node died reconnects to another and
# subscribes again (at once to a node it has not tried lately: the dead one
# refuses at once); taking that gap for a death hands its jobs to a second
# worker while it still runs them. 0.5 s once ended 2 streams of 30 with
# worker_lost at a NATS node's kill on a loaded machine, and 1.5 s was used
# since; that run predates the fixes for second deliveries and the fencing
# of a worker taken for dead (docs/lifecycle.md). At 0.6 s, ten chaos runs
# (28 NATS node kills) completed every stream but one (not explained,
# docs/reliability.md) and took no worker for dead at a node kill where
# their logs were kept, with a death known 0.8 s after it. Detection: at
# most twice the interval (0.2 s) plus this.
CONFIRM_AFTER = 0.6

# A job handed back (-NAK) while the dead worker's last pull requests are
# still registered on the server goes to one of them, nobody reads it, and it
# waits out worker.ack_wait (nats-server keeps a pull request until it
# expires, whoever sent it). A death is confirmed only once those have
# expired: never sooner than the pull expiry (worker.fetch_timeout) plus this,
# after the first probe that found nobody, which is after the death.
PULL_MARGIN = 0.1

# A timer may fire this much early against time.monotonic (the event loop
# rounds to its clock's resolution): the probe due at the confirmation's end
# still counts as its end.
TIMER_SLACK = 0.005

# How long a worker asked whether it runs a job (:func:`runs`) has to say so
# before its silence is taken for "alive, maybe running it" (a busy box).
ANSWER_WITHIN = 2.0


async def nobody_at(nc: NATS, subject: str, wait: float) -> bool | None:
    """One probe, waiting ``wait`` seconds at most. True: nobody subscribes
    to ``subject``; False: somebody does (the request timed out unanswered,
    or was answered); None: this process could not ask (its own NATS
    connection is down: that says nothing)."""
    try:
        await nc.request(subject, b"", timeout=wait)
    except nats.errors.NoRespondersError:
        return True
    except nats.errors.TimeoutError:
        return False
    except (TimeoutError, nats.errors.Error, OSError):
        return None
    return False


# What a worker says of a job it is asked about (:func:`runs`).
RUNNING = "running"  # it runs it (or is there and silent: stopped, saturated)
ENDED = "ended"  # it ran it to its end lately (its tail, workers.tails)
GONE = "gone"  # the worker is gone, or lives without the job (dropped it, fenced)


async def runs(nc: NATS, presence: str, request_id: str, interval: float) -> str | None:
    """What the worker whose presence subject is ``presence`` says of the job
    of ``request_id``, asked once: a redelivered job no edge speaks for asks
    its first worker (workers.resumable). The worker answers ``b"1"`` (it
    runs it), ``b"2"`` (it ended it lately) or ``b"0"`` (neither: it dropped
    it, cut from NATS, workers.fencing).

    :data:`GONE` once every probe for :data:`CONFIRM_AFTER` found no
    subscriber (the rule of :class:`WorkerWatch`) or the worker says ``0``;
    :data:`ENDED` for ``2``; :data:`RUNNING` for ``1`` or no answer
    (subscribed, so alive: a stopped or saturated worker may still run it,
    and is never taken for gone); None when this process could not ask for
    ``4 * CONFIRM_AFTER``."""
    start = time.monotonic()
    absent_since: float | None = None
    while time.monotonic() - start < 4 * CONFIRM_AFTER:
        started = time.monotonic()
        try:
            reply = await nc.request(presence, request_id.encode(), timeout=ANSWER_WITHIN)
        except nats.errors.NoRespondersError:
            if absent_since is None:
                absent_since = started
            elif started - absent_since >= CONFIRM_AFTER:
                return GONE
        except nats.errors.TimeoutError:
            return RUNNING
        except (TimeoutError, nats.errors.Error, OSError):
            absent_since = None  # no probe is no evidence: the confirmation starts again
        else:
            return GONE if reply.data == b"0" else ENDED if reply.data == b"2" else RUNNING
        rest = interval - (time.monotonic() - started)
        if rest > 0:
            await asyncio.sleep(rest)
    return None


class Follower(Protocol):
    """What the watch tells: a session (``edge.session.Session``)."""

    def worker_lost(self, control: str) -> None: ...


class WorkerWatch:
    """Probes every worker control subject some open stream follows."""

    def __init__(self, nc: NATS, interval: float, pull_expiry: float = 0.0) -> None:
        self._nc = nc
        self.interval = interval
        # How long "no responders" must last: CONFIRM_AFTER, or the followed
        # workers' pull expiry plus PULL_MARGIN when that is longer.
        self.confirmation = max(CONFIRM_AFTER, pull_expiry + PULL_MARGIN)
        self._followers: dict[str, set[Follower]] = {}
        self._probes: dict[str, asyncio.Task[None]] = {}
        self.lost_total = 0

    @property
    def enabled(self) -> bool:
        return self.interval > 0

    def following(self) -> list[str]:
        return list(self._followers)

    def follow(self, follower: Follower, control: str) -> None:
        """``follower`` now streams from the worker at ``control``."""
        if not self.enabled or not control:
            return
        followers = self._followers.get(control)
        if followers is None:
            followers = self._followers[control] = set()
            task = asyncio.get_running_loop().create_task(self._probe(control),
                                                          name=f"tidegate-probe-{control}")
            task.add_done_callback(self._probe_ended)
            self._probes[control] = task
        followers.add(follower)

    def unfollow(self, follower: Follower, control: str) -> None:
        followers = self._followers.get(control)
        if followers is None:
            return
        followers.discard(follower)
        if not followers:
            del self._followers[control]
            task = self._probes.pop(control, None)
            if task is not None:
                task.cancel()

    def close(self) -> None:
        for task in self._probes.values():
            task.cancel()
        self._probes.clear()
        self._followers.clear()

    async def _probe(self, control: str) -> None:
        alive_at = time.monotonic()
        absent_since: float | None = None  # the first of the probes that found nobody
        while control in self._followers:
            started = time.monotonic()
            absent = await nobody_at(self._nc, control, self.interval)
            if absent is False:
                alive_at, absent_since = started, None
            elif absent:
                if absent_since is None:
                    absent_since = started
                elif started - absent_since >= self.confirmation - TIMER_SLACK:
                    self._declare_lost(control, time.monotonic() - alive_at)
                    return
            # A timed-out probe already took the interval; an answered or
            # failed one waits out the rest of it. While nobody answers, the
            # confirmation's end is a probe of its own: on a busy loop the
            # probes drift late, and the one after the confirmation's end
            # came up to an interval after it (deaths known after 1.0 s
            # instead of 0.8 s at 30 streams).
            rest = self.interval - (time.monotonic() - started)
            if absent_since is not None:
                rest = min(rest, absent_since + self.confirmation - time.monotonic())
            if rest > 0:
                await asyncio.sleep(rest)

    def _declare_lost(self, control: str, silent: float) -> None:
        followers = self._followers.pop(control, set())
        self._probes.pop(control, None)
        self.lost_total += 1
        log.warning("worker %s is gone (no subscriber on its control subject; last seen "
                    "alive %.2fs ago); %d streams follow it", control, silent, len(followers))
        for follower in followers:
            follower.worker_lost(control)

    def _probe_ended(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("worker liveness probe failed", exc_info=task.exception())
