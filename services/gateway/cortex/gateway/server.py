"""``GatewayServer``: the gateway on hypercorn inside the current event loop.

``async with GatewayServer(config) as gw:`` binds ``server.host:server.port`` (port 0 → a
free port, see :attr:`port` / :attr:`url`), runs startup (ready when it returns) and on exit
shuts down gracefully (in-flight requests get ``server.graceful_timeout_s``). Used by
tests, the dev-cluster launcher and ``cortex gateway``.

The listening socket is a :class:`~cortex.gateway.http.listener.CappedListener`: past
``server.max_connections`` open client connections, a new one is answered 503 at once.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Mapping
from types import TracebackType

from hypercorn.asyncio.run import worker_serve
from hypercorn.config import Config as HypercornConfig
from hypercorn.config import Sockets
from hypercorn.utils import wrap_app

from cortex.gateway.app import App
from cortex.gateway.config.gateway import GatewayConfig
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
        hc = HypercornConfig()
        hc.graceful_timeout = server.graceful_timeout_s
        hc.keep_alive_timeout = server.keep_alive_timeout_s
        hc.read_timeout = server.read_timeout_s  # type: ignore[assignment]
        hc.backlog = server.backlog
        hc.accesslog = None
        hc.errorlog = None
        hc.include_server_header = False
        hc.h11_max_incomplete_size = 64 * 1024
        return hc

    async def __aenter__(self) -> GatewayServer:
        server = self.config.server
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = self.listener = CappedListener(family, server.max_connections)
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
            worker_serve(wrap_app(self.app, config.wsgi_max_body_size, "asgi"),  # type: ignore[arg-type]
                         config, sockets=Sockets([], [sock], []),
                         shutdown_trigger=self._shutdown.wait),
            name="gateway-hypercorn",
        )
        started = asyncio.create_task(self._wait_started())
        await asyncio.wait((self._task, started), return_when=asyncio.FIRST_COMPLETED)
        if self._task.done():
            started.cancel()
            error = self._task.exception()
            raise RuntimeError("the gateway failed to start") from error
        return self

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
