"""The ASGI application: one lifespan owns the :class:`Runtime`; a flat table routes paths.

Unknown paths answer 404, known paths with another method 405, both as OpenAI error
objects (Anthropic's under ``/v1/messages``). An unexpected exception becomes a 500
``internal_error`` without details (they go to the log with the request id; tracebacks
rate-limited, :mod:`cortex.gateway.tracebacks`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping

from cortex.gateway.api.admin import AdminHandler
from cortex.gateway.api.inference import InferenceHandler, request_id_of
from cortex.gateway.api.ops import OpsHandler
from cortex.gateway.api.relay import RELAYED_PATHS, RelayHandler
from cortex.gateway.api.tokenize import AlignmentCheck, TokenizeHandler
from cortex.gateway.config.gateway import GatewayConfig
from cortex.gateway.errors import ClientError, ErrorCode, GatewayError
from cortex.gateway.http.asgi import Receive, Scope, Send
from cortex.gateway.http.messages import (
    ANTHROPIC_PATHS,
    PUBLIC_PATHS,
    AnthropicErrors,
    ClientDisconnected,
    Middleware,
    Request,
    json_loads,
    send_bytes,
    send_error,
)
from cortex.gateway.request.payload import InferencePath
from cortex.gateway.runtime import Runtime
from cortex.gateway.tracebacks import TracebackLimiter
from cortex.registry import Registry
from cortex.telemetry.tracing import SpanKind

__all__ = ["App"]

log = logging.getLogger(__name__)

Handler = Callable[[Request, Send], Awaitable[None]]


class App:
    """``App(config)`` is the ASGI callable the server (:mod:`cortex.gateway.http.h1`) serves."""

    def __init__(self, config: GatewayConfig, *, registry: Registry | None = None,
                 environ: Mapping[str, str] | None = None) -> None:
        self.config = config
        self._registry = registry
        self._environ = environ
        self._middleware: Middleware | None = None
        self.gateway: Runtime | None = None
        self.started = asyncio.Event()  # set once startup completed
        self._routes: dict[str, dict[str, Handler]] = {}
        self._tracebacks = TracebackLimiter()

    def _build_routes(self, gw: Runtime) -> None:
        relay = self._relay = RelayHandler(gw)
        inference = InferenceHandler(gw, self._tracebacks, relay=relay.post,
                                     learn=relay.owners.learn)
        ops = self._ops = OpsHandler(gw)
        admin = AdminHandler(gw)
        tokens = TokenizeHandler(gw)
        self._middleware = Middleware(gw.api_keys, self.config.cors, self.config.access_log,
                                      gw.metrics, lambda: gw.draining)

        passthrough = frozenset(m.name for m in self.config.models if m.passthrough)

        def infer(endpoint: InferencePath) -> Handler:
            async def handle(request: Request, send: Send) -> None:
                if passthrough and await _model_of(request, self.config) in passthrough:
                    await relay.passthrough(request, send)
                else:
                    await inference(request, send, endpoint)
            return handle

        def agent(endpoint: InferencePath) -> Handler:
            async def handle(request: Request, send: Send) -> None:
                if await relay.by_load(request, passthrough):
                    await relay.post(request, send)
                else:
                    await inference(request, send, endpoint)
            return handle

        self._routes = {
            InferencePath.CHAT.value: {"POST": infer(InferencePath.CHAT)},
            InferencePath.COMPLETIONS.value: {"POST": infer(InferencePath.COMPLETIONS)},
            InferencePath.GENERATE.value: {"POST": infer(InferencePath.GENERATE)},
            "/v1/models": {"GET": lambda r, s: ops.models(s)},
            **{path: {"POST": relay.post} for path in RELAYED_PATHS},
            InferencePath.MESSAGES.value: {"POST": agent(InferencePath.MESSAGES)},
            InferencePath.RESPONSES.value: {"POST": agent(InferencePath.RESPONSES)},
            "/tokenize": {"POST": tokens.tokenize},
            "/detokenize": {"POST": tokens.detokenize},
            "/health": {"GET": lambda r, s: ops.health(s)},
            "/health/live": {"GET": lambda r, s: ops.live(s)},
            "/health/ready": {"GET": lambda r, s: ops.ready(s)},
            "/metrics": {"GET": lambda r, s: ops.metrics(s)},
        }
        self._admin = admin

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            await self._http(scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        message = await receive()
        assert message["type"] == "lifespan.startup"
        try:
            gateway = await Runtime.load(self.config, registry=self._registry,
                                         environ=self._environ)
            await gateway.__aenter__()
        except Exception as exc:
            log.exception("gateway startup failed")
            await send({"type": "lifespan.startup.failed", "message": repr(exc)})
            return
        self.gateway = gateway
        self._build_routes(gateway)
        check = await AlignmentCheck(gateway).__aenter__()
        await send({"type": "lifespan.startup.complete"})
        self.started.set()
        try:
            message = await receive()
            assert message["type"] == "lifespan.shutdown"
        finally:
            self.gateway = None
            await check.__aexit__(None, None, None)
            await gateway.__aexit__(None, None, None)
        await send({"type": "lifespan.shutdown.complete"})

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive, self.config.server.body_timeout_s)
        if request.path.startswith(ANTHROPIC_PATHS):
            send = AnthropicErrors(send)
        if _header_bytes(scope) > self.config.server.max_header_bytes:
            await send_error(send, ClientError(
                f"request headers exceed {self.config.server.max_header_bytes} bytes",
                code=ErrorCode.HEADERS_TOO_LARGE, status=431))
            return
        middleware = self._middleware
        if self.gateway is None or middleware is None:
            await send_error(send, GatewayError("the gateway is not running",
                                                code=ErrorCode.SHUTTING_DOWN, status=503))
            return
        tracing = self.gateway.tracing
        if tracing is not None and request.path not in PUBLIC_PATHS:
            request.span = tracing.start(f"{request.method} {request.path}",
                                         headers=request.headers, kind=SpanKind.SERVER,
                                         attributes={"http.request.method": request.method,
                                                     "url.path": request.path})
        exchange = middleware.exchange(request, send)
        try:
            await self._route(request, exchange, middleware)
        finally:
            exchange.finish(request_id_of(request))
            if request.span is not None:
                exchange.annotate(request.span)
                request.span.end()

    async def _route(self, request: Request, send: Send, middleware: Middleware) -> None:
        try:
            preflight = middleware.preflight(request)
            if preflight is not None:
                await send_bytes(send, 204, b"", b"text/plain", preflight)
                return
            middleware.authenticate(request)
            if request.path.startswith("/admin/"):
                await self._admin(request, send)
                return
            methods = self._routes.get(request.path) or self._prefixed(request.path)
            if methods is None:
                raise GatewayError(f"no route for {request.path}", code=ErrorCode.NOT_FOUND,
                                   status=404)
            handler = methods.get(request.method)
            if handler is None:
                raise GatewayError(f"method {request.method} not allowed on {request.path}",
                                   code=ErrorCode.METHOD_NOT_ALLOWED, status=405)
            await handler(request, send)
        except GatewayError as exc:
            await send_error(send, exc, [(b"x-request-id", request_id_of(request).encode())])
        except Exception:
            request_id = request_id_of(request)
            self._tracebacks.log(log, "unhandled error request_id=%s path=%s", request_id,
                                 request.path, request_id=request_id)
            await send_error(send, GatewayError("internal error"),
                             [(b"x-request-id", request_id.encode())])

    def _prefixed(self, path: str) -> dict[str, Handler] | None:
        """The routes with an id in the path."""
        if path.startswith("/v1/models/") and len(path) > len("/v1/models/"):
            model_id = path.removeprefix("/v1/models/")
            return {"GET": lambda r, s: self._ops.model(s, model_id)}
        if path.startswith("/v1/responses/") and path.count("/") in (3, 4):
            if path.endswith("/cancel"):
                return {"POST": self._relay.responses_by_id}
            if path.count("/") == 3:
                return {"GET": self._relay.responses_by_id}
        return None

    def __repr__(self) -> str:
        return f"App(running={self.gateway is not None})"


def _header_bytes(scope: Scope) -> int:
    """The size of a request's headers as sent (names, values, ``: `` and CRLF)."""
    return sum(len(name) + len(value) + 4 for name, value in scope["headers"])


async def _model_of(request: Request, config: GatewayConfig) -> str | None:
    """The ``model`` of a JSON body (read now, remembered for the handler); ``None`` when
    it has none or is not JSON (the inference handler then says what is wrong)."""
    try:
        raw = await request.body(config.server.max_body_bytes)
        name = json_loads(raw).get("model")
    except (ClientDisconnected, ValueError, UnicodeDecodeError, AttributeError,
            RecursionError):
        return None
    return name if isinstance(name, str) else None
