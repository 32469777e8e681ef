"""grpclib's ``Server``, made to close the connections it accepted when it stops, and to
serve Cortex frames (:mod:`cortex.ledger.frames`) on the same port.

Frames: a connection is sniffed by its first bytes (both protocols have the client speak
first): :data:`~cortex.ledger.frames.PREFACE` makes it a frames call, run with the server's
own handlers, codec and :attr:`GrpcServer.check`; anything else starts HTTP/2 as grpclib
would have at once.

Closing, why: ``grpclib.server.Server.close()`` stops listening and cancels running handlers, but
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
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Any

import grpclib.server
from grpclib.protocol import H2Protocol

from cortex.ledger.frames import PREFACE, Check, ServedCall

if TYPE_CHECKING:
    from grpclib._typing import IServable

__all__ = ["GrpcServer"]

_FLUSH_S = 1.0  # how long a closing connection may take to send what is queued, then abort
_ABORT_S = 1.0  # bound on the wait for aborted connections (the loop reports them at once)


class _Connection(H2Protocol):
    """One accepted connection, reporting to its server: grpclib's HTTP/2 protocol, or a
    frames call, as its first bytes say."""

    def __init__(self, base: H2Protocol, server: GrpcServer) -> None:
        super().__init__(base.handler, base.config, base.h2_config)
        self._server = server
        self.transport: Transport | None = None
        self._head = b""
        self._h2 = False
        self._frames: ServedCall | None = None

    def connection_made(self, transport: BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a stream transport
        self._server._opened(self)  # HTTP/2 starts when the client's first bytes ask for it

    def data_received(self, data: bytes) -> None:
        if self._h2:
            super().data_received(data)
        elif self._frames is not None:
            self._frames.data_received(data)
        else:
            head = self._head + data
            if len(head) < len(PREFACE) and PREFACE.startswith(head):
                self._head = head
                return
            self._head = b""
            assert self.transport is not None
            if head.startswith(PREFACE):
                self._frames = self._server._frames_call(self.transport)
                self._frames.data_received(head[len(PREFACE):])
            else:
                self._h2 = True
                super().connection_made(self.transport)
                super().data_received(head)

    def pause_writing(self) -> None:
        if self._h2:
            super().pause_writing()
        elif self._frames is not None:
            self._frames.pause_writing()

    def resume_writing(self) -> None:
        if self._h2:
            super().resume_writing()
        elif self._frames is not None:
            self._frames.resume_writing()

    def connection_lost(self, exc: BaseException | None) -> None:
        try:
            if self._h2:
                super().connection_lost(exc)
            else:
                self.handler.close()  # grpclib's handler of this connection never ran
                if self._frames is not None:
                    self._frames.connection_lost(exc)
        finally:
            self._server._lost(self)


class GrpcServer(grpclib.server.Server):
    """A grpclib ``Server`` whose :meth:`shutdown` also closes every accepted connection.

    ``await server.start(sock=sock)`` ... ``await server.shutdown()``; the constructor takes
    grpclib's arguments, and ``on_frames_call(method_path)``, told of every frames call
    accepted. ``check``: who may make a frames call (gRPC calls are checked by grpclib's
    event listeners, e.g. :meth:`cortex.ledger.grpc.TokenCheck.install`, which sets both).
    """

    def __init__(self, handlers: Collection[IServable], *,
                 on_frames_call: Callable[[str], None] | None = None, **kwargs: Any) -> None:
        super().__init__(handlers, **kwargs)
        self.check: Check | None = None
        self._on_frames_call = on_frames_call
        self._open: set[_Connection] = set()
        self._none_open = asyncio.Event()
        self._none_open.set()
        self._frames_tasks: set[asyncio.Task[None]] = set()

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

    def _frames_call(self, transport: Transport) -> ServedCall:
        return ServedCall(transport, self._mapping, self._codec, self.check, self._frames_tasks,
                          self._on_frames_call)

    def close(self) -> None:
        super().close()
        for task in self._frames_tasks:
            task.cancel()

    async def wait_closed(self) -> None:
        await super().wait_closed()
        if self._frames_tasks:
            await asyncio.wait(set(self._frames_tasks))

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
