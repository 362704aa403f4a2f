"""What every job of one worker process shares (:class:`JobContext`: config,
NATS, outboxes, telemetry, prices), and the two things done with it outside
a job: sending kept messages again (:func:`resend`) and reading whether the
dispatcher reserved quota (:func:`reserved`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

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

    async def report(self, record: UsageRecord) -> None:
        """Publish a usage record to the TG_USAGE stream.

        A plain publish, not JetStream's acked one: waiting for the stream's
        ack cost every job a request/reply (a reply message, an inbox future
        and a timer), and a record that does not make it could only be logged
        anyway. It goes out on the same connection before the job's ack, so
        the server stores it first; ``Nats-Msg-Id`` still deduplicates a
        redelivered job's record. A lost record (broker unreachable) costs an
        accounting entry (the reservation then expires), never the answer."""
        try:
            await self.nc.publish(self.config.nats.subjects.usage(record.model),
                                  record.encode(), headers={"Nats-Msg-Id": f"u-{record.id}"})
        except Exception as exc:
            log.warning("could not publish usage for %s: %s", record.id, exc)


async def ack(ctx: JobContext, request: Request, msg: Msg) -> None:
    """Ack a job once everything it sent is handed to NATS: a mux stream's
    messages wait in the outbox while the ack goes straight out, and an ack
    that overtook the Done left a stream no delivery would ever end."""
    if request.mux and ctx.outbox is not None:
        await ctx.outbox.flush()
    await msg.ack()


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
