"""``python -m tests.faults.lossy_worker N worker --config ...``: a worker
that drops every Nth NATS message to an edge, as a lost core NATS message
would be (the retransmit tests). The drop wraps the publish the worker's
outbox is given (``workers.service`` builds it from ``Outbox``), so it
applies with coalescing on, the default; everything else is ``tidegate``
as it ships."""

from __future__ import annotations

import logging
import sys
from collections.abc import Awaitable, Callable
from typing import Any

from fleet.cli import main
from tidegate.wire.mux import Outbox
from workers import service

Publish = Callable[[str, bytes], Awaitable[None]]


def lossy(publish: Publish, every: int) -> Publish:
    count = 0

    async def drop_some(subject: str, payload: bytes) -> None:
        nonlocal count
        if ".out." in subject:
            count += 1
            if count % every == 0:
                return
        await publish(subject, payload)

    return drop_some


def patch(every: int) -> None:
    class LossyOutbox(Outbox):
        def __init__(self, publish: Publish, *args: Any, **kwargs: Any) -> None:
            super().__init__(lossy(publish, every), *args, **kwargs)

    service.Outbox = LossyOutbox  # type: ignore[misc]
    logging.getLogger("tidegate.worker").warning(
        "dropping every %dth message to an edge (tests.faults.lossy_worker)", every)


if __name__ == "__main__":
    patch(int(sys.argv.pop(1)))
    raise SystemExit(main())
