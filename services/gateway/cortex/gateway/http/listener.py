"""A listening socket that caps the client connections open at once.

hypercorn accepts every connection it is offered; the event loop accepts through the
listening socket's ``accept``, so this subclass counts the connections it hands out (each
one uncounts itself when it is closed) and, at the cap, answers a new one with a 503
``Retry-After`` response and closes it at once, instead of letting a flood of idle
connections take every file descriptor of the process.
"""

from __future__ import annotations

import socket
from typing import Any

from cortex.gateway.errors import ErrorCode, error_body

__all__ = ["CappedListener"]

_BODY = error_body(503, "the gateway has too many open connections; retry later",
                   ErrorCode.OVERLOADED)
REFUSAL = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
           b"retry-after: 1\r\nconnection: close\r\ncontent-length: "
           + str(len(_BODY)).encode() + b"\r\n\r\n" + _BODY)
"""What a connection over the cap receives before it is closed."""


class _Counted(socket.socket):
    """An accepted connection that gives its place back when it is closed (once)."""

    def __init__(self, owner: CappedListener, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._owner: CappedListener | None = owner

    def close(self) -> None:
        owner, self._owner = self._owner, None
        if owner is not None:
            owner.open -= 1
        super().close()


class CappedListener(socket.socket):
    """A TCP listening socket; ``cap`` open connections at most (0 = no cap). ``open``
    counts the connections accepted and not yet closed; ``refused`` those turned away."""

    def __init__(self, family: socket.AddressFamily, cap: int) -> None:
        super().__init__(family, socket.SOCK_STREAM)
        self.cap = cap
        self.open = 0
        self.refused = 0

    def accept(self) -> tuple[socket.socket, Any]:
        fd, address = self._accept()  # type: ignore[attr-defined]
        if self.cap and self.open >= self.cap:
            self.refused += 1
            with socket.socket(self.family, self.type, self.proto, fileno=fd) as extra:
                extra.setblocking(False)
                try:
                    extra.send(REFUSAL)  # small: fits the empty send buffer
                except OSError:
                    pass
            # the event loop ends this accept round and tries again on the next wake-up
            raise ConnectionAbortedError("over the connection cap")
        conn = _Counted(self, self.family, self.type, self.proto, fileno=fd)
        self.open += 1
        if socket.getdefaulttimeout() is None and self.gettimeout():
            conn.setblocking(True)
        return conn, address

    def __repr__(self) -> str:
        return f"CappedListener(open={self.open}, cap={self.cap}, refused={self.refused})"
