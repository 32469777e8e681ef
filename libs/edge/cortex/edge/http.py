"""The ops HTTP endpoint of a service (``/metrics``, ``/health/*``): an aiohttp app started
on ``host:port`` (0 = any free port), the runner to clean up and the port it got; and the
bound socket it listens on (the index binds its gRPC port the same way).

aiohttp is imported when a server starts, so importing :mod:`cortex.edge` stays light.
"""

from __future__ import annotations

import socket
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from aiohttp import web

__all__ = ["bound_socket", "start_ops_http"]


async def start_ops_http(app: web.Application, host: str, port: int
                         ) -> tuple[web.AppRunner, int]:
    """Serve ``app`` on ``host:port``; ``(runner, bound port)``. The caller owns the runner
    (``await runner.cleanup()``). Raises ``OSError`` when the address cannot be bound."""
    from aiohttp import web

    sock = bound_socket(host, port)
    runner = web.AppRunner(app, access_log=None)
    try:
        await runner.setup()
        bound = int(sock.getsockname()[1])
        await web.SockSite(runner, sock).start()
    except BaseException:
        sock.close()
        await runner.cleanup()
        raise
    return runner, bound


def bound_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (port 0: the kernel picks), so the port is known
    before the site starts."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock
