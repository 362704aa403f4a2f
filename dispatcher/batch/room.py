"""How many batch lines a model may start now: the batch share rule (sans-I/O).

The runner reads the facts (slots, jobs running and waiting, its own lines) and
asks :func:`batch_room`, so the rule is tested on numbers:

1. a job waiting for a worker (the runner's own unpulled lines are no such job:
   :func:`others_wait`), or the model in queue mode: **0**;
2. no interactive job running: **every free slot**;
3. interactive jobs running: at most ``share`` of the slots they leave free,
   rounded up, less the batch lines already held.

Rule 3 because a free slot is not free capacity: the backend and the gateway's
CPU slow every stream they carry. Docs: docs/batch.md#scheduling-spare-capacity-only.
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
