"""The tidegate exception hierarchy.

Root: :class:`TidegateError`; a boundary that catches it knows it is not a bug.

* :class:`ConfigError` - invalid configuration, at start, naming the key.
* :class:`ApiError` - a client-facing error with its HTTP status and OpenAI
  fields, turned into JSON in one place (``edge.errors``); across the broker
  it travels as a :class:`tidegate.wire.protocol.ErrorInfo`.
* :class:`BackendError` - the model backend failed (an :class:`ApiError`).
* :class:`ProtocolError` - a malformed envelope on the wire.
* :class:`BrokerError` - NATS or JetStream refused or is unreachable.

:data:`CATALOGUE` is every code a client can see (docs/reference/errors.md).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


class TidegateError(Exception):
    """Root of every error tidegate raises deliberately."""


class ConfigError(TidegateError):
    """Invalid configuration. The message names the key and what is wrong."""


class ProtocolError(TidegateError):
    """A message on the wire does not follow the envelope format."""


class BrokerError(TidegateError):
    """NATS / JetStream is unreachable or refused an operation."""


class ApiError(TidegateError):
    """An error the client sees, with HTTP status and OpenAI error fields.

    ``type`` follows OpenAI's values: ``invalid_request_error``,
    ``authentication_error``, ``permission_error``, ``not_found_error``,
    ``rate_limit_error``, ``server_error``, ``service_unavailable``.
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str,
        code: str | None = None,
        param: str | None = None,
        retryable: bool = False,
        retry_after: float = 0.0,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.retryable = retryable
        self.retry_after = retry_after

    def payload(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def to_json(self) -> bytes:
        return json.dumps(self.payload()).encode()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.status}, {self.message!r}, code={self.code!r})"


class BackendError(ApiError):
    """The model backend refused, failed or could not be reached."""


def invalid_request(message: str, *, param: str | None = None,
                    code: str | None = "invalid_request") -> ApiError:
    return ApiError(400, message, type="invalid_request_error", code=code, param=param)


def no_such(kind: str, object_id: str) -> ApiError:
    """404 for a file or batch id its caller does not own (another tenant's
    reads as missing, never 403)."""
    return ApiError(404, f"No such {kind} object: {object_id}", type="invalid_request_error",
                    code="not_found", param="id")


def unavailable(message: str, *, code: str = "service_unavailable",
                retry_after: float = 1.0) -> ApiError:
    return ApiError(503, message, type="service_unavailable", code=code, retryable=True,
                    retry_after=retry_after)


@dataclass(frozen=True, slots=True)
class Code:
    """One error code as a client sees it. Empty fields do not apply to its group
    (a batch line's code has no status, a close code no type)."""

    code: str
    status: str  # the HTTP status, "413 / 400" where it depends on the route
    type: str  # OpenAI's error type
    retry: str  # "no", "yes", "yes (1 s)": whether, and after how long, a retry can help
    meaning: str  # Markdown; links are relative to docs/


# Every code, grouped as docs/errors.md explains them. tests/test_docs.py
# fails when the product raises a code this does not list.
CATALOGUE: tuple[tuple[str, tuple[Code, ...]], ...] = (
    ("The request", (
        Code("invalid_json", "400", "invalid_request_error", "no",
             "the body is not JSON, not an object, nests deeper than `edge.max_json_depth`, or "
             "repeats a top-level key"),
        Code("missing_required_parameter", "400", "invalid_request_error", "no",
             "a required field (`model`, `messages`, `prompt`, `input`, ...) is missing; `param` "
             "names it"),
        Code("invalid_type", "400", "invalid_request_error", "no",
             "a field has the wrong JSON type; `param` names it"),
        Code("invalid_value", "400", "invalid_request_error", "no",
             "a field's value is out of range (for example `max_tokens` above the model's "
             "`max_output_tokens`, a `stop` string over 1,000 characters, embeddings whose inputs "
             "x `dimensions` would make a response over `edge.max_response_bytes`), or a number "
             "outside 64-bit"),
        Code("unsupported_value", "400", "invalid_request_error", "no",
             "a value tidegate does not serve: `n` > 1, `best_of` > 1, streamed embeddings"),
        Code("empty_array", "400", "invalid_request_error", "no",
             "`messages` is empty"),
        Code("invalid_body", "400", "invalid_request_error", "no",
             "the body cannot be read (a multipart upload cut short, a part header with a control "
             "character, a malformed body)"),
        Code("invalid_header", "400", "invalid_request_error", "no",
             "`X-Tidegate-Resumable` or `X-Tidegate-Resume-Grace` has a bad value "
             "([resume](resume.md))"),
        Code("duplicate_header", "400", "invalid_request_error", "no",
             "`Authorization` (or, on the Messages API, `x-api-key`) came more than once: two keys"
             " never mean whichever one a layer reads first; `param` names the header"),
        Code("invalid_idempotency_key", "400", "invalid_request_error", "no",
             "`Idempotency-Key` is empty, longer than 255 characters or not printable ASCII "
             "([resume](resume.md#sending-a-request-again-idempotency-key))"),
        Code("invalid_request", "400", "invalid_request_error", "no",
             "other invalid input (a bad upload form, a bad batch argument); also a backend's own "
             "400/404/413/422, with its message"),
        Code("unprocessable_request", "400", "invalid_request_error", "no",
             "a dispatcher or worker could not handle a field's type or value and dropped the "
             "request"),
        Code("invalid_http", "400", "invalid_request_error", "no",
             "malformed HTTP: request line, header size or count past `edge.max_*`"),
        Code("request_too_large", "413", "invalid_request_error", "no",
             "the body is larger than `edge.max_body_bytes` or the broker's message size limit"),
        Code("request_timeout", "408", "invalid_request_error", "no",
             "headers or body did not arrive within `edge.header_timeout` / `edge.body_timeout`"),
        Code("model_not_found", "404", "invalid_request_error", "no",
             "the model is neither a configured name nor an alias, or the key may not use it (the "
             "same answer, so a restricted key learns no other model's name)"),
        Code("not_found", "404", "not_found_error / invalid_request_error", "no",
             "an unknown URL; a file or batch id that does not exist or belongs to another tenant"),
        Code("method_not_allowed", "405", "invalid_request_error", "no",
             "the URL exists, the method does not"),
        Code("upgrade_required", "426", "invalid_request_error", "no",
             "`GET /v1/ws` without a WebSocket upgrade"),
        Code("endpoint_not_supported", "501", "invalid_request_error", "no",
             "the model's backend does not serve `/v1/responses` or `/v1/embeddings` "
             "([backends](backends.md))"),
    )),
    ("Keys and quotas", (
        Code("missing_api_key", "401", "authentication_error", "no",
             "no `Authorization: Bearer` key (on a WebSocket: a frame before the `auth` frame)"),
        Code("invalid_authorization_header", "401", "authentication_error", "no",
             "the `Authorization` header is not `Bearer KEY`"),
        Code("invalid_api_key", "401", "authentication_error", "no",
             "unknown key ([keys and policies](keys-and-policies.md))"),
        Code("revoked_api_key", "401", "authentication_error", "no",
             "the key was revoked (also a batch line whose creating key was revoked since)"),
        Code("expired_api_key", "401", "authentication_error", "no",
             "the key's expiry passed"),
        Code("model_not_allowed", "403", "permission_error", "no",
             "a batch line's key is restricted to other models ([batch](batch.md#per-key-rules)); "
             "an interactive request naming a model its key may not use gets `model_not_found` "
             "instead, the answer for a model that does not exist"),
        Code("rate_limit_requests", "429", "rate_limit_error", "yes, after `Retry-After`",
             "a requests-per-minute policy is used up ([quotas](quotas.md))"),
        Code("rate_limit_tokens", "429", "rate_limit_error", "yes, after `Retry-After`",
             "a tokens-per-minute policy is used up"),
        Code("rate_limit_concurrency", "429", "rate_limit_error", "yes, after `Retry-After`",
             "a concurrent-streams policy is used up"),
        Code("request_too_large_for_limit", "429", "rate_limit_error", "no",
             "the request alone reserves more tokens than a tokens-per-minute limit: lower "
             "`max_tokens`"),
        Code("budget_exceeded", "429", "insufficient_quota",
             "yes, after `Retry-After` (the budget's reset); no when the request alone is "
             "too costly",
             "a budget in money is used up for its period, or the request alone may cost more than"
             " the whole budget ([spend](spend.md))"),
        Code("quota_store_unavailable", "503", "service_unavailable", "yes (2 s)",
             "Redis is down and `dispatcher.quota_failure` is `closed`"),
        Code("queue_full", "503", "service_unavailable", "yes (5 s)",
             "the model is in [queue mode](queue-mode.md) and its queue is full"),
        Code("queue_timeout", "503", "service_unavailable", "yes (5 s)",
             "the request waited longer than the queue's `ttl`"),
    )),
    ("Capacity and availability", (
        Code("too_many_connections", "503", "service_unavailable", "yes (1 s)",
             "the edge's or this client address's connection cap is reached"),
        Code("overloaded", "503", "service_unavailable", "yes (2 s)",
             "`TG_REQUESTS` is full: load shedding at the front door"),
        Code("broker_unavailable", "503", "service_unavailable / server_error", "yes (2 s)",
             "NATS is unreachable (also the stream log, for resume and background reads)"),
        Code("broker_error", "503", "service_unavailable", "yes",
             "NATS refused the publish"),
        Code("owner_store_unavailable", "503", "service_unavailable", "yes",
             "the worker could not read who owns the `previous_response_id` it was given"),
        Code("dispatcher_unavailable", "503", "service_unavailable", "yes (5 s)",
             "no dispatcher answered within `edge.admission_timeout`"),
        Code("no_worker_available", "503", "service_unavailable / server_error", "yes (5 s)",
             "no worker started the job within `edge.queue_timeout`"),
        Code("edge_draining", "503", "service_unavailable", "yes",
             "this edge is shutting down; retry on another"),
        Code("internal_error", "500", "server_error", "no",
             "a bug in the edge (logged with a traceback there)"),
    )),
    ("During a stream", (
        Code("edge_shutting_down", "503", "server_error", "yes",
             "the edge stopped before this stream finished"),
        Code("edge_reconnect", "503", "server_error", "resume",
             "a resumable stream's edge is draining: the SSE stream ends with `event: reconnect` "
             "and a `resume_url` instead of an error ([resume](resume.md))"),
        Code("worker_shutdown", "503", "server_error", "yes (1 s)",
             "the worker stopped before this stream finished"),
        Code("ack_timeout", "503", "server_error", "yes (1 s)",
             "the worker heard no acknowledgement from the edge for `session.ack_timeout` and "
             "cancelled"),
        Code("worker_lost", "502", "server_error", "yes (1 s)",
             "the worker went silent or died mid-stream"),
        Code("request_body_lost", "502", "server_error", "yes (1 s)",
             "a body too large for a broker message was stored, and was gone when its "
             "request was read (its `streams.max_age` passed)"),
        Code("stream_gap", "502", "server_error", "yes (1 s)",
             "part of the stream was lost and its worker could not send it again"),
        Code("protocol_error", "502", "server_error", "yes",
             "a malformed message reached the edge for this stream"),
        Code("response_too_large", "502", "server_error", "no",
             "a non-streaming response exceeded `edge.max_response_bytes`: use `stream=true`"),
        Code("request_timeout", "504", "server_error", "no",
             "the response exceeded `edge.request_timeout`"),
        Code("idempotency_key_in_use", "409", "invalid_request_error", "no",
             "a request that is not resumable was sent again under the same `Idempotency-Key` "
             "within `streams.duplicate_window` (120 s): it runs once, its answer went to the "
             "first connection ([resume](resume.md#sending-a-request-again-idempotency-key))"),
        Code("stream_cancelled", "409", "invalid_request_error", "no",
             "cancelled through `POST /v1/streams/{id}/cancel`"),
        Code("stream_abandoned", "409", "invalid_request_error", "no",
             "a resumable stream's readers left and none came back within the grace"),
        Code("resume_log_full", "502", "server_error", "no",
             "the stream outgrew `resume.max_stream_bytes`; it cannot be resumed past this point"),
        Code("stream_not_found", "404", "not_found_error", "no",
             "`GET /v1/streams/{id}` or its `/cancel`: unknown, expired, not resumable, or another"
             " tenant's"),
        Code("response_not_found", "404", "invalid_request_error", "no",
             "`GET /v1/responses/{id}`: unknown, expired, not a background response, or another "
             "tenant's"),
        Code("previous_response_not_found", "404", "invalid_request_error", "no",
             "`previous_response_id` names a response never given to this tenant, or one older "
             "than `streams.responses_max_age`"),
    )),
    ("The model backend", (
        Code("invalid_request", "400", "invalid_request_error", "no",
             "the backend refused the request (its 400, 404, 413 or 422), with its message"),
        Code("backend_auth_failed", "502", "server_error", "no",
             "the backend refused the gateway's credentials (its 401 or 403): check `api_key_env`"),
        Code("backend_rate_limited", "429", "rate_limit_error",
             "yes (its `Retry-After`, else 1 s)",
             "the backend answered 429"),
        Code("backend_error", "502", "server_error", "only after its 503",
             "the backend failed (another status, or a broken response)"),
        Code("backend_unavailable", "502", "server_error", "yes (1 s)",
             "the backend is unreachable"),
        Code("backend_overloaded", "503", "server_error", "yes",
             "the backend answered 529, or 503 to a Messages request (a Messages client sees 529 "
             "`overloaded_error`, [anthropic](anthropic.md))"),
        Code("backend_timeout", "504", "server_error", "no",
             "the backend did not answer within the model's timeouts"),
    )),
    ("Files and batches", (
        Code("file_too_large", "413 / 400", "invalid_request_error", "no",
             "an upload larger than `batch.max_file_bytes`, or a batch's input file larger than "
             "its limit"),
        Code("storage_quota_exceeded", "413", "invalid_request_error", "no, delete files first",
             "the upload would take the tenant's stored files past `batch.tenant_storage_bytes`"),
        Code("batch_not_cancellable", "409", "invalid_request_error", "no",
             "cancelling a batch that is finalizing or has ended (a Message Batch: one that "
             "has ended)"),
        Code("batch_not_ended", "400", "invalid_request_error", "once it has ended",
             "the results of a Message Batch asked for before it ended "
             "([batch](batch.md#anthropic-message-batches))"),
        Code("results_expired", "404", "not_found_error", "no",
             "a Message Batch's results after `batch.file_ttl` from its creation, or after its "
             "files were deleted"),
    )),
    ("Batch files and lines", (
        Code("invalid_json_line", "", "", "",
             "a line is not valid JSON"),
        Code("invalid_request", "", "", "",
             "a line is not an object, its `body` is not an object, or it cannot be built into a "
             "request"),
        Code("missing_required_parameter", "", "", "",
             "a line has no `custom_id`"),
        Code("invalid_method", "", "", "",
             "`method` is not `POST`"),
        Code("invalid_url", "", "", "",
             "`url` is not the batch's endpoint"),
        Code("duplicate_custom_id", "", "", "",
             "a `custom_id` appears twice"),
        Code("too_many_requests", "", "", "",
             "more lines than `batch.max_lines`"),
        Code("line_too_long", "", "", "",
             "a line longer than `batch.max_line_bytes`"),
        Code("empty_file", "", "", "",
             "the file has no requests"),
        Code("batch_expired", "", "", "",
             "a line that got no answer: the batch's completion window ended first"),
        Code("failed", "", "", "",
             "a line that got no answer after `batch.max_retries` tries that carried no "
             "error code"),
        Code("rejected", "", "", "",
             "a line refused by a dispatcher with no error of its own"),
    )),
    ("WebSocket frames", (
        Code("invalid_json", "", "", "",
             "the frame is not a JSON object (or nests too deep, or repeats a key)"),
        Code("binary_frame", "", "", "",
             "a binary frame"),
        Code("invalid_frame", "", "", "",
             "no string `type`, or a frame missing a field it needs"),
        Code("unknown_type", "", "", "",
             "a `type` the protocol does not have"),
        Code("invalid_id", "", "", "",
             "no usable `id`"),
        Code("duplicate_id", "", "", "",
             "the `id` is in use by a running generation on this socket"),
        Code("unknown_id", "", "", "",
             "`cancel` of an id that is not running"),
        Code("unknown_path", "", "", "",
             "`path` is not `/v1/chat/completions` or `/v1/completions`"),
        Code("invalid_body", "", "", "",
             "`body` is not an object"),
        Code("already_authenticated", "", "", "",
             "a second `auth` frame"),
        Code("too_many_concurrent", "", "", "",
             "`ws.max_concurrent` generations already run on this socket (429, retryable)"),
        Code("not_a_stream", "", "", "",
             "`resume` of a non-streaming request (read it with `GET /v1/streams/{id}`)"),
        Code("auth_timeout", "", "", "",
             "no `auth` frame within `ws.auth_timeout` (then close 4408)"),
    )),
    ("WebSocket close codes", (
        Code("1009", "", "", "",
             "a frame larger than `ws.max_message_bytes`"),
        Code("1011", "", "", "",
             "pings went unanswered (`ws.max_missed_pongs`), or an internal error"),
        Code("1012", "", "", "",
             "the edge is draining: reconnect, the load balancer sends you to another edge"),
        Code("4401", "", "", "",
             "missing, bad, revoked or expired key (the reason names the code)"),
        Code("4408", "", "", "",
             "no `auth` frame within `ws.auth_timeout`"),
    )),
    ("gRPC", (
        Code("deadline_exceeded", "504 (DEADLINE_EXCEEDED)", "", "yes, with a longer deadline",
             "the call's deadline passed before the generation ended"),
        Code("slow_client", "503 (UNAVAILABLE)", "", "yes",
             "the client did not read for `edge.slow_client_timeout`"),
        Code("duplicate_metadata", "400 (INVALID_ARGUMENT)", "", "no",
             "a metadata key that may appear once (`authorization`, ...) came twice"),
        Code("model_mismatch", "400 (INVALID_ARGUMENT)", "", "no",
             "the typed `model` and the body's `model` differ"),
        Code("unknown_route", "400 (INVALID_ARGUMENT)", "", "no",
             "`route` is none of the served routes"),
        Code("unsupported_parameter", "400 (INVALID_ARGUMENT)", "", "no",
             "a background Responses request (served over HTTP only)"),
        Code("invalid_message", "400 (INVALID_ARGUMENT)", "", "no",
             "a request message protobuf cannot parse (after the key check: without a key it is "
             "`UNAUTHENTICATED`), or a `Session` message that sets none of generate, cancel, "
             "resume"),
    )),
    ("Operator console", (
        Code("body_too_large", "413", "", "",
             "a change's body over the console's 16 KiB"),
        Code("unsupported_media", "415", "", "",
             "a change not sent as `application/json`"),
        Code("invalid_window", "400", "", "",
             "a usage window other than hour, day, month"),
        Code("missing_field", "400", "", "",
             "a change without a field it needs"),
        Code("unknown_field", "400", "", "",
             "a change with a field the action does not take"),
    )),
)
