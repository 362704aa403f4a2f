"""The one place where errors become HTTP responses or SSE error events.

Every client-visible failure is an OpenAI error object
``{"error": {"message", "type", "param", "code"}}``; on Anthropic's Messages API
the same errors take Anthropic's shape (``tidegate.wire.anthropic``; 503 as 529
``overloaded_error``). Before the first byte of a response it is a real HTTP
status (with ``Retry-After`` when retrying helps); afterwards a final SSE error
event, and the stream ends without ``data: [DONE]``. Docs: docs/errors.md.
"""

from __future__ import annotations

import json
import math

from aiohttp import web

from tidegate import apis
from tidegate.apis.chat import DIALECT as CHAT
from tidegate.errors import ApiError
from tidegate.wire import anthropic
from tidegate.wire.protocol import Api, ErrorInfo

_STATUS_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
}


def from_info(info: ErrorInfo) -> ApiError:
    return ApiError(info.status, info.message, type=info.type, code=info.code or None,
                    retryable=info.retryable, retry_after=info.retry_after)


def to_info(error: ApiError) -> ErrorInfo:
    return ErrorInfo(error.status, error.type, error.code or "", error.message, error.retryable,
                     error.retry_after)


def error_response(error: ApiError, api: Api = CHAT.api) -> web.Response:
    headers = {}
    if error.retry_after > 0:
        headers["Retry-After"] = str(max(1, math.ceil(error.retry_after)))
    status, body = error.status, error.to_json()
    if apis.of(api).anthropic:
        status, body = anthropic.error_body(status, error.message)
        if status == anthropic.OVERLOADED and "Retry-After" not in headers:
            headers["Retry-After"] = "1"
    return web.Response(status=status, body=body, content_type="application/json",
                        headers=headers)


def sse_error_event(error: ApiError, api: Api = CHAT.api) -> bytes:
    if apis.of(api).anthropic:
        return anthropic.error_event(error.status, error.message)
    payload = error.payload()
    if error.retryable:
        payload["error"]["retryable"] = True
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def from_http_exception(exc: web.HTTPException) -> ApiError:
    status = exc.status
    error_type = _STATUS_TYPES.get(status, "server_error" if status >= 500 else
                                   "invalid_request_error")
    code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(status)
    message = exc.text if exc.text and not exc.text.startswith(str(status)) else exc.reason
    if status == 404:
        message = ("Unknown URL. tidegate serves /v1/chat/completions, /v1/completions, "
                   "/v1/responses, /v1/embeddings, /v1/messages and /v1/models.")
    return ApiError(status, message, type=error_type, code=code)
