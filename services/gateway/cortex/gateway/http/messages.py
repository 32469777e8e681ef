"""Minimal ASGI HTTP helpers: a request view with a bounded body reader, and responses."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any
from urllib.parse import unquote_plus

from cortex.gateway.errors import ClientError, ErrorCode, GatewayError
from cortex.gateway.http import json_codec
from cortex.gateway.http.asgi import Receive, Scope, Send
from cortex.telemetry.tracing import Span

__all__ = ["Headers", "Request", "send_bytes", "send_error", "send_json"]

Headers = list[tuple[bytes, bytes]]


class Request:
    """An HTTP request: method, path, lower-cased headers and the body, read once;
    ``body_timeout_s``: how long the whole body may take to arrive (``None``: no bound)."""

    __slots__ = ("_body", "_receive", "body_timeout_s", "headers", "key_id", "method", "model",
                 "path", "query", "request_id", "scope", "span")

    def __init__(self, scope: Scope, receive: Receive, body_timeout_s: float | None = None
                 ) -> None:
        self.scope = scope
        self._receive = receive
        self.body_timeout_s = body_timeout_s
        self.method: str = scope["method"]
        self.path: str = scope["path"]
        self.query: bytes = scope.get("query_string", b"")
        self.headers: dict[str, str] = {
            k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]
        }
        # learned while it is served, for the access log: the accepted API key's id, the
        # model asked for, the request id answered with
        self.key_id: str | None = None
        self.model: str | None = None
        self.request_id: str | None = None
        self._body: bytes | None = None
        self.span: Span | None = None  # this request's trace span, when traced

    async def body(self, limit: int) -> bytes:
        """The whole body (read once, then remembered); :class:`ClientError` past ``limit``
        bytes (413) or when it has not arrived within :attr:`body_timeout_s` (408, and the
        connection is closed)."""
        if self._body is not None:
            return self._body
        self._body = await self._read_within(limit)
        return self._body

    async def _read_within(self, limit: int) -> bytes:
        timeout_s = self.body_timeout_s
        declared = self.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise ClientError(f"request body over {limit} bytes",
                              code=ErrorCode.REQUEST_TOO_LARGE, status=413)
        try:
            async with asyncio.timeout(timeout_s):
                return await self._read_body(limit)
        except TimeoutError:
            raise ClientError(f"the request body did not arrive within {timeout_s:g}s",
                              code=ErrorCode.REQUEST_TIMEOUT, status=408,
                              close_connection=True) from None

    async def _read_body(self, limit: int) -> bytes:
        parts: list[bytes] = []
        size = 0
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                raise ClientDisconnected
            chunk = message.get("body", b"")
            if chunk:
                size += len(chunk)
                if size > limit:
                    raise ClientError(f"request body over {limit} bytes",
                                      code=ErrorCode.REQUEST_TOO_LARGE, status=413)
                parts.append(chunk)
            if not message.get("more_body", False):
                return b"".join(parts) if len(parts) != 1 else parts[0]

    @property
    def query_params(self) -> dict[str, str]:
        """The query string as a dict (the last value of a repeated key wins)."""
        return {unquote_plus(k): unquote_plus(v) for k, _, v in
                (p.partition("=") for p in self.query.decode("latin-1").split("&") if p)}

    @property
    def receive(self) -> Receive:
        return self._receive

    def __repr__(self) -> str:
        return f"Request({self.method} {self.path})"


class ClientDisconnected(Exception):
    """The client went away before the request was answered."""


def _headers(content_type: bytes, length: int, extra: Iterable[tuple[bytes, bytes]]) -> Headers:
    return [(b"content-type", content_type), (b"content-length", str(length).encode()), *extra]


async def send_bytes(send: Send, status: int, body: bytes, content_type: bytes,
                     extra: Iterable[tuple[bytes, bytes]] = ()) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": _headers(content_type, len(body), extra)})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def send_json(send: Send, status: int, obj: Any,
                    extra: Iterable[tuple[bytes, bytes]] = ()) -> None:
    await send_bytes(send, status, json_codec.dumps(obj), b"application/json", extra)


async def send_error(send: Send, error: GatewayError,
                     extra: Iterable[tuple[bytes, bytes]] = ()) -> None:
    await send_bytes(send, error.status, error.body(), b"application/json",
                     [*extra, *error.headers()])
