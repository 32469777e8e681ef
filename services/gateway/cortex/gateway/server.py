"""``GatewayServer``: the gateway's HTTP/1.1 server inside the current event loop.

``async with GatewayServer(config) as gw:`` binds ``server.host:server.port`` (port 0 → a
free port, see :attr:`port` / :attr:`url`), runs startup (ready when it returns) and on exit
shuts down gracefully (in-flight requests get ``server.graceful_timeout_s``). Used by
tests, the dev-cluster launcher and ``cortex gateway``.

The listening socket is a :class:`~cortex.gateway.http.listener.CappedListener`: past
``server.max_connections`` open client connections (``server.max_connections_per_peer``
from one address), a new one is answered 503 at once. Each connection is an
:class:`~cortex.gateway.http.h1.H1Connection` (the request parsed by llhttp, the header,
keep-alive, read and write deadlines); the app's ASGI lifespan runs here.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Mapping
from types import TracebackType

from cortex.gateway.app import App
from cortex.gateway.config.gateway import GatewayConfig
from cortex.gateway.http.asgi import Message
from cortex.gateway.http.h1 import ConnectionDeadlines, H1Server
from cortex.gateway.http.listener import CappedListener
from cortex.gateway.runtime import Runtime
from cortex.registry import Registry

__all__ = ["GatewayServer"]


class GatewayServer:
    def __init__(self, config: GatewayConfig, *, registry: Registry | None = None,
                 environ: Mapping[str, str] | None = None) -> None:
        self.config = config
        self.app = App(config, registry=registry, environ=environ)
        self.host = config.server.host
        self.port = 0
        self._shutdown = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.listener: CappedListener | None = None

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.port}"

    @property
    def gateway(self) -> Runtime:
        gateway = self.app.gateway
        if gateway is None:
            raise RuntimeError("the gateway is not running")
        return gateway

    async def __aenter__(self) -> GatewayServer:
        server = self.config.server
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = self.listener = CappedListener(family, server.max_connections,
                                              server.max_connections_per_peer)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.bind((self.host, server.port))
            sock.listen(server.backlog)  # connections queue until serving
            self.port = sock.getsockname()[1]
        except BaseException:
            sock.close()
            raise
        self._task = asyncio.create_task(self._serve(sock), name="gateway-http")
        started = asyncio.create_task(self._wait_started())
        await asyncio.wait((self._task, started), return_when=asyncio.FIRST_COMPLETED)
        if self._task.done():
            started.cancel()
            error = self._task.exception()
            raise RuntimeError("the gateway failed to start") from error
        return self

    async def _serve(self, sock: CappedListener) -> None:
        """The app's startup, then the connections over ``sock`` until :attr:`_shutdown`;
        then stop accepting, give open connections ``graceful_timeout_s`` and shut the app
        down."""
        loop = asyncio.get_running_loop()
        server = self.config.server
        async with _Lifespan(self.app):
            self._wire_metrics(sock)
            # a head past this bound is refused by the server (431) before it is whole;
            # complete ones over server.max_header_bytes get the App's 431 (the slack is
            # the request line's)
            http = H1Server(
                self.app, sock, ConnectionDeadlines(
                    server.header_timeout_s, server.keep_alive_timeout_s,
                    server.write_timeout_s, server.read_timeout_s),
                max_head_bytes=server.max_header_bytes + 8 * 1024, on_timeout=self._timed_out)
            listening = await loop.create_server(http.connection, sock=sock,
                                                 backlog=server.backlog)
            try:
                await self._shutdown.wait()
            finally:
                listening.close()
                await http.shutdown(server.graceful_timeout_s)

    def _wire_metrics(self, listener: CappedListener) -> None:
        gateway = self.app.gateway
        if gateway is None:
            return
        metrics = gateway.metrics
        metrics.connections_open.set_function(lambda: listener.open)
        metrics.connection_peers.set_function(lambda: len(listener.by_peer))
        listener.on_refused = lambda bound: metrics.connections_refused.labels(bound).inc()

    def _timed_out(self, phase: str) -> None:
        gateway = self.app.gateway
        if gateway is not None:
            gateway.metrics.connections_timed_out.labels(phase).inc()

    async def drain(self) -> None:
        """The not-ready-then-drain phase of a shutdown: readiness turns 503 at once,
        requests are still served for ``server.drain_delay_s``; leaving the ``async with``
        then stops accepting and lets in-flight requests finish (``graceful_timeout_s``)."""
        gateway = self.app.gateway
        if gateway is None:
            return
        gateway.drain()
        await asyncio.sleep(self.config.server.drain_delay_s)

    async def _wait_started(self) -> None:
        await self.app.started.wait()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._shutdown.set()
        try:
            if self._task is not None:
                await self._task
        finally:
            if self.listener is not None:
                self.listener.close()

    def __repr__(self) -> str:
        return f"GatewayServer(url={self.url!r}, running={self.app.gateway is not None})"



class _Lifespan:
    """The app's ASGI lifespan: ``async with`` runs its startup (``RuntimeError`` if it
    failed) and, on the way out, its shutdown."""

    def __init__(self, app: App) -> None:
        self._app = app
        self._inbox: asyncio.Queue[Message] = asyncio.Queue()
        self._replies: asyncio.Queue[Message] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> None:
        scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"},
                 "state": {}}
        self._task = asyncio.create_task(self._app(scope, self._inbox.get, self._replies.put),
                                         name="gateway-lifespan")
        self._inbox.put_nowait({"type": "lifespan.startup"})
        reply = await self._reply()
        if reply["type"] != "lifespan.startup.complete":
            await self._task
            raise RuntimeError(f"the gateway's startup failed: {reply.get('message')}")

    async def _reply(self) -> Message:
        """The app's next lifespan message (its error if it ended without one)."""
        assert self._task is not None
        reply = asyncio.ensure_future(self._replies.get())
        await asyncio.wait((reply, self._task), return_when=asyncio.FIRST_COMPLETED)
        if reply.done():
            return reply.result()
        reply.cancel()
        self._task.result()  # the app's error, if it failed
        raise RuntimeError("the app's lifespan ended without an answer")

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        assert self._task is not None
        self._inbox.put_nowait({"type": "lifespan.shutdown"})
        try:
            await self._reply()
        finally:
            if not self._task.done():
                self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def __repr__(self) -> str:
        return f"_Lifespan(running={self._task is not None and not self._task.done()})"
