"""Errors to HTTP responses and SSE events (edge.errors)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from aiohttp import web

from edge.errors import (
    error_response,
    from_http_exception,
    from_info,
    sse_error_event,
    to_info,
)
from tidegate.errors import ApiError, BackendError, invalid_request, unavailable
from tidegate.wire.protocol import ErrorInfo


def body_of(response: web.Response) -> dict[str, Any]:
    assert isinstance(response.body, bytes)
    parsed: dict[str, Any] = json.loads(response.body)
    return parsed


# --------------------------------------------------------------------------
# error_response
# --------------------------------------------------------------------------


def test_error_response_status_and_body() -> None:
    error = invalid_request("bad temperature", param="temperature", code="invalid_value")
    response = error_response(error)
    assert response.status == 400
    assert response.content_type == "application/json"
    assert body_of(response) == {
        "error": {
            "message": "bad temperature",
            "type": "invalid_request_error",
            "param": "temperature",
            "code": "invalid_value",
        }
    }
    assert "Retry-After" not in response.headers


def test_error_response_null_fields() -> None:
    response = error_response(ApiError(500, "oops", type="server_error"))
    assert response.status == 500
    assert body_of(response)["error"] == {"message": "oops", "type": "server_error",
                                          "param": None, "code": None}


@pytest.mark.parametrize(("retry_after", "header"), [
    (0.01, "1"), (0.5, "1"), (1.0, "1"), (1.2, "2"), (2, "2"), (2.5, "3"), (30.0, "30"),
])
def test_retry_after_header_rounds_up_to_whole_seconds(retry_after: float, header: str
                                                       ) -> None:
    response = error_response(unavailable("busy", retry_after=retry_after))
    assert response.status == 503
    assert response.headers["Retry-After"] == header


@pytest.mark.parametrize("retry_after", [0.0, -1.0])
def test_no_retry_after_header_when_not_positive(retry_after: float) -> None:
    error = ApiError(503, "x", type="service_unavailable", retryable=True,
                     retry_after=retry_after)
    assert "Retry-After" not in error_response(error).headers


def test_unavailable_body() -> None:
    response = error_response(unavailable("The queue is full.", code="overloaded",
                                          retry_after=2))
    assert body_of(response) == {"error": {"message": "The queue is full.",
                                           "type": "service_unavailable", "param": None,
                                           "code": "overloaded"}}
    assert response.headers["Retry-After"] == "2"


def test_error_response_body_is_valid_json_with_unicode_and_quotes() -> None:
    message = 'model "ünï" <script>\n'
    response = error_response(ApiError(404, message, type="not_found_error"))
    assert body_of(response)["error"]["message"] == message


# --------------------------------------------------------------------------
# sse_error_event
# --------------------------------------------------------------------------


def parse_event(event: bytes) -> dict[str, Any]:
    assert event.startswith(b"data: ")
    assert event.endswith(b"\n\n")
    line = event[len(b"data: "):-2]
    assert b"\n" not in line  # exactly one SSE event, one data line
    parsed: dict[str, Any] = json.loads(line)
    return parsed


def test_sse_error_event_format() -> None:
    error = ApiError(502, "backend failed", type="server_error", code="backend_error")
    event = sse_error_event(error)
    assert parse_event(event) == {"error": {"message": "backend failed", "type": "server_error",
                                            "param": None, "code": "backend_error"}}
    assert b"[DONE]" not in event


def test_sse_error_event_marks_retryable() -> None:
    event = sse_error_event(unavailable("worker lost", code="worker_lost"))
    payload = parse_event(event)
    assert payload["error"]["retryable"] is True
    assert payload["error"]["code"] == "worker_lost"


def test_sse_error_event_multiline_message_stays_one_event() -> None:
    event = sse_error_event(ApiError(500, "line one\nline two\r\n", type="server_error"))
    assert parse_event(event)["error"]["message"] == "line one\nline two\r\n"


def test_sse_error_event_does_not_mutate_the_error() -> None:
    error = unavailable("x")
    sse_error_event(error)
    assert "retryable" not in error.payload()["error"]


# --------------------------------------------------------------------------
# ErrorInfo <-> ApiError
# --------------------------------------------------------------------------


def test_to_info_and_back() -> None:
    error = ApiError(429, "slow down", type="rate_limit_error", code="rate_limited",
                     retryable=True, retry_after=3.5)
    info = to_info(error)
    assert info == ErrorInfo(429, "rate_limit_error", "rate_limited", "slow down", True, 3.5)
    back = from_info(info)
    assert (back.status, back.message, back.type, back.code, back.retryable,
            back.retry_after) == (429, "slow down", "rate_limit_error", "rate_limited", True, 3.5)


def test_empty_code_maps_to_none() -> None:
    assert to_info(ApiError(500, "x", type="server_error")).code == ""
    assert from_info(ErrorInfo(500, "server_error", "", "x")).code is None


def test_backend_error_converts_like_api_error() -> None:
    info = to_info(BackendError(502, "upstream 500", type="server_error", code="backend_error"))
    assert info == ErrorInfo(502, "server_error", "backend_error", "upstream 500", False, 0.0)


# --------------------------------------------------------------------------
# from_http_exception
# --------------------------------------------------------------------------


def test_not_found() -> None:
    error = from_http_exception(web.HTTPNotFound())
    assert error.status == 404
    assert error.type == "not_found_error"
    assert error.code == "not_found"
    assert "/v1/chat/completions" in error.message
    assert "/v1/models" in error.message


def test_method_not_allowed() -> None:
    error = from_http_exception(web.HTTPMethodNotAllowed("PUT", ["POST"]))
    assert error.status == 405
    assert error.type == "invalid_request_error"
    assert error.code == "method_not_allowed"
    assert error.message == "Method Not Allowed"


def test_request_too_large_keeps_aiohttp_text() -> None:
    error = from_http_exception(web.HTTPRequestEntityTooLarge(max_size=1024, actual_size=4096))
    assert error.status == 413
    assert error.type == "invalid_request_error"
    assert error.code == "request_too_large"
    assert "1024" in error.message


def test_custom_text_is_used() -> None:
    error = from_http_exception(web.HTTPBadRequest(text="Content-Length is invalid"))
    assert error.status == 400
    assert error.type == "invalid_request_error"
    assert error.code is None
    assert error.message == "Content-Length is invalid"


@pytest.mark.parametrize(("exc", "status", "error_type"), [
    (web.HTTPUnauthorized(), 401, "authentication_error"),
    (web.HTTPForbidden(), 403, "permission_error"),
    (web.HTTPUnsupportedMediaType(), 415, "invalid_request_error"),
    (web.HTTPTooManyRequests(), 429, "rate_limit_error"),
    (web.HTTPConflict(), 409, "invalid_request_error"),
    (web.HTTPInternalServerError(), 500, "server_error"),
    (web.HTTPBadGateway(), 502, "server_error"),
])
def test_status_types(exc: web.HTTPException, status: int, error_type: str) -> None:
    error = from_http_exception(exc)
    assert error.status == status
    assert error.type == error_type
    assert error.code is None
    # The default "<status>: <reason>" text is replaced by the bare reason.
    assert error.message == exc.reason


def test_http_exception_response_round_trip() -> None:
    response = error_response(from_http_exception(web.HTTPNotFound()))
    assert response.status == 404
    assert body_of(response)["error"]["code"] == "not_found"
