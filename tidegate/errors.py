"""The tidegate exception hierarchy.

Root: :class:`TidegateError`. Every error tidegate raises on purpose derives
from it, so a boundary can catch ``TidegateError`` and know it is not a bug.

* :class:`ConfigError` - the configuration is invalid; raised at start, with
  the offending key in the message.
* :class:`ApiError` - a client-facing error with its HTTP status and the
  OpenAI error fields. The edge turns it into JSON in exactly one place
  (``edge.errors``); workers and dispatchers send it across the broker as a
  :class:`tidegate.wire.protocol.ErrorInfo`.
* :class:`BackendError` - the model backend failed (an :class:`ApiError`, since
  it reaches the client).
* :class:`ProtocolError` - a malformed envelope on the wire.
* :class:`BrokerError` - NATS or JetStream refused or is unreachable.
"""

from __future__ import annotations

import json
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


def unavailable(message: str, *, code: str = "service_unavailable",
                retry_after: float = 1.0) -> ApiError:
    return ApiError(503, message, type="service_unavailable", code=code, retryable=True,
                    retry_after=retry_after)
