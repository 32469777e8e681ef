"""A listening socket that bounds the client connections open at once, in all and per peer.

hypercorn accepts every connection it is offered; the event loop accepts through the
listening socket's ``accept``, so this subclass counts the connections it hands out (each
one uncounts itself when it is closed) and, at a bound, answers a new one with a 503
``Retry-After`` response and closes it at once, instead of letting a flood of idle
connections take every file descriptor of the process. A place is held only while the
socket is open: :class:`~cortex.gateway.http.admission.GuardedConnection` closes one whose
peer left, or that sent no request in time, at once.
"""

from __future__ import annotations

import collections
import socket
from collections.abc import Callable
from typing import Any

from cortex.gateway.errors import ErrorCode, error_body

__all__ = ["CappedListener", "Refusal"]


def _refusal(message: str) -> bytes:
    body = error_body(503, message, ErrorCode.OVERLOADED)
    return (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
            b"retry-after: 1\r\nconnection: close\r\ncontent-length: "
            + str(len(body)).encode() + b"\r\n\r\n" + body)


REFUSAL = _refusal("the gateway has too many open connections; retry later")
"""What a connection over the overall bound receives before it is closed."""
PEER_REFUSAL = _refusal("this client address has too many open connections; retry later")
"""What a connection over its peer's bound receives before it is closed."""

Refusal = Callable[[str], None]
"""Told of each refused connection, with the bound it hit (``total`` | ``peer``)."""


class _Counted(socket.socket):
    """An accepted connection that gives its place back when it is closed (once)."""

    def __init__(self, owner: CappedListener, peer: str, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._owner: CappedListener | None = owner
        self._peer = peer

    def close(self) -> None:
        owner, self._owner = self._owner, None
        if owner is not None:
            owner.release(self._peer)
        super().close()


class CappedListener(socket.socket):
    """A TCP listening socket; ``cap`` open connections at most and ``peer_cap`` from one
    client address (0 = no bound). ``open`` counts the connections accepted and not yet
    closed, ``by_peer`` the same per address; ``refused`` / ``refused_peer`` those turned
    away at each bound. ``on_refused`` (settable later) hears of each refusal."""

    def __init__(self, family: socket.AddressFamily, cap: int, peer_cap: int = 0) -> None:
        super().__init__(family, socket.SOCK_STREAM)
        self.cap = cap
        self.peer_cap = peer_cap
        self.open = 0
        self.by_peer: collections.Counter[str] = collections.Counter()
        self.refused = 0
        self.refused_peer = 0
        self.on_refused: Refusal | None = None

    def accept(self) -> tuple[socket.socket, Any]:
        fd, address = self._accept()  # type: ignore[attr-defined]
        peer = str(address[0]) if isinstance(address, tuple) else str(address)
        if self.cap and self.open >= self.cap:
            self.refused += 1
            self._refuse(fd, REFUSAL, "total")
        if self.peer_cap and self.by_peer[peer] >= self.peer_cap:
            self.refused_peer += 1
            self._refuse(fd, PEER_REFUSAL, "peer")
        conn = _Counted(self, peer, self.family, self.type, self.proto, fileno=fd)
        self.open += 1
        self.by_peer[peer] += 1
        if socket.getdefaulttimeout() is None and self.gettimeout():
            conn.setblocking(True)
        return conn, address

    def release(self, peer: str) -> None:
        """Give back the place of a connection from ``peer`` (called once, on its close)."""
        self.open -= 1
        left = self.by_peer[peer] - 1
        if left > 0:
            self.by_peer[peer] = left
        else:
            del self.by_peer[peer]  # a counter of every address ever seen would grow

    def _refuse(self, fd: int, answer: bytes, bound: str) -> None:
        with socket.socket(self.family, self.type, self.proto, fileno=fd) as extra:
            extra.setblocking(False)
            try:
                extra.send(answer)  # small: fits the empty send buffer
            except OSError:
                pass
        if self.on_refused is not None:
            self.on_refused(bound)
        # the event loop ends this accept round and tries again on the next wake-up
        raise ConnectionAbortedError(f"over the {bound} connection bound")

    def __repr__(self) -> str:
        return (f"CappedListener(open={self.open}, cap={self.cap}, peers={len(self.by_peer)}, "
                f"peer_cap={self.peer_cap}, refused={self.refused}, "
                f"refused_peer={self.refused_peer})")
