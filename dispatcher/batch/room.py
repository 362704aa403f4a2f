"""How many batch lines a model may start now: the batch share rule (sans-I/O).

The runner (``dispatcher.batch.release``) reads the facts (live slots from the worker
registry, jobs running and waiting from the model's worker consumers, its own
lines in flight) and asks :func:`batch_room`. Kept apart so the rule is tested
on numbers, without servers.

The rule, in order:

1. A job waiting for a worker, or the model in queue mode: **0**. Batch never
   puts a job in front of an interactive one (the caller checks both and
   passes ``waiting``). The runner's own lines released and not yet pulled
   are no such job (:func:`others_wait`): counted as waiting, a worker slow to
   pull (a busy machine) held the batch back at releases where no other job
   waited. (With the runner's lost wake-up fixed too, the batch's throughput
   against interactive's beside two CPU hogs went from 0.935-0.954 to
   0.956-0.962, three runs each, tests/test_promises_batch_bench.py.)
2. No interactive job running on the model: batch may take **every free
   slot** (idle GPU time is what batch is for).
3. Interactive jobs running: batch may hold at most ``share`` of the slots
   interactive jobs leave free, rounded up (so a batch never starves while a
   slot is free), minus the batch lines it already holds. The share shrinks
   as interactive load grows (fewer slots left free) and comes back whole when
   it leaves.

Why rule 3, when rule 1 already keeps interactive jobs out of the queue: a
free slot is not free capacity. A GPU batch past its sweet spot slows every
stream in it, and the gateway's own CPU relays batch answers too; filling all
free slots with batch lines added 103-129 ms to the interactive TTFT p99 at 50
streams on the 2-core bench machine (docs/benchmarks.md, scenario (j)) although
no interactive job ever waited behind a batch line; a share of 0.05 kept it
within 20 ms in 5 of 6 runs.
"""

from __future__ import annotations

import math


def others_wait(pending: int, unstarted: int) -> bool:
    """Whether a job other than the runner's own lines waits for a worker:
    the model's consumers hold more undelivered jobs (``pending``) than the
    lines the runner released that no worker has started (``unstarted``).
    Some of those may be pulled already, so an interactive job queued right
    behind them can go unseen for a moment; a line released then waits
    behind it in JetStream's order, never ahead of it."""
    return pending > unstarted


def batch_room(*, slots: int, running: int, batch_running: int, batch_unstarted: int,
               share: float, waiting: bool) -> int:
    """Lines of one model the runner may release now (never negative).

    ``slots``: live slots of the model's workers (registry); ``running``: jobs
    the workers hold (interactive and batch, the consumers' ack-pending);
    ``batch_running``: the runner's lines among them (started);
    ``batch_unstarted``: lines released that no worker has started yet (they
    will take slots); ``share``: ``batch.share_under_load``; ``waiting``: a job
    waits for a worker or the model is in queue mode.
    """
    if waiting or slots <= 0:
        return 0
    free = slots - running - batch_unstarted
    if free <= 0:
        return 0
    # A released line counts as batch from its release on: one a worker has
    # pulled but whose head has not reached the runner yet is in ``running``
    # too, and counting it as interactive would throttle a batch running alone.
    held = batch_running + batch_unstarted
    interactive = max(0, running - held)
    if interactive == 0:
        return free
    # Slots interactive jobs leave free, of which batch may hold a share.
    cap = math.ceil(share * max(0, slots - interactive))
    return max(0, min(free, cap - held))
