"""Turning one validated generation into a published request: the envelope
(:func:`build_request`), the model check (:func:`may_use`, :func:`models_for`), the stream
log's first entry and the patient JetStream publish. Shared by the HTTP
routes, the WebSocket adapter and background responses.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Mapping
from typing import NamedTuple

import nats.errors
import nats.js.errors
from nats.js.api import PubAck

from edge.auth import Principal
from edge.state import EdgeState
from tidegate import apis
from tidegate.broker import bodies, patient
from tidegate.config import Config, ModelConfig
from tidegate.errors import ApiError, BrokerError, ProtocolError, invalid_request, unavailable
from tidegate.validation.generation import Validated, model_not_found
from tidegate.wire import classes, streamlog
from tidegate.wire.protocol import Request

log = logging.getLogger("tidegate.edge")


def may_use(principal: Principal, model: ModelConfig) -> bool:
    """Whether the key may use the model: any of its names is on the key's
    list, or the key has no list."""
    return not principal.models or not {model.name, *model.aliases}.isdisjoint(principal.models)


def models_for(state: EdgeState, principal: Principal) -> Mapping[str, ModelConfig]:
    """The models (names and aliases) the key may use: what every route
    validates a body against. Invariant: a model the key may not use is
    unknown to it, answered as one that does not exist at the same step (404
    ``model_not_found``), so neither the answer nor which field is checked
    next tells a restricted key which other models exist."""
    if not principal.models:
        return state.models
    return {name: model for name, model in state.models.items() if may_use(principal, model)}


def build_request(state: EdgeState, principal: Principal, valid: Validated,
                  carrier: dict[str, str], grace: float | None = None,
                  request_id: str | None = None) -> Request:
    """The envelope for one validated generation, with a fresh request id
    (96 random bits) unless ``request_id`` names it (``edge.idempotency``);
    404 if the key may not use the model (validated against
    :func:`models_for`, it cannot get here; checked again all the same).
    Shared by the HTTP routes and the WebSocket adapter (``edge/ws.py``).
    ``grace``: a resumable stream's grace (``edge.resume.resume_grace``);
    None = not resumable."""
    if not may_use(principal, valid.model):
        raise model_not_found(str(valid.body["model"]))
    config = state.config
    request_id = request_id or secrets.token_hex(12)
    subjects = config.nats.subjects
    now_ms = int(time.time() * 1000)
    return Request(
        id=request_id,
        reply=subjects.out(state.edge_id, request_id),
        model=valid.model.name,
        api=valid.api,
        stream=valid.stream,
        body=valid.body,
        created_ms=now_ms,
        deadline_ms=now_ms + int(config.edge.queue_timeout * 1000),
        window_bytes=config.session.window_bytes,
        window_msgs=config.session.window_msgs,
        include_usage=valid.include_usage,
        tenant=principal.tenant,
        user=principal.user,
        key_id=principal.key_id,
        edge=state.edge_id,
        mux=subjects.edge_mux(state.edge_id),
        extra=dict(carrier),
        resumable=grace is not None,
        grace=grace or 0.0,
        # Responses' background mode waits behind what a client waits on.
        klass=(classes.BACKGROUND if valid.body.get("background") is True
               and apis.of(valid.api).background else classes.INTERACTIVE),
    )


class Published(NamedTuple):
    """Where the request went: its JetStream sequence number, and whether the
    stream already held it when this edge's first try landed (the same
    ``Nats-Msg-Id`` within ``streams.duplicate_window``: the same
    ``Idempotency-Key`` sent again). A duplicate seen only on a retry of
    this edge's own publish (its first PubAck lost) is not a repeat."""

    seq: int
    repeat: bool


async def publish_request(state: EdgeState, request: Request,
                          trace_headers: dict[str, str]) -> Published:
    """Publish to the requests stream. A resumable request's stream log is
    opened first, once the request is known to be publishable: a 400 or 413
    leaves no log behind (a resume of it would wait for a stream that never
    comes)."""
    subject = state.config.nats.subjects.request(request.klass, request.tenant)
    try:
        payload = request.encode()
    except ProtocolError:
        raise invalid_request("The request contains a number outside the 64-bit integer "
                              "range.", code="invalid_value") from None
    max_payload = state.nc.max_payload
    if len(payload) > bodies.threshold(state.config, max_payload):
        payload = await _claim_check(state, request)
    if len(payload) > max_payload:
        raise ApiError(413, "The request is too large for the broker's message size limit.",
                       type="invalid_request_error", code="request_too_large")
    if request.resumable:
        await _open_log(state, request)
    try:
        ack, tries = await _publish(state, subject, payload,
                                    {"Nats-Msg-Id": request.id, **trace_headers})
    except nats.js.errors.APIError as exc:
        description = (exc.description or "").lower()
        if "maximum" in description or exc.code == 503:
            raise unavailable("The gateway's request queue is full; retry later.",
                              code="overloaded", retry_after=2) from None
        raise unavailable(f"The broker refused the request: {exc.description}",
                          code="broker_error") from None
    except (nats.errors.Error, TimeoutError) as exc:
        raise unavailable(f"The broker is unavailable ({type(exc).__name__}); retry later.",
                          code="broker_unavailable", retry_after=2) from None
    return Published(int(ack.seq), bool(ack.duplicate) and tries == 1)


async def publish_patiently(state: EdgeState, subject: str, payload: bytes,
                            headers: dict[str, str]) -> PubAck:
    """``js.publish``, retried for up to ``edge.publish_patience`` seconds
    (at most half of ``edge.admission_timeout``)
    while the broker is briefly unreachable (a NATS node's death, a leader
    election), instead of answering 503 at once (``tidegate.broker.patient``:
    every caller sets ``Nats-Msg-Id``, so a retry never queues a request
    twice). The client waits meanwhile."""
    ack, _ = await _publish(state, subject, payload, headers)
    return ack


async def _publish(state: EdgeState, subject: str, payload: bytes,
                   headers: dict[str, str]) -> tuple[PubAck, int]:
    """:func:`publish_patiently`, and how many tries it took."""
    return await patient.publish(state.js, state.nc, subject, payload, headers,
                                 patience(state.config))


async def _claim_check(state: EdgeState, request: Request) -> bytes:
    """The envelope of ``request`` with its body in the bodies' object store
    (tidegate.broker.bodies): what no NATS message could carry crosses the
    broker by name."""
    try:
        claimed = await bodies.check_in(state.js, state.config, request, state.nc.max_payload)
    except (nats.errors.Error, TimeoutError, BrokerError) as exc:
        raise unavailable(f"The broker could not store the request body "
                          f"({type(exc).__name__}); retry later.",
                          code="broker_unavailable", retry_after=2) from None
    return claimed.encode()


def patience(config: Config) -> float:
    """How long the edge tries to reach JetStream before answering 503:
    ``edge.publish_patience``, at most half of ``edge.admission_timeout``."""
    return min(config.edge.publish_patience, config.edge.admission_timeout / 2)


async def _open_log(state: EdgeState, request: Request) -> None:
    """The stream log's first entry (its tenant), stored before the request is
    published: a resume can then never find a stream without its owner."""
    entry = streamlog.LogOpen(request.tenant, request.stream, int(request.api),
                              request.created_ms, request.grace)
    try:
        # Its own message id: a retried open is stored once.
        await publish_patiently(state, streamlog.subject(state.config.nats.subjects, request.id),
                                entry.encode(), {"Nats-Msg-Id": f"{request.id}.open"})
    except (nats.errors.Error, TimeoutError) as exc:
        raise unavailable(f"The stream log is unavailable ({type(exc).__name__}); retry "
                          "later.", code="broker_unavailable", retry_after=2) from None
