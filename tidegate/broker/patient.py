"""A JetStream publish that outlasts a leader's election.

When a NATS node dies, a stream whose leader was on it has none until its
followers elect another (4-9 s in nats-server, not a setting), and a client
on that node reconnects to another. Meanwhile a publish gets no PubAck (a
timeout, or "no responders": nobody leads the stream) or JetStream's 503.
:func:`publish` tries again every :data:`PATIENCE_STEP` for as long as the
caller's patience allows. Safe only with ``Nats-Msg-Id`` set: a retry of a
publish that did land (its PubAck lost) is dropped by the stream's
duplicate window. Used by the edge for requests and log openings
(``edge.publish``) and by workers for a resumable stream's log end
(``workers.resumable``).
"""

from __future__ import annotations

import asyncio
import logging

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import PubAck

log = logging.getLogger("tidegate.broker")

# How often a patient call tries again while the broker is unreachable.
PATIENCE_STEP = 0.25


def transient(exc: Exception) -> bool:
    """A publish that may succeed if tried again soon: no PubAck (the node
    died, the connection is reconnecting, the stream has no leader: "no
    responders"), or JetStream's 503 "temporarily unavailable" during an
    election. A full stream ("maximum ...") and other refusals are answers."""
    if isinstance(exc, nats.js.errors.APIError):
        return exc.code == 503 and "maximum" not in (exc.description or "").lower()
    return isinstance(exc, nats.errors.Error | TimeoutError)


async def publish(js: JetStreamContext, nc: NATS, subject: str, payload: bytes,
                  headers: dict[str, str], patience: float) -> tuple[PubAck, int]:
    """``js.publish``, tried again while :func:`transient` for up to
    ``patience`` seconds; the PubAck and how many tries it took. The last
    error is raised when patience runs out or the connection is closed for
    good."""
    loop = asyncio.get_running_loop()
    tries = 0
    deadline = loop.time() + patience
    while True:
        tries += 1
        try:
            return await js.publish(subject, payload, headers=headers), tries
        except Exception as exc:
            if (not transient(exc) or nc.is_closed
                    or loop.time() + PATIENCE_STEP >= deadline):
                raise
            log.info("publish to %s: %s; retrying", subject, type(exc).__name__)
        await asyncio.sleep(PATIENCE_STEP)
