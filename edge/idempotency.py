"""``Idempotency-Key``: a generation a client may send again without it running twice.

With a key, the request id is a function of the tenant, the key and the
route, so both tries are one request:

* a resumable request whose log exists gets its stream from the log, from its
  first event (``Idempotent-Replayed: true``); a log without its request (the
  first edge died in between) gets the request published again;
* any other request sent again within ``streams.duplicate_window`` gets 409
  ``idempotency_key_in_use``;
* after the window (and the log) the key names a new request.

Keys are up to 255 printable ASCII characters. WebSocket and gRPC carry none.
Docs: docs/resume.md#sending-a-request-again-idempotency-key.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Mapping

from edge.publish import patience
from edge.state import EdgeState
from tidegate.broker.patient import PATIENCE_STEP
from tidegate.errors import ApiError, invalid_request

HEADER = "Idempotency-Key"
REPLAYED_HEADER = "Idempotent-Replayed"
MAX_LENGTH = 255
# A log younger than the duplicate window less this margin may have lost its
# request (its edge died between the two publishes): publishing it again is
# then safe, as JetStream still drops a copy of one that landed.
_MARGIN_S = 10.0


def key_of(headers: Mapping[str, str]) -> str | None:
    """The request's key, or None; 400 for a malformed one."""
    raw = headers.get(HEADER)
    if raw is None:
        return None
    key = raw.strip()
    if not 0 < len(key) <= MAX_LENGTH or not all(" " <= c <= "~" for c in key):
        raise invalid_request(f"{HEADER} must be 1 to {MAX_LENGTH} printable ASCII characters.",
                              code="invalid_idempotency_key", param=HEADER)
    return key


def request_id(tenant: str, key: str, route: str) -> str:
    """The id of the tenant's request under ``key`` on ``route`` (the
    dialect's path, ``/chat/completions``...): 24 hex characters, as a fresh
    one (``edge.publish.build_request``). The route is part of it: a key sent
    again to another route names another request, not the first one's answer
    in a format its client cannot read."""
    # The lengths keep ("ab", "c...") and ("a", "bc...") apart.
    named = f"{len(tenant)}:{tenant}{len(route)}:{route}{key}".encode()
    return hashlib.blake2b(named, digest_size=12, person=b"tidegate-idem").hexdigest()


async def sent_before(state: EdgeState, request_id_: str, tenant: str) -> tuple[bool, bool]:
    """Whether a resumable request's log exists (it was sent before), and
    whether it is young enough to publish the request again safely. As
    patient with an unreachable broker (a NATS node's death) as the publish
    that follows (``edge.publish.patience``)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + patience(state.config)
    while True:
        try:
            opened = await state.streamlog.lookup(request_id_, tenant)
            break
        except ApiError as error:
            if error.status == 404:
                return False, False
            if error.code != "broker_unavailable" or loop.time() + PATIENCE_STEP >= deadline:
                raise
        await asyncio.sleep(PATIENCE_STEP)
    age = time.time() - opened.created_ms / 1000
    return True, age < state.config.streams.duplicate_window - _MARGIN_S


def in_use(window: float) -> ApiError:
    return ApiError(409, f"A request with this {HEADER} was sent in the last {window:g}s; it "
                         f"runs once, and its answer went to the first connection (make it "
                         f"resumable to read it again).", type="invalid_request_error",
                    code="idempotency_key_in_use", param=HEADER)
