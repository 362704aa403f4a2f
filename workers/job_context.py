"""What every job of one worker process shares (:class:`JobContext`: config,
NATS, outboxes, telemetry, prices), and the two things done with it outside
a job: sending kept messages again (:func:`resend`) and reading whether the
dispatcher reserved quota (:func:`reserved`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from tidegate.broker import bodies, broker, patient
from tidegate.config import Config
from tidegate.control import prices
from tidegate.telemetry import telemetry as tm
from tidegate.telemetry.telemetry import Telemetry
from tidegate.wire.mux import Outbox
from tidegate.wire.protocol import RESERVED_HEADER, Request, UsageRecord
from workers.owners import ResponseOwners
from workers.tails import Tails

log = logging.getLogger("tidegate.worker")


@dataclass(frozen=True, slots=True)
class JobContext:
    """What every job of one worker process shares."""

    config: Config
    nc: NATS
    control_subject: str
    telemetry: Telemetry = field(default_factory=tm.get)
    # Coalesces messages to the same edge (None: one NATS message per session
    # message, as with an edge that does not advertise a mux subject).
    outbox: Outbox | None = None
    # Batches resumable streams' stream-log entries (workers.resumable); the
    # same outbox as ``outbox`` when there is one.
    log_outbox: Outbox | None = None
    # The prices in force (config + KV, watched); None: nothing is priced.
    prices: prices.PriceBook | None = None
    # This process's ended jobs' unacked messages (workers.tails), the
    # pool's; None: the pool keeps its own (unit tests).
    tails: Tails | None = None
    # Who owns each Responses API response (workers.owners); None: unchecked
    # (unit tests).
    owners: ResponseOwners | None = None

    # The JetStream context usage records are stored through (None: made
    # per record, unit tests).
    js: JetStreamContext | None = None

    def jetstream(self) -> JetStreamContext:
        return self.js if self.js is not None else broker.jetstream(self.nc, self.config.nats)

    async def report(self, record: UsageRecord) -> None:
        """Store a usage record in the TG_USAGE stream, before the job's ack.

        An acked publish, retried while the broker is briefly away (a NATS
        node's death, an election: ``tidegate.broker.patient``, for
        ``edge.publish_patience``): the job is acked only after its record is
        stored, so no node's death, nor every node's at once, leaves an
        acked job without its record (a plain publish was lost so, 1 of 259
        in the kill-all test). The client does not wait on it (its Done went
        out first); the job's slot waits one round trip. ``Nats-Msg-Id``
        deduplicates a redelivered job's record. Out of patience, the record
        is logged as lost (the reservation then expires), never the answer."""
        try:
            await patient.publish(self.jetstream(), self.nc,
                                  self.config.nats.subjects.usage(record.model), record.encode(),
                                  {"Nats-Msg-Id": f"u-{record.id}"},
                                  self.config.edge.publish_patience)
        except Exception as exc:
            log.warning("could not store usage for %s: %s", record.id, exc)


async def ack(ctx: JobContext, request: Request, msg: Msg) -> None:
    """Ack a job once everything it sent is handed to NATS: a mux stream's
    messages wait in the outbox while the ack goes straight out, and an ack
    that overtook the Done left a stream no delivery would ever end."""
    if request.mux and ctx.outbox is not None:
        await ctx.outbox.flush()
    await msg.ack()
    if request.claim:  # acked for good: no delivery will read its body again
        bodies.discard(ctx.jetstream(), ctx.config, request)


def dropped(request: Request, msg: Msg) -> UsageRecord:
    """The zero-token record of a job that never ran: it refunds the
    reservation and frees the concurrency slot."""
    return UsageRecord(id=request.id, model=request.model, outcome="dropped",
                       tenant=request.tenant, user=request.user, key_id=request.key_id,
                       attempt=msg.metadata.num_delivered, reserved=reserved(msg))


async def resend(ctx: JobContext, request: Request, messages: list[bytes]) -> None:
    """Send kept messages to the request's edge again, in order."""
    outbox = ctx.outbox if request.mux else None
    for message in messages:
        if outbox is not None:
            outbox.put(request.mux, request.id, message)
        else:
            await ctx.nc.publish(request.reply, message)


def reserved(msg: Msg) -> bool:
    """Whether the dispatcher reserved quota for this job (see RESERVED_HEADER)."""
    return bool(msg.headers and msg.headers.get(RESERVED_HEADER))
