"""A listening socket that bounds the client connections open at once, in all and per peer.

The server asks this listener to admit each connection it accepts (and releases it when it
closes); at a bound, a new one is answered with a 503 ``Retry-After`` response and closed at
once, instead of letting a flood of idle connections take every file descriptor of the
process. A place is held only while the socket is open:
:class:`~cortex.gateway.http.h1.H1Connection` closes one whose peer left, or that sent no
request in time, at once.
"""

from __future__ import annotations

import collections
import socket
from collections.abc import Callable

from cortex.gateway.errors import ErrorCode
from cortex.gateway.http.h1 import refusal

__all__ = ["CappedListener", "Refusal"]


def _refusal(message: str) -> bytes:
    return refusal(503, message, ErrorCode.OVERLOADED, retry_after_s=1)


REFUSAL = _refusal("the gateway has too many open connections; retry later")
"""What a connection over the overall bound receives before it is closed."""
PEER_REFUSAL = _refusal("this client address has too many open connections; retry later")
"""What a connection over its peer's bound receives before it is closed."""

Refusal = Callable[[str], None]
"""Told of each refused connection, with the bound it hit (``total`` | ``peer``)."""


class CappedListener(socket.socket):
    """A TCP listening socket; ``cap`` open connections at most and ``peer_cap`` from one
    client address (0 = no bound). The server asks :meth:`admit` of each accepted connection
    and calls :meth:`release` when it closes: the bounds hold on any event loop (uvloop
    accepts in C, never through this socket's ``accept``). ``open`` counts the connections
    admitted and not yet released, ``by_peer`` the same per address; ``refused`` /
    ``refused_peer`` those turned away at each bound. ``on_refused`` (settable later)
    hears of each refusal."""

    def __init__(self, family: socket.AddressFamily, cap: int, peer_cap: int = 0) -> None:
        super().__init__(family, socket.SOCK_STREAM)
        self.cap = cap
        self.peer_cap = peer_cap
        self.open = 0
        self.by_peer: collections.Counter[str] = collections.Counter()
        self.refused = 0
        self.refused_peer = 0
        self.on_refused: Refusal | None = None

    def admit(self, peer: str) -> bytes | None:
        """Take a place for a new connection from ``peer``: ``None``, or, at a bound, the
        answer to send it before closing it (the connection then holds no place)."""
        if self.cap and self.open >= self.cap:
            self.refused += 1
            return self._refuse(REFUSAL, "total")
        if self.peer_cap and self.by_peer[peer] >= self.peer_cap:
            self.refused_peer += 1
            return self._refuse(PEER_REFUSAL, "peer")
        self.open += 1
        self.by_peer[peer] += 1
        return None

    def release(self, peer: str) -> None:
        """Give back the place of a connection from ``peer`` (called once, on its close)."""
        self.open -= 1
        left = self.by_peer[peer] - 1
        if left > 0:
            self.by_peer[peer] = left
        else:
            del self.by_peer[peer]  # a counter of every address ever seen would grow

    def _refuse(self, answer: bytes, bound: str) -> bytes:
        if self.on_refused is not None:
            self.on_refused(bound)
        return answer

    def __repr__(self) -> str:
        return (f"CappedListener(open={self.open}, cap={self.cap}, peers={len(self.by_peer)}, "
                f"peer_cap={self.peer_cap}, refused={self.refused}, "
                f"refused_peer={self.refused_peer})")
