"""Preemption, the worker's side (docs/priorities.md#preemption).

A dispatcher that dispatched an interactive request while every slot of its
model was taken, and still sees them taken ``queue.preempt_after`` s later,
publishes on ``<p>.preempt.<model>``, heard only by workers holding a
preemptible job of it (one queue group). If a job of the model still waits
in JetStream, the one that hears it hands back a job (lowest class, lightest
tier, least output, latest started), NAKed for ``REQUEUE_DELAY``: a background
response stores its log and hand-back (workers.resumable); a batch line or a
stream tells its runner or edge it waits again (workers.job). Preemptible,
under ``queue.max_preemptions`` hand-backs (and ``worker.max_deliver`` - 2):
a batch line; with ``failover = "continue"`` and a rebuildable text, a
Responses background request (its log not full) and an interactive stream
of a tier lighter than the waiting request's (the ask carries its weight).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from tidegate.apis.delivered import responses_continuable, text_continuable
from tidegate.control.queue_stats import jobs_of
from tidegate.wire import classes
from workers.job import Job
from workers.job_context import JobContext
from workers.job_state import PREEMPTED, Phase
from workers.resumable import ResumableJob

log = logging.getLogger("tidegate.worker")

QUEUE_GROUP = "preempt"


class Preemptions:
    """This worker's preemptible jobs per model, and its subscriptions."""

    def __init__(self, ctx: JobContext) -> None:
        self.ctx = ctx
        self.config = ctx.config
        self.models = ctx.config.model_index()
        self.held: dict[str, set[Job]] = {}
        self._subs: dict[str, Subscription] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._heaviest = max((t.weight for t in ctx.config.tiers), default=1.0)

    def preemptible(self, job: Job, for_weight: float | None = None) -> bool:
        """Whether ``job`` may give its slot to an interactive request whose
        tier weighs ``for_weight`` (None: to one of the config's heaviest tier)."""
        model = self.models.get(job.request.model)
        if (model is None or model.queue.preempt_after <= 0 or job.cancel_reason
                or job.phase is Phase.ENDED):
            return False
        limit = min(model.queue.max_preemptions, self.config.worker.max_deliver - 2)
        if job.msg.metadata.num_delivered - 1 >= limit:
            return False
        request = job.request
        if not isinstance(job, ResumableJob):
            if request.klass == classes.BATCH and not request.stream:
                return True  # its runner is told it waits; nothing was delivered
            # A stream its edge continues from the delivered text, of a tier
            # lighter than the request that waits.
            heavier = self._heaviest if for_weight is None else for_weight
            return (request.klass == classes.INTERACTIVE and request.stream
                    and model.failover == "continue" and text_continuable(request)
                    and classes.weight_of(job.msg.headers) < heavier)
        if (model.failover != "continue" or not request.extra.get("background")
                or not job.log_continuable):
            return False
        return bool(text_continuable(request) or responses_continuable(request))

    def started(self, job: Job) -> None:
        """A job begins: held (and the model's subject followed) if preemptible."""
        if self.preemptible(job):
            self.held.setdefault(job.request.model, set()).add(job)
            self._sync(job.request.model)

    def ended(self, job: Job) -> None:
        jobs = self.held.get(job.request.model)
        if jobs is not None and job in jobs:
            jobs.discard(job)
            self._sync(job.request.model)

    def _sync(self, model: str) -> None:
        task = asyncio.get_running_loop().create_task(self._follow(model))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _follow(self, model: str) -> None:
        """Subscribed to the model's preempt subject exactly while a
        preemptible job of it runs here (the lock orders the changes)."""
        async with self._locks.setdefault(model, asyncio.Lock()):
            want = bool(self.held.get(model))
            sub = self._subs.get(model)
            try:
                if want and sub is None:
                    self._subs[model] = await self.ctx.nc.subscribe(
                        self.config.nats.subjects.preempt(model), queue=QUEUE_GROUP,
                        cb=self._on_preempt(model))
                elif not want and sub is not None:
                    del self._subs[model]
                    await sub.unsubscribe()
            except Exception as exc:  # NATS down: the next change tries again
                log.debug("preempt subscription of %s: %s", model, exc)

    def _on_preempt(self, model: str) -> Callable[[Msg], Awaitable[None]]:
        async def on_preempt(msg: Msg) -> None:
            await self.preempt(model, classes.weight(msg.data))
        return on_preempt

    async def preempt(self, model: str, for_weight: float = 1.0) -> Job | None:
        """Hand back one job of ``model`` preemptible for a request of tier
        weight ``for_weight`` if a job of it waits for a slot; the job handed
        back, or None."""
        config = self.models.get(model)
        if config is None or not any(self.preemptible(j, for_weight)
                                     for j in self.held.get(model, ())):
            return None
        waiting, _ = await jobs_of(self.ctx.jetstream(), self.config, config)
        # Chosen after the wait, with no await before the cancel: two asks
        # at once never pick the same job.
        candidates = [j for j in self.held.get(model, ()) if self.preemptible(j, for_weight)]
        if not waiting or not candidates:
            return None  # the interactive request found a slot meanwhile
        job = min(candidates, key=lambda j: (
            -classes.rank(j.request.klass), classes.weight_of(j.msg.headers), j.chunks_sent,
            -j.started))
        log.info("job %s: its slot goes to an interactive request of %s", job.request.id,
                 model)
        job.cancel(PREEMPTED)
        self.ended(job)
        return job
