"""The JSON events of written SSE bytes (:func:`sse_events`), for reading back
what a stream delivered (``tidegate.apis.delivered``: each dialect's text and
seam, docs/resume.md "Continuation")."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

__all__ = ["sse_events"]


def sse_events(parts: Iterable[bytes]) -> list[Any] | None:
    """The JSON events of the ``data:`` lines in ``parts`` (written SSE
    bytes), in order; ``[DONE]`` and comments skipped. None if a JSON event
    does not parse (a cut one cannot be continued)."""
    payloads: list[bytes] = []
    for line in b"".join(parts).split(b"\n"):
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].lstrip(b" ")
        if payload.startswith(b"{"):
            payloads.append(payload)
    # One parse of them all as a JSON array: a third of the time of one
    # json.loads per event (the edge folds long streams with this, so it is
    # paid per chunk there). A line holding more than one value ("{..},{..}")
    # would parse as two elements: the count tells, and it is refused as a
    # parse of that line alone would be.
    try:
        events = json.loads(b"[" + b",".join(payloads) + b"]")
    except ValueError:
        return None
    return events if isinstance(events, list) and len(events) == len(payloads) else None


