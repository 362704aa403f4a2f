"""How a relay ends a stream other than with its answer: the drain's
``event: reconnect`` (:class:`Reconnect`, :func:`reconnect_event`), a client
that does not drain its socket (:class:`SlowClient`), and a worker lost after
output reached the client (:func:`worker_lost`). Used by ``edge.relay`` and
its WebSocket and resume siblings."""

from __future__ import annotations

import json

from tidegate.errors import ApiError


class Reconnect(ApiError):
    """This edge is draining or cut from NATS: a resumable stream's client is
    told to resume elsewhere (the final ``event: reconnect``), not cut off."""

    def __init__(self, why: str = "is shutting down") -> None:
        super().__init__(503, f"This gateway node {why}; resume the stream on another.",
                         type="server_error", code="edge_reconnect", retryable=True,
                         retry_after=0)


def reconnect_event(request_id: str, last_event_id: int, retry_ms: int) -> bytes:
    """The documented last event of a stream whose edge drains (docs/resume.md):
    where and from which event to resume. ``GET resume_url`` with
    ``Last-Event-ID: last_event_id`` on any edge continues it exactly."""
    payload = json.dumps({"resume_url": f"/v1/streams/{request_id}",
                          "last_event_id": last_event_id, "retry_ms": retry_ms})
    return b"event: reconnect\ndata: %b\n\n" % payload.encode()


class SlowClient(Exception):
    """The client did not drain its socket within edge.slow_client_timeout."""


def worker_lost() -> ApiError:
    """The worker died after output reached the client: two generations
    cannot be spliced, so the stream ends with a retryable error."""
    return ApiError(502, "The worker running this request was lost mid-response.",
                    type="server_error", code="worker_lost", retryable=True, retry_after=1)
