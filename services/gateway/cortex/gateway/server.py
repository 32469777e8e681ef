"""``GatewayServer``: the gateway on hypercorn inside the current event loop.

``async with GatewayServer(config) as gw:`` binds ``server.host:server.port`` (port 0 → a
free port, see :attr:`port` / :attr:`url`), runs startup (ready when it returns) and on exit
shuts down gracefully (in-flight requests get ``server.graceful_timeout_s``). Used by
tests, the dev-cluster launcher and ``cortex gateway``.

The listening socket is a :class:`~cortex.gateway.http.listener.CappedListener`: past
``server.max_connections`` open client connections (``server.max_connections_per_peer``
from one address), a new one is answered 503 at once. Each connection is served by a
:class:`~cortex.gateway.http.admission.GuardedConnection` (hypercorn's, with the header,
write and peer-closed deadlines), so this module runs hypercorn's lifespan and accept loop
itself instead of ``worker_serve``.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Mapping
from types import TracebackType

from hypercorn.asyncio.lifespan import Lifespan
from hypercorn.asyncio.worker_context import WorkerContext
from hypercorn.config import Config as HypercornConfig
from hypercorn.typing import AppWrapper, LifespanState
from hypercorn.utils import wrap_app

from cortex.gateway.app import App
from cortex.gateway.config.gateway import GatewayConfig
from cortex.gateway.http.admission import CachedDateConfig, ConnectionDeadlines, GuardedConnection
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

    def _hypercorn_config(self) -> HypercornConfig:
        server = self.config.server
        hc = CachedDateConfig()
        hc.graceful_timeout = server.graceful_timeout_s
        hc.keep_alive_timeout = server.keep_alive_timeout_s
        hc.read_timeout = server.read_timeout_s  # type: ignore[assignment]
        hc.backlog = server.backlog
        hc.accesslog = None
        hc.errorlog = None
        hc.include_server_header = False
        # h11 answers 431 itself to headers still incomplete past this; complete ones over
        # server.max_header_bytes get the App's 431 (the request line needs the slack)
        hc.h11_max_incomplete_size = server.max_header_bytes + 8 * 1024
        return hc

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
        config = self._hypercorn_config()
        self._task = asyncio.create_task(
            self._serve(wrap_app(self.app, config.wsgi_max_body_size, "asgi"),  # type: ignore[arg-type]
                        config, sock),
            name="gateway-hypercorn",
        )
        started = asyncio.create_task(self._wait_started())
        await asyncio.wait((self._task, started), return_when=asyncio.FIRST_COMPLETED)
        if self._task.done():
            started.cancel()
            error = self._task.exception()
            raise RuntimeError("the gateway failed to start") from error
        return self

    async def _serve(self, app: AppWrapper, config: HypercornConfig,
                     sock: CappedListener) -> None:
        """hypercorn's lifespan and accept loop over ``sock`` until :attr:`_shutdown`; then
        stop accepting, give open connections ``graceful_timeout`` and shut the app down."""
        loop = asyncio.get_running_loop()
        state: LifespanState = {}
        lifespan = Lifespan(app, config, loop, state)
        lifespan_task = loop.create_task(lifespan.handle_lifespan())
        await lifespan.wait_for_startup()
        if lifespan_task.done() and (error := lifespan_task.exception()) is not None:
            raise error
        self._wire_metrics(sock)
        server = self.config.server
        deadlines = ConnectionDeadlines(server.header_timeout_s, server.keep_alive_timeout_s,
                                        server.write_timeout_s)
        context = WorkerContext(None)
        connections: set[asyncio.Task[None]] = set()

        async def connected(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            peer = _peer(writer.get_extra_info("peername"))
            refusal = sock.admit(peer)
            if refusal is not None:
                writer.write(refusal)  # small: fits the empty send buffer
                writer.close()
                return
            task = asyncio.current_task()
            if task is not None:
                connections.add(task)
                task.add_done_callback(connections.discard)
            try:
                await GuardedConnection(app, loop, config, context, state, reader, writer,
                                        deadlines=deadlines, on_timeout=self._timed_out)
            finally:
                sock.release(peer)

        listening = await asyncio.start_server(connected, sock=sock, backlog=config.backlog)
        try:
            await self._shutdown.wait()
        finally:
            await context.terminated.set()
            listening.close()
            await listening.wait_closed()
            if connections:
                _, late = await asyncio.wait(set(connections), timeout=config.graceful_timeout)
                for task in late:  # past the grace period: cut
                    task.cancel()
                await asyncio.gather(*late, return_exceptions=True)
            await lifespan.wait_for_shutdown()
            lifespan_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await lifespan_task

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


def _peer(address: object) -> str:
    """A client's address as the per-peer bound counts it (its host)."""
    return str(address[0]) if isinstance(address, tuple) else str(address)
