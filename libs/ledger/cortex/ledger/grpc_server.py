"""grpclib's ``Server``, made to close the connections it accepted when it stops.

Why: ``grpclib.server.Server.close()`` stops listening and cancels running handlers, but
leaves accepted connections open until each client hangs up (Python 3.11's
``asyncio.Server`` does not track them), and new calls on them are still served. A client
that outlives the server (another service, a test's channel closed after the server) then
talks to a stopped server, and a transport still open when its event loop closes is
reported as an unclosed-transport ``ResourceWarning`` when it is collected: random test
failures where warnings are errors.
"""

from __future__ import annotations

import asyncio
import contextlib
from asyncio import BaseTransport, Transport
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

import grpclib.server
from grpclib.protocol import H2Protocol

if TYPE_CHECKING:
    from grpclib._typing import IServable

__all__ = ["GrpcServer"]

_FLUSH_S = 1.0  # how long a closing connection may take to send what is queued, then abort
_ABORT_S = 1.0  # bound on the wait for aborted connections (the loop reports them at once)


class _Connection(H2Protocol):
    """grpclib's HTTP/2 protocol for one accepted connection, reporting to its server."""

    def __init__(self, base: H2Protocol, server: GrpcServer) -> None:
        super().__init__(base.handler, base.config, base.h2_config)
        self._server = server
        self.transport: Transport | None = None

    def connection_made(self, transport: BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a stream transport
        self._server._opened(self)
        super().connection_made(transport)

    def connection_lost(self, exc: BaseException | None) -> None:
        try:
            super().connection_lost(exc)
        finally:
            self._server._lost(self)


class GrpcServer(grpclib.server.Server):
    """A grpclib ``Server`` whose :meth:`shutdown` also closes every accepted connection.

    ``await server.start(sock=sock)`` ... ``await server.shutdown()``; the constructor takes
    grpclib's arguments.
    """

    def __init__(self, handlers: Collection[IServable], **kwargs: Any) -> None:
        super().__init__(handlers, **kwargs)
        self._open: set[_Connection] = set()
        self._none_open = asyncio.Event()
        self._none_open.set()

    def __repr__(self) -> str:
        return f"GrpcServer(connections={len(self._open)})"

    @property
    def connections(self) -> int:
        """Accepted connections still open."""
        return len(self._open)

    def _protocol_factory(self) -> H2Protocol:
        # grpclib's factory registers the connection's request handler (which close()
        # cancels); the protocol is rebuilt from the same parts to hear of connection loss
        return _Connection(super()._protocol_factory(), self)

    def _opened(self, connection: _Connection) -> None:
        self._open.add(connection)
        self._none_open.clear()

    def _lost(self, connection: _Connection) -> None:
        self._open.discard(connection)
        if not self._open:
            self._none_open.set()

    async def close_connections(self, flush_s: float = _FLUSH_S) -> None:
        """Close every accepted connection: what is queued gets up to ``flush_s`` seconds
        to go out, then the rest are aborted. Returns once they are all gone."""
        for connection in list(self._open):
            if connection.transport is not None:
                connection.transport.close()
        # asyncio.timeout, not wait_for: on Python 3.11 wait_for drops a cancellation that
        # lands as the awaited event is set
        try:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(flush_s):
                    await self._none_open.wait()
        finally:  # also when cancelled: no socket outlives this call for long
            for connection in list(self._open):
                if connection.transport is not None:
                    connection.transport.abort()
        # abort() reports the loss on the next loop iteration
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(_ABORT_S):
                await self._none_open.wait()

    async def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop listening, cancel running handlers, close every accepted connection, and
        wait (at most ``timeout_s`` seconds) for the handlers to end."""
        self.close()
        try:
            await self.close_connections()
        finally:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout_s):
                    await self.wait_closed()
