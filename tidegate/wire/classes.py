"""Request classes, highest first: which waiting request a saturated backend gets.

A request's class (``Request.klass``, and its subject ``<p>.req.<class>.<tenant>``)
is ``interactive`` (a client waits on it), ``background`` (a Responses
``background: true`` request: generated into its log, read later) or ``batch``
(a batch line). Queue mode (``dispatcher.queueing``) grants the best class
waiting across every tenant first, tenants sharing by tokens within a class.
Docs: docs/priorities.md#the-order.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

INTERACTIVE, BACKGROUND, BATCH = "interactive", "background", "batch"
CLASSES = (INTERACTIVE, BACKGROUND, BATCH)
# A job's tenant tier weight, set by the dispatcher when it is not 1, and the
# body of its preempt asks: an interactive stream gives way only to one of a
# heavier tier (workers.preemption).
WEIGHT_HEADER = "Tg-Weight"


def rank(klass: str) -> int:
    """0 for the highest class. A class this version does not know (a request
    off the broker is untrusted) ranks last."""
    return CLASSES.index(klass) if klass in CLASSES else len(CLASSES) - 1


def weight(value: str | bytes | None) -> float:
    """A tier weight off the broker (untrusted): 1 when absent or not a
    positive finite number."""
    try:
        w = float(value) if value else 1.0
    except ValueError:
        return 1.0
    return w if math.isfinite(w) and w > 0 else 1.0


def weight_of(headers: Mapping[str, str] | None) -> float:
    """A job message's tier weight (:data:`WEIGHT_HEADER`)."""
    return weight((headers or {}).get(WEIGHT_HEADER))
