"""The gateway's exception hierarchy and the error objects it answers with: OpenAI's, and
Anthropic's on the Messages API (:func:`anthropic_error`).

Three families, grouped by who should react:

* :class:`ClientError` — the request is wrong; the caller fixes it (4xx, nothing sent upstream).
* :class:`ServiceUnavailable` — the gateway cannot serve it now (503); the caller retries later.
* :class:`UpstreamError` — the chosen worker failed (502/504); routing already retried what
  could be retried.

Every error carries a stable ``code`` (clients and dashboards key on it) and a message written
for the caller; internal details (exception text, worker URLs) never go into it.
"""

from __future__ import annotations

import json
from enum import StrEnum
from typing import Any

__all__ = [
    "ClientError",
    "ConfigError",
    "ErrorCode",
    "GatewayError",
    "ServiceUnavailable",
    "UpstreamError",
    "anthropic_error",
    "anthropic_error_event",
    "error_body",
    "relayed_error",
]


class ErrorCode(StrEnum):
    """Stable error codes of the ``error.code`` field."""

    INVALID_JSON = "invalid_json"
    REQUEST_TIMEOUT = "request_timeout"
    OVERLOADED = "overloaded"
    RATE_LIMITED = "rate_limited"
    QUEUE_FULL = "queue_full"
    QUEUE_TIMEOUT = "queue_timeout"
    INVALID_REQUEST = "invalid_request"
    MODEL_NOT_FOUND = "model_not_found"
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    REQUEST_TOO_LARGE = "request_too_large"
    HEADERS_TOO_LARGE = "headers_too_large"
    UNSUPPORTED_MEDIA_TYPE = "unsupported_media_type"
    NOT_FOUND = "not_found"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    UNAUTHORIZED = "unauthorized"
    ADMIN_DISABLED = "admin_disabled"
    WORKER_NOT_FOUND = "worker_not_found"
    NO_AVAILABLE_WORKER = "no_available_worker"
    REGISTRY_UNAVAILABLE = "registry_unavailable"
    UPSTREAM_ERROR = "upstream_error"
    UPSTREAM_TIMEOUT = "upstream_timeout"
    UPSTREAM_STREAM_ERROR = "upstream_stream_error"
    UPSTREAM_BAD_ANSWER = "upstream_bad_answer"
    UPSTREAM_TOO_LARGE = "upstream_too_large"
    PREFILL_SERVER_ERROR = "prefill_server_error"
    DECODE_SERVER_ERROR = "decode_server_error"
    SHUTTING_DOWN = "shutting_down"
    INTERNAL_ERROR = "internal_error"


_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    431: "invalid_request_error",
    429: "rate_limit_error",
}
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
"""Anthropic's error type per HTTP status (docs.claude.com/en/api/errors); another 4xx is
``invalid_request_error``, another 5xx ``api_error``."""
_MAX_RELAYED_MESSAGE = 1000  # characters of an engine's message passed on to the client


class GatewayError(Exception):
    """Base of every error the gateway raises on purpose."""

    status: int = 500
    code: ErrorCode = ErrorCode.INTERNAL_ERROR

    def __init__(
        self,
        message: str,
        *,
        code: ErrorCode | None = None,
        status: int | None = None,
        param: str | None = None,
        retry_after_s: float | None = None,
        close_connection: bool = False,
    ) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        if status is not None:
            self.status = status
        self.param = param
        self.retry_after_s = retry_after_s
        self.close_connection = close_connection

    def body(self) -> bytes:
        return error_body(self.status, self.message, self.code, self.param)

    def headers(self) -> list[tuple[bytes, bytes]]:
        """``Retry-After`` (whole seconds, at least 1) when the caller should come back;
        ``Connection: close`` when the connection cannot be reused."""
        headers = [(b"connection", b"close")] if self.close_connection else []
        if self.retry_after_s is not None:
            headers.append((b"retry-after", str(max(1, round(self.retry_after_s))).encode()))
        return headers

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.status}, {self.code.value}, {self.message!r})"


class ClientError(GatewayError):
    """The request is invalid; the caller must change it. Never reaches a worker."""

    status = 400
    code = ErrorCode.INVALID_REQUEST


class ServiceUnavailable(GatewayError):
    """No worker can take the request right now (none live, all tripped, shutting down)."""

    status = 503
    code = ErrorCode.NO_AVAILABLE_WORKER


class UpstreamError(GatewayError):
    """The worker failed or timed out before answering; retries were exhausted."""

    status = 502
    code = ErrorCode.UPSTREAM_ERROR


class ConfigError(GatewayError, ValueError):
    """The configuration is invalid; raised at start-up with the offending key in the message."""


def error_body(status: int, message: str, code: ErrorCode, param: str | None = None) -> bytes:
    """An OpenAI-style error object: ``{"error": {message, type, param, code}}``."""
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return json.dumps(
        {"error": {"message": message, "type": kind, "param": param, "code": code.value}}
    ).encode()


def _engine_error(data: bytes) -> tuple[str | None, str | None]:
    """(message, param) of an engine's error body: vLLM ``{"error": {...}}``, SGLang
    ``{"object": "error", "message": ...}``, FastAPI ``{"detail": ...}``."""
    try:
        obj: Any = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return None, None
    if isinstance(obj, dict) and isinstance(obj.get("error"), dict):
        obj = obj["error"]
    if not isinstance(obj, dict):
        return None, None
    message = obj.get("message", obj.get("detail"))
    param = obj.get("param")
    return (message if isinstance(message, str) else None,
            param if isinstance(param, str) else None)


def relayed_error(status: int, data: bytes) -> tuple[int, bytes]:
    """A worker's error answer as the gateway's OpenAI error object: (status, body).

    A 4xx is the client's request refused by the engine: its status and message are kept
    (``context_length_exceeded`` when the engine says so). Anything else is the worker's
    failure: 502 ``upstream_error``, without the engine's text (it may hold internals)."""
    message, param = _engine_error(data)
    if not 400 <= status < 500:
        return 502, error_body(502, "the worker failed to answer", ErrorCode.UPSTREAM_ERROR)
    text = (message or f"the worker refused the request (HTTP {status})")
    code = {404: ErrorCode.MODEL_NOT_FOUND, 413: ErrorCode.REQUEST_TOO_LARGE,
            429: ErrorCode.RATE_LIMITED}.get(status, ErrorCode.INVALID_REQUEST)
    if "context length" in text.lower() or "context_length" in text.lower():
        code = ErrorCode.CONTEXT_LENGTH_EXCEEDED
    return status, error_body(status, text[:_MAX_RELAYED_MESSAGE], code, param)


def _anthropic_type(status: int) -> str:
    return _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def anthropic_error(status: int, body: bytes) -> bytes:
    """An error answer of ``status`` as an Anthropic error object:
    ``{"type": "error", "error": {"type", "message"}}``.

    ``body`` is what the gateway would answer on an OpenAI path: an OpenAI error object (its
    message is kept, the type follows the status), or an engine's Anthropic one (kept as it
    is); anything else gets a message saying only the status."""
    try:
        obj: Any = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        obj = None
    if isinstance(obj, dict):
        error = obj.get("error")
        if (obj.get("type") == "error" and isinstance(error, dict)
                and isinstance(error.get("type"), str) and isinstance(error.get("message"), str)):
            return body
        message = error.get("message") if isinstance(error, dict) else None
    else:
        message = None
    if not isinstance(message, str):
        message = f"the request failed (HTTP {status})"
    return json.dumps({"type": "error", "error": {"type": _anthropic_type(status),
                                                  "message": message}}).encode()


def anthropic_error_event(status: int, message: str) -> bytes:
    """An in-stream error of a Messages stream (``event: error``; nothing follows it):
    what ``status`` would have answered before the stream began."""
    payload = json.dumps({"type": "error", "error": {"type": _anthropic_type(status),
                                                     "message": message}})
    return b"event: error\ndata: " + payload.encode() + b"\n\n"
