"""Minimal ASGI HTTP helpers: a request view with a bounded body reader, and responses.

What every HTTP request passes before its route: client auth, CORS, the access log; on the
Messages API (:data:`ANTHROPIC_PATHS`), :class:`AnthropicErrors` gives every error answer
Anthropic's shape.
:class:`Middleware` is built once from the config; :class:`Exchange` follows one request: it
wraps ``send`` to learn the status and the decision headers (worker, match mode) of the answer,
adds the CORS headers, and writes the access-log line when the answer is done.

What an inference request passes next: :class:`Admission`, a concurrency limit with a bounded
FIFO queue (sglang-router's ``--max-concurrent-requests`` / ``--queue-size`` /
``--queue-timeout-secs``). At most ``max_concurrent`` inference requests are in service in
this process; up to ``queue_size`` more wait, first come first served, at most
``queue_timeout_s`` seconds. A request finding the queue full is refused at once (429
``queue_full``), one that waited too long gets 503 ``queue_timeout``; both carry
``Retry-After``. Waiting happens before the body is read, so the memory of queued requests
stays in the sockets.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import unquote_plus

import orjson

from cortex.gateway.config.gateway import AdmissionConfig
from cortex.gateway.config.middleware import AccessLogConfig, CorsConfig
from cortex.gateway.errors import (
    ClientError,
    ErrorCode,
    GatewayError,
    ServiceUnavailable,
    anthropic_error,
)
from cortex.gateway.http.asgi import Message, Receive, Scope, Send
from cortex.gateway.http.auth import ApiKeys
from cortex.gateway.metrics import GatewayMetrics
from cortex.telemetry.tracing import Span, StatusCode

__all__ = [
    "ANTHROPIC_PATHS",
    "PUBLIC_PATHS",
    "Admission",
    "AnthropicErrors",
    "Exchange",
    "Headers",
    "JSONDecodeError",
    "Middleware",
    "Request",
    "json_dumps",
    "json_loads",
    "send_bytes",
    "send_error",
    "send_json",
]


# ---- JSON ----
# orjson (C) for request bodies, replies and SSE events. Measured on the gateway's own
# payloads (docs/gateway.md, "JSON"): orjson parses a ~1 KB chat body ~6x faster than the
# standard library and writes bodies 15-30x faster; msgspec parses a 64 KB one faster but
# writes it 4x slower, and the gateway writes a body per request. Output is compact with
# non-ASCII as is (what the engines send). What orjson cannot write (an integer past 64
# bits) falls back to the standard library.

JSONDecodeError = orjson.JSONDecodeError
"""What :func:`json_loads` raises for anything that is not JSON (a ``ValueError``): invalid
UTF-8, lone surrogate escapes, ``NaN``, nesting past 1,024 levels."""


def json_loads(data: bytes | str) -> Any:
    """The value of a JSON document; :data:`JSONDecodeError` if it is not one."""
    return orjson.loads(data)


def json_dumps(obj: Any) -> bytes:
    """``obj`` as compact UTF-8 JSON."""
    try:
        return orjson.dumps(obj)
    except TypeError:
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


# ---- messages ----


Headers = list[tuple[bytes, bytes]]


class Request:
    """An HTTP request: method, path, lower-cased headers and the body, read once;
    ``body_timeout_s``: how long the whole body may take to arrive (``None``: no bound)."""

    __slots__ = ("_body", "_receive", "body_timeout_s", "headers", "key_id", "log_fields",
                 "method", "model", "path", "query", "request_id", "scope", "span")

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
        # more access-log fields the handler learned (the reuse accounting's tokens)
        self.log_fields: dict[str, int | str | None] = {}
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
    await send_bytes(send, status, json_dumps(obj), b"application/json", extra)


async def send_error(send: Send, error: GatewayError,
                     extra: Iterable[tuple[bytes, bytes]] = ()) -> None:
    await send_bytes(send, error.status, error.body(), b"application/json",
                     [*extra, *error.headers()])


ANTHROPIC_PATHS = ("/v1/messages",)
"""Path prefixes of Anthropic's API: their clients read Anthropic error objects."""
_MAX_ERROR_BODY = 64 * 1024  # an error body longer than this is not an error object


class AnthropicErrors:
    """Wraps ``send`` of a Messages API request: an error answer (status >= 400) goes out as
    an Anthropic error object (:func:`~cortex.gateway.errors.anthropic_error`) with the same
    status and headers, whichever layer answered (auth, admission, routing, the relay, a
    worker's refusal). Success answers and streams pass untouched (a stream's own error
    event is written in the right shape where it is made)."""

    __slots__ = ("_body", "_send", "_start")

    def __init__(self, send: Send) -> None:
        self._send = send
        self._start: Message | None = None
        self._body = b""

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start" and message["status"] >= 400:
            self._start = message
            return
        start = self._start
        if start is None or message["type"] != "http.response.body":
            await self._send(message)
            return
        self._body = (self._body + message.get("body", b""))[:_MAX_ERROR_BODY + 1]
        if message.get("more_body", False):
            return
        self._start = None
        body = anthropic_error(start["status"], self._body)
        headers = [(k, v) for k, v in start["headers"]
                   if k.lower() not in (b"content-length", b"content-type")]
        await self._send({**start, "headers": _headers(b"application/json", len(body), headers)})
        await self._send({"type": "http.response.body", "body": body, "more_body": False})

    def __repr__(self) -> str:
        return f"AnthropicErrors(holding={self._start is not None})"


# ---- middleware ----


access_log = logging.getLogger("cortex.gateway.access")

PUBLIC_PATHS = frozenset({"/health", "/health/live", "/health/ready", "/metrics"})
"""Answered without an API key: probes and scrapes come from the platform, not clients."""


class Unauthorized(GatewayError):
    status = 401
    code = ErrorCode.UNAUTHORIZED

    def headers(self) -> list[tuple[bytes, bytes]]:
        return [(b"www-authenticate", b'Bearer realm="cortex"'), *super().headers()]


class Middleware:
    """The config's auth, CORS and access-log settings, applied per request."""

    def __init__(self, keys: ApiKeys, cors: CorsConfig, access: AccessLogConfig,
                 metrics: GatewayMetrics, draining: Callable[[], bool] = lambda: False
                 ) -> None:
        self.keys = keys
        # decided once: the keys and the CORS settings do not change while the app runs
        self._auth = keys.enabled
        self._cors = cors.enabled
        self.draining = draining
        self.cors = cors
        self.access = access
        self.metrics = metrics
        self._access_level = logging.getLevelName(access.level.upper())
        self._origins = frozenset(cors.allow_origins)
        self._allow_headers = ", ".join(cors.allow_headers).encode()
        self._allow_methods = ", ".join(cors.allow_methods).encode()
        self._expose = ", ".join(cors.expose_headers).encode()

    def authenticate(self, request: Request) -> None:
        """Set ``request.key_id``; :class:`Unauthorized` (401) without an accepted key on a
        path that needs one."""
        if not self._auth or request.path in PUBLIC_PATHS \
                or request.path.startswith("/admin/"):
            return
        header = request.headers.get("authorization")
        key_id = self.keys.check(header)
        if key_id is None:
            reason = "missing" if header is None else "invalid"
            self.metrics.auth_failures.labels(reason=reason).inc()
            raise Unauthorized("missing API key: send Authorization: Bearer <key>"
                               if header is None else "invalid API key")
        request.key_id = key_id

    # ---- CORS ----

    def _allowed(self, origin: str | None) -> bool:
        return origin is not None and ("*" in self._origins or origin in self._origins)

    def cors_headers(self, origin: str | None) -> Headers:
        """Headers for an answer to ``origin`` (none when CORS is off or it is not allowed)."""
        if not self._allowed(origin):
            return []
        assert origin is not None
        headers: Headers = [(b"access-control-allow-origin", origin.encode("latin-1")),
                            (b"vary", b"Origin")]
        if self.cors.allow_credentials:
            headers.append((b"access-control-allow-credentials", b"true"))
        if self._expose:
            headers.append((b"access-control-expose-headers", self._expose))
        return headers

    def preflight(self, request: Request) -> Headers | None:
        """The headers of a 204 answer (besides :meth:`cors_headers`, which the exchange
        adds) when ``request`` is a CORS preflight from an allowed origin, else ``None``
        (the request is routed like any other)."""
        if request.method != "OPTIONS" or "access-control-request-method" not in request.headers:
            return None
        origin = request.headers.get("origin")
        if not self._allowed(origin):
            return None
        return [(b"access-control-allow-methods", self._allow_methods),
                (b"access-control-allow-headers", self._allow_headers),
                (b"access-control-max-age", str(self.cors.max_age_s).encode())]

    def exchange(self, request: Request, send: Send) -> Exchange:
        return Exchange(self, request, send)


class Exchange:
    """One request's ``send``, wrapped: CORS headers in, status and decision headers out."""

    __slots__ = ("_cors", "_middleware", "_send", "mode", "request", "started", "status", "worker")

    def __init__(self, middleware: Middleware, request: Request, send: Send) -> None:
        self._middleware = middleware
        self.request = request
        self._send = send
        self._cors = (middleware.cors_headers(request.headers.get("origin"))
                      if middleware._cors else [])
        if middleware.draining():  # keep-alive clients reconnect, to a replica that stays
            self._cors = [*self._cors, (b"connection", b"close")]
        self.started = time.perf_counter()
        self.status: int | None = None
        self.worker = "none"
        self.mode = "none"

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            headers = message.get("headers", [])
            for name, value in headers:
                if name == b"x-cortex-assigned-worker":
                    self.worker = value.decode("latin-1")
                elif name == b"x-cortex-match-mode":
                    self.mode = value.decode("latin-1")
            if self._cors:
                message = {**message, "headers": [*headers, *self._cors]}
        await self._send(message)

    def annotate(self, span: Span) -> None:
        """Put what the answer said on the request's trace span."""
        request = self.request
        span.set_attributes({
            "http.response.status_code": self.status if self.status is not None else 499,
            "cortex.request_id": request.request_id or "", "cortex.worker": self.worker,
            "cortex.match_mode": self.mode, "cortex.model": request.model or "",
            "cortex.key_id": request.key_id or ""})
        if self.status is not None and self.status >= 500:
            span.set_status(StatusCode.ERROR)

    def finish(self, request_id: str) -> None:
        """The request is over (answered, or the client went away): log its line."""
        middleware = self._middleware
        request = self.request
        if request.key_id is not None:
            middleware.metrics.child(middleware.metrics.key_requests, request.key_id).inc()
        if not middleware.access.enabled or request.path in middleware.access.skip_paths \
                or not access_log.isEnabledFor(middleware._access_level):
            return
        status = self.status if self.status is not None else 499
        latency_ms = round((time.perf_counter() - self.started) * 1000.0, 2)
        fields = request.log_fields
        more = "".join(f" {k}={'-' if v is None else v}" for k, v in fields.items())
        access_log.log(
            middleware._access_level, "%s %s %d %.2fms model=%s worker=%s mode=%s key=%s%s",
            request.method, request.path, status, latency_ms, request.model or "-",
            self.worker, self.mode, request.key_id or "-", more,
            extra={"method": request.method, "path": request.path, "status": status,
                   "latency_ms": latency_ms, "model": request.model, "worker": self.worker,
                   "mode": self.mode, "request_id": request_id, "key_id": request.key_id,
                   **fields})


# ---- admission ----


class Admission:
    """The limit and its queue (event-loop only). ``max_concurrent_requests`` 0 = none."""

    def __init__(self, config: AdmissionConfig) -> None:
        self.config = config
        self.active = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def acquire(self) -> None:
        """Take a slot, waiting in the queue if need be; raises :class:`ServiceUnavailable`
        (429 queue full, 503 waited too long). Every success needs one :meth:`release`."""
        cfg = self.config
        if not cfg.max_concurrent_requests or (
                self.active < cfg.max_concurrent_requests and not self._waiters):
            self.active += 1
            return
        if len(self._waiters) >= cfg.queue_size:
            raise ServiceUnavailable("the gateway is at its concurrency limit and its queue is "
                                     "full", code=ErrorCode.QUEUE_FULL, status=429,
                                     retry_after_s=cfg.retry_after_s)
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout(cfg.queue_timeout_s):
                await waiter
        except BaseException as exc:
            granted = waiter.done() and not waiter.cancelled()
            with contextlib.suppress(ValueError):
                self._waiters.remove(waiter)
            if granted:  # the slot arrived as the wait ended: pass it on
                self.release()
            if isinstance(exc, TimeoutError):
                raise ServiceUnavailable(
                    f"no capacity within {cfg.queue_timeout_s:g}s", code=ErrorCode.QUEUE_TIMEOUT,
                    status=503, retry_after_s=cfg.retry_after_s) from None
            raise

    def release(self) -> None:
        """Hand the slot to the first live waiter, else free it."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self.active -= 1

    def __repr__(self) -> str:
        return (f"Admission(active={self.active}, waiting={self.waiting}, "
                f"limit={self.config.max_concurrent_requests})")
