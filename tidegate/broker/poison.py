"""Poison messages: one message a tier cannot process must not stop it.

A handler that raises on a JetStream message is either *transient* (the broker,
Redis or the network failed: the message is redelivered) or *poison* (the
message itself breaks the handler, and would be redelivered to the same failure
forever, holding an ack-pending slot each time). A poison message is answered
with an error where someone waits (best effort), terminated (``AckTerm``) and
counted in ``tidegate.broker.bad_messages`` (reason ``poison``), rate-limited
in the log.

The caller names what is transient (:data:`TRANSIENT` plus its own errors);
everything else, bug or hostile input, ends the same way. Docs: docs/reliability.md.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import nats.errors
import nats.js.errors
from nats.aio.msg import Msg

from tidegate.errors import BrokerError
from tidegate.telemetry.untrusted import BadInput

log = logging.getLogger("tidegate.poison")

# Failures of the infrastructure, not of the message: redeliver.
TRANSIENT: tuple[type[BaseException], ...] = (
    nats.errors.Error, nats.js.errors.Error, TimeoutError, ConnectionError, BrokerError)

Answer = Callable[[], Awaitable[None]]


def is_transient(exc: BaseException,
                 extra: tuple[type[BaseException], ...] = ()) -> bool:
    """Whether ``exc`` says the infrastructure failed (redeliver the message)
    rather than the message being unprocessable."""
    return isinstance(exc, TRANSIENT + extra)


async def terminate(msg: Msg, bad: BadInput, kind: str, exc: BaseException,
                    answer: Answer | None = None) -> None:
    """End a poison message: answer (best effort), count and log, AckTerm.

    Never raises (but re-raises cancellation): it runs where the handler's own
    failure was caught, and a second failure here must not escape either."""
    bad.drop(kind, "poison", f"{type(exc).__name__}: {exc}")
    log.debug("poison message on a %s subject", kind, exc_info=exc)
    if answer is not None:
        try:
            await answer()
        except asyncio.CancelledError:
            raise
        except Exception as error:  # the answer is a courtesy; termination is the rule
            log.warning("could not answer a poison %s message: %s", kind, error)
    try:
        await msg.term()
    except asyncio.CancelledError:
        raise
    except Exception as error:
        # Not terminated (NATS down): it comes back after ack_wait and ends here again.
        log.warning("could not terminate a poison %s message: %s", kind, error)
