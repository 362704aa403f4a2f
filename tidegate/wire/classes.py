"""Request classes, highest first: which waiting request a saturated backend gets.

A request's class (``Request.klass``, and its subject ``<p>.req.<class>.<tenant>``)
is ``interactive`` (a client waits on it), ``background`` (a Responses
``background: true`` request: generated into its log, read later) or ``batch``
(a batch line). Queue mode (``dispatcher.queueing``) grants the best class
waiting across every tenant first, tenants sharing by tokens within a class.
Docs: docs/priorities.md#the-order.
"""

from __future__ import annotations

INTERACTIVE, BACKGROUND, BATCH = "interactive", "background", "batch"
CLASSES = (INTERACTIVE, BACKGROUND, BATCH)


def rank(klass: str) -> int:
    """0 for the highest class. A class this version does not know (a request
    off the broker is untrusted) ranks last."""
    return CLASSES.index(klass) if klass in CLASSES else len(CLASSES) - 1
