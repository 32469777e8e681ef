"""``GatewayServer``: the gateway on hypercorn inside the current event loop.

``async with GatewayServer(config) as gw:`` binds ``server.host:server.port`` (port 0 → a
free port, see :attr:`port` / :attr:`url`), runs startup (ready when it returns) and on exit
shuts down gracefully (in-flight requests get ``server.graceful_timeout_s``). Used by
tests, the dev-cluster launcher and ``cortex gateway``.
"""

from __future__ import annotations

import asyncio
import os
import socket
from types import TracebackType

from hypercorn.asyncio import serve
from hypercorn.config import Config as HypercornConfig

from cortex.gateway.app import GatewayApp
from cortex.gateway.config import GatewayConfig
from cortex.gateway.runtime import Gateway
from cortex.registry import Registry

__all__ = ["GatewayServer"]


class GatewayServer:
    def __init__(self, config: GatewayConfig, *, registry: Registry | None = None) -> None:
        self.config = config
        self.app = GatewayApp(config, registry=registry)
        self.host = config.server.host
        self.port = 0
        self._shutdown = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.port}"

    @property
    def gateway(self) -> Gateway:
        gateway = self.app.gateway
        if gateway is None:
            raise RuntimeError("the gateway is not running")
        return gateway

    def _hypercorn_config(self, fd: int) -> HypercornConfig:
        server = self.config.server
        hc = HypercornConfig()
        hc.bind = [f"fd://{fd}"]
        hc.graceful_timeout = server.graceful_timeout_s
        hc.keep_alive_timeout = server.keep_alive_timeout_s
        hc.backlog = server.backlog
        hc.accesslog = None
        hc.errorlog = None
        hc.include_server_header = False
        hc.h11_max_incomplete_size = 64 * 1024
        return hc

    async def __aenter__(self) -> GatewayServer:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.bind((self.host, self.config.server.port))
            sock.listen(self.config.server.backlog)  # connections queue until serving
            self.port = sock.getsockname()[1]
            fd = os.dup(sock.fileno())  # hypercorn owns the duplicate
        finally:
            sock.close()
        self._task = asyncio.create_task(
            serve(self.app, self._hypercorn_config(fd),  # type: ignore[arg-type]
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

    async def _wait_started(self) -> None:
        await self.app.started.wait()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._shutdown.set()
        if self._task is not None:
            await self._task

    def __repr__(self) -> str:
        return f"GatewayServer(url={self.url!r}, running={self.app.gateway is not None})"
