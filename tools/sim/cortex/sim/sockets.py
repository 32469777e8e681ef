"""Binding helpers shared by the sim's ZMQ and HTTP listeners (port 0 = any free port)."""

from __future__ import annotations

from typing import Any

import zmq
from aiohttp import web

__all__ = ["bind_tcp", "site_port"]


def bind_tcp(sock: zmq.Socket[Any], host: str, port: int) -> int:
    """Bind a ZMQ socket on ``host:port`` (0 = any free port); returns the bound port."""
    bind_host = "*" if host in ("0.0.0.0", "", "*") else host
    sock.bind(f"tcp://{bind_host}:{port or '*'}")
    endpoint = sock.getsockopt(zmq.LAST_ENDPOINT)
    text = endpoint.decode() if isinstance(endpoint, bytes) else str(endpoint)
    return int(text.rsplit(":", 1)[1])


def site_port(runner: web.AppRunner) -> int:
    """The port an aiohttp runner's first site listens on."""
    for site in runner.sites:
        server = getattr(site, "_server", None)
        for sock in getattr(server, "sockets", None) or []:
            port: int = sock.getsockname()[1]
            return port
    raise RuntimeError("the site is not listening")
