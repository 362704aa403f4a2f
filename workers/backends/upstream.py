"""What an OpenAI-compatible backend's failures become for the client: a
:class:`tidegate.errors.BackendError`, raised before the first byte where it can be::

    upstream                  HTTP  type / code               retryable
    400, 404, 413, 422        400   invalid_request_error     no
    401, 403                  502   backend_auth_failed       no
    429                       429   rate_limit_error          yes
    503 / other non-2xx       502   backend_error             yes / no
    no such route (*)         501   endpoint_not_supported    no
    connect failure           502   backend_unavailable       yes
    no headers / silence      504   backend_timeout           no

(*) Responses and embeddings only: a 405, 501, or a 404 not about the model
(:func:`is_missing_endpoint`). Docs: docs/backends.md.
"""

from __future__ import annotations

import json
from typing import Any

from tidegate.errors import BackendError

MESSAGE_LIMIT = 1000  # characters of an upstream message quoted to the client


def upstream_message(raw: bytes) -> str:
    """The message of an OpenAI-style (or FastAPI/TGI-style, or plain text) error body."""
    text = raw.decode("utf-8", "replace").strip()
    try:
        obj = json.loads(text)
    except ValueError:
        obj = None
    if isinstance(obj, dict):
        err = obj.get("error")
        if isinstance(err, dict) and err.get("message"):
            text = str(err["message"])
        elif isinstance(err, str) and err:
            text = err
        elif obj.get("detail"):
            text = str(obj["detail"])
        elif obj.get("message"):
            text = str(obj["message"])
    text = " ".join(text.split())
    if len(text) > MESSAGE_LIMIT:
        text = text[:MESSAGE_LIMIT] + "..."
    return text or "(empty response body)"


def status_error(status: int, message: str, *, model: str,
                 retry_after: float = 0.0) -> BackendError:
    """Map an upstream HTTP error status to the error the client sees."""
    if status in (400, 404, 413, 422):
        return BackendError(400, f"The model backend rejected the request (HTTP {status}): "
                            f"{message}", type="invalid_request_error", code="invalid_request")
    if status in (401, 403):
        return BackendError(502, f"The model backend for {model!r} refused the gateway's "
                            f"credentials (HTTP {status}): {message}", type="server_error",
                            code="backend_auth_failed")
    if status == 429:
        return BackendError(429, f"The model backend for {model!r} is rate limiting "
                            f"(HTTP 429): {message}", type="rate_limit_error",
                            code="backend_rate_limited", retryable=True,
                            retry_after=retry_after or 1.0)
    return BackendError(502, f"The model backend for {model!r} failed (HTTP {status}): "
                        f"{message}", type="server_error", code="backend_error",
                        retryable=status == 503, retry_after=retry_after)


def is_missing_endpoint(status: int, message: str) -> bool:
    """Whether an error status means "no such route" rather than a refusal of
    this request. 405 and 501 always do; a 404 does unless its message is about
    the model (vLLM and OpenAI answer an unknown model with 404 too). Route
    404s look like FastAPI's ``Not Found``, llama-server's ``File Not Found``,
    Ollama's ``404 page not found``."""
    if status in (405, 501):
        return True
    return status == 404 and "model" not in message.lower()


def endpoint_missing(model: str, path: str, status: int, message: str) -> BackendError:
    """The model's backend does not serve ``path``: 501, naming the backend."""
    return BackendError(501, f"The model backend for {model!r} does not serve {path} (it "
                        f"answered HTTP {status}: {message}). Use an endpoint it serves, such "
                        f"as /v1/chat/completions, or a backend that implements {path}.",
                        type="invalid_request_error", code="endpoint_not_supported")


def unavailable(model: str, exc: BaseException) -> BackendError:
    return BackendError(502, f"The model backend for {model!r} is unreachable: "
                        f"{str(exc) or type(exc).__name__}", type="server_error",
                        code="backend_unavailable", retryable=True, retry_after=1.0)


def timeout(model: str, what: str, seconds: float) -> BackendError:
    return BackendError(504, f"The model backend for {model!r} {what} within {seconds:g} s",
                        type="server_error", code="backend_timeout")


def broken(model: str, what: str) -> BackendError:
    return BackendError(502, f"The model backend for {model!r} {what}", type="server_error",
                        code="backend_error")


def retry_after(headers: Any) -> float:
    """Seconds from a Retry-After header (``headers``: lower-case names)."""
    try:
        return max(0.0, float(headers.get("retry-after", "")))
    except ValueError:
        return 0.0
