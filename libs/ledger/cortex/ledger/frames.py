"""Cortex frames: the ``Index`` methods between Cortex's own processes, without HTTP/2.

Why: grpclib's HTTP/2 costs ~80 µs of Python per message at each end (h2's state machine,
its frames, window updates, a task switch per message), and the ledger pipeline sends a few
messages per routed request on every hop — ingest → index (Sync), index → every gateway
(Replicate). Framed by hand, a message costs a header, a write and one wake-up.

The index's own port speaks both (:class:`~cortex.ledger.grpc_server.GrpcServer` sniffs a
connection's first bytes): a connection that opens with :data:`PREFACE` speaks frames,
anything else HTTP/2 (gRPC) as before. One call per connection. Every frame is a 4-byte
big-endian body length, a kind byte (:class:`Kind`) and the body:

- ``CALL`` (client, first): the method's path, ``\\n``, the ``authorization`` value (may be
  empty);
- ``MESSAGE`` (either way): one encoded protobuf message;
- ``END`` (client): no more messages (a unary call's request is followed by it);
- ``STATUS`` (server, last): a gRPC status code byte and its message (UTF-8); ``OK`` ends
  the call.

The server answers :data:`PREFACE` once it has read ``CALL``, before anything else: a peer
that answers otherwise is not a Cortex index speaking frames (an older index, or a proxy
that only passes HTTP/2), and the client raises :class:`FramesRefused` so that its caller
can fall back to gRPC. Messages go through the same codec as on gRPC (``LedgerCodec``: a
message over its bound is refused from its header, ``RESOURCE_EXHAUSTED``; one that does
not parse is ``INVALID_ARGUMENT``), and the server runs the same handlers, with the same
token check.

:class:`FramesChannel` mirrors the part of grpclib's ``Channel`` that Cortex's streams use
(``request(...)`` as an async context manager with ``send_request``, ``send_message``,
``recv_message``, ``end``); :class:`ServedCall` is the server's end of one call.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import socket
import struct
from collections.abc import Callable, Mapping
from enum import IntEnum
from types import TracebackType
from typing import Any, Protocol, cast

from grpclib.const import Handler, Status
from grpclib.encoding.base import CodecBase
from grpclib.exceptions import GRPCError, ProtocolError, StreamTerminatedError

__all__ = ["PREFACE", "CallStream", "FrameReader", "FramesCall", "FramesChannel",
           "FramesRefused", "Kind", "ServedCall", "frame"]

log = logging.getLogger(__name__)

PREFACE = b"\xc3CORTEX1"
"""A frames connection's first bytes, each way (no HTTP/2 client preface begins so)."""

_HEADER = struct.Struct(">IB")
_INBOX_FRAMES = 64  # frames read ahead of the consumer before the socket stops being read
_CALL_LIMIT = 16 << 10  # bytes before a call is named: a method path and a token
_LINGER_S = 5.0  # a call's end waits this long for the client to close, then aborts
_DEFAULT_LIMIT = 64 << 20


class Kind(IntEnum):
    CALL = 1
    MESSAGE = 2
    END = 3
    STATUS = 4


class FramesRefused(ProtocolError):
    """The peer did not answer the frames preface: it speaks gRPC only. The caller should
    use gRPC for this target."""


class FrameTooLarge(Exception):
    """A frame's header announced a body over the reader's bound (bytes)."""

    def __init__(self, length: int, limit: int) -> None:
        super().__init__(f"message of {length} bytes exceeds {limit}")


def frame(kind: Kind, body: bytes = b"") -> bytes:
    """One frame's bytes."""
    return _HEADER.pack(len(body), kind) + body


class FrameReader:
    """Frames out of a byte stream (sans I/O): ``feed(data)`` returns the frames completed
    by ``data``. A body longer than ``limit`` bytes raises :class:`FrameTooLarge` from its
    header, before it is buffered; an unknown kind raises ``ProtocolError``."""

    def __init__(self, limit: int = _DEFAULT_LIMIT) -> None:
        self.limit = limit  # bytes; may change between feeds
        self._buffer = bytearray()

    def __repr__(self) -> str:
        return f"FrameReader(buffered={len(self._buffer)}, limit={self.limit})"

    def feed(self, data: bytes) -> list[tuple[Kind, bytes]]:
        buffer = self._buffer
        buffer += data
        frames: list[tuple[Kind, bytes]] = []
        at = 0
        while len(buffer) - at >= _HEADER.size:
            length, kind = _HEADER.unpack_from(buffer, at)
            if length > self.limit:
                raise FrameTooLarge(length, self.limit)
            if not Kind.CALL <= kind <= Kind.STATUS:
                raise ProtocolError(f"unknown frame kind {kind}")
            end = at + _HEADER.size + length
            if len(buffer) < end:
                break
            frames.append((Kind(kind), bytes(buffer[at + _HEADER.size:end])))
            at = end
        del buffer[:at]
        return frames


class _Pipe:
    """One end's flow control: frames read ahead of the consumer (reading pauses past
    :data:`_INBOX_FRAMES`), and writes that wait while the transport's buffer is full."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self.inbox: collections.deque[tuple[Kind, bytes]] = collections.deque()
        self.lost: BaseException | None = None
        self.closed = False
        self._arrived: asyncio.Future[None] | None = None
        self._drained: asyncio.Future[None] | None = None
        self._reading_paused = False
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def put(self, frames: list[tuple[Kind, bytes]]) -> None:
        self.inbox.extend(frames)
        if len(self.inbox) >= _INBOX_FRAMES and not self._reading_paused:
            self._reading_paused = True
            self.transport.pause_reading()
        self._wake_reader()

    async def get(self) -> tuple[Kind, bytes] | None:
        """The next frame; None once the connection is gone and the inbox empty."""
        while not self.inbox:
            if self.closed:
                return None
            self._arrived = asyncio.get_running_loop().create_future()
            try:
                await self._arrived
            finally:
                self._arrived = None
        if self._reading_paused and len(self.inbox) <= _INBOX_FRAMES // 2:
            self._reading_paused = False
            self.transport.resume_reading()
        return self.inbox.popleft()

    async def write(self, *parts: bytes) -> None:
        if self.closed:
            raise StreamTerminatedError("connection lost")
        self.transport.writelines(parts)
        if self._drained is not None:
            await asyncio.shield(self._drained)

    def pause_writing(self) -> None:
        if self._drained is None:
            self._drained = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        drained, self._drained = self._drained, None
        if drained is not None and not drained.done():
            drained.set_result(None)

    def close(self, exc: BaseException | None) -> None:
        self.closed = True
        self.lost = exc
        self._wake_reader()
        self.resume_writing()

    def _wake_reader(self) -> None:
        if self._arrived is not None and not self._arrived.done():
            self._arrived.set_result(None)


# ---- the server's end -----------------------------------------------------------------------

Check = Callable[[str, str | None], bool]
"""``check(method_path, authorization)``: whether the call may run."""


class ServedCall:
    """The server's end of one frames call, fed by the connection's protocol (which owns
    the transport and has read the client's preface): ``data_received`` /
    ``connection_lost`` / ``pause_writing`` / ``resume_writing``. It reads ``CALL`` (at most
    :data:`_CALL_LIMIT` bytes), answers the preface, checks the call, runs the method's
    handler in a task (added to ``tasks`` while it runs) with itself as the stream, and
    ends with ``STATUS`` and closing the connection. ``started(method_path)`` hears of
    every call whose handler runs."""

    def __init__(self, transport: asyncio.Transport, mapping: Mapping[str, Handler],
                 codec: CodecBase, check: Check | None, tasks: set[asyncio.Task[None]],
                 started: Callable[[str], None] | None = None) -> None:
        self._pipe = _Pipe(transport)
        self._mapping = mapping
        self._codec = codec
        self._check = check
        self._tasks = tasks
        self._started = started
        self._limit = getattr(codec, "max_message_bytes", _DEFAULT_LIMIT)
        self._reader = FrameReader(_CALL_LIMIT)
        self._greeted = False
        self._handler: Handler | None = None
        self._task: asyncio.Task[None] | None = None
        self._ended = False
        self._linger: asyncio.TimerHandle | None = None
        self.method = ""

    def __repr__(self) -> str:
        return f"ServedCall(method={self.method!r}, running={self._task is not None})"

    # ---- protocol callbacks (from the connection) -------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self._ended:
            return
        try:
            frames = self._reader.feed(data)
        except FrameTooLarge as exc:
            self._refuse(Status.RESOURCE_EXHAUSTED, str(exc))
            return
        except ProtocolError as exc:
            self._refuse(Status.INTERNAL, str(exc))
            return
        if frames and self._handler is None:
            kind, body = frames.pop(0)
            if kind is not Kind.CALL:
                self._refuse(Status.INTERNAL, "the first frame must be CALL")
                return
            if not self._start(body):
                return
        if frames:
            self._pipe.put(frames)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._pipe.close(exc)
        if self._linger is not None:
            self._linger.cancel()
        if self._task is not None and not self._task.done():
            self._task.cancel()

    def pause_writing(self) -> None:
        self._pipe.pause_writing()

    def resume_writing(self) -> None:
        self._pipe.resume_writing()

    # ---- the stream the handler is given ------------------------------------------------------

    async def recv_message(self) -> Any:
        """The next request message; None after ``END`` or when the client went away."""
        assert self._handler is not None
        got = await self._pipe.get()
        if got is None or got[0] is Kind.END:
            return None
        kind, body = got
        if kind is not Kind.MESSAGE:
            raise GRPCError(Status.INTERNAL, f"unexpected {kind.name} frame")
        return self._codec.decode(body, self._handler.request_type)

    def __aiter__(self) -> ServedCall:
        return self

    async def __anext__(self) -> Any:
        message = await self.recv_message()
        if message is None:
            raise StopAsyncIteration
        return message

    async def send_message(self, message: Any) -> None:
        assert self._handler is not None
        data = self._codec.encode(message, self._handler.reply_type)
        await self._pipe.write(_HEADER.pack(len(data), Kind.MESSAGE), data)

    # ---- the call -----------------------------------------------------------------------------

    def _start(self, body: bytes) -> bool:
        """Greet, then run the named method or refuse it; whether it runs. The preface goes
        out only now, so nothing the client sends after it can share a read with ``CALL``:
        until then a frame may be :data:`_CALL_LIMIT` bytes, then the codec's bound."""
        self._greet()
        path, _, authorization = body.decode("utf-8", "replace").partition("\n")
        self.method = path
        handler = self._mapping.get(path)
        if handler is None:
            self._refuse(Status.UNIMPLEMENTED, "Method not found")
            return False
        if self._check is not None and not self._check(path, authorization or None):
            self._refuse(Status.UNAUTHENTICATED,
                         "a valid token is required for " + path.rsplit("/", 1)[-1])
            return False
        self._handler = handler
        self._reader.limit = self._limit
        if self._started is not None:
            self._started(path)
        self._task = asyncio.get_running_loop().create_task(self._run(handler),
                                                            name=f"frames {path}")
        self._tasks.add(self._task)
        self._task.add_done_callback(self._tasks.discard)
        return True

    def _greet(self) -> None:
        if not self._greeted:
            self._greeted = True
            self._pipe.transport.write(PREFACE)

    async def _run(self, handler: Handler) -> None:
        try:
            await handler.func(self)
        except GRPCError as exc:
            self._end(exc.status, exc.message or "")
        except (StreamTerminatedError, ConnectionError):
            self._pipe.transport.abort()
        except Exception:
            log.exception("frames call %s failed", self.method)
            self._end(Status.UNKNOWN, "Internal Server Error")
        else:
            self._end(Status.OK, "")

    def _refuse(self, status: Status, message: str) -> None:
        self._greet()  # a status, not a refused preface: the client asked for frames
        self._end(status, message)
        self._pipe.close(None)
        if self._task is not None:
            self._task.cancel()  # the call is over: its handler sends nothing more

    def _end(self, status: Status, message: str) -> None:
        """Send the status and half-close; what the client still sends is read and dropped
        until it closes (closing with unread bytes would reset the connection, and the
        status could be lost with it), at most :data:`_LINGER_S`."""
        transport = self._pipe.transport
        if self._ended or transport.is_closing():
            return
        self._ended = True
        transport.write(frame(Kind.STATUS, bytes([status.value]) + message.encode()))
        if transport.can_write_eof():
            transport.write_eof()
            transport.resume_reading()
            self._linger = asyncio.get_running_loop().call_later(_LINGER_S, transport.abort)
        else:
            transport.close()


# ---- the client's end -----------------------------------------------------------------------


class CallStream(Protocol):
    """What Cortex's clients use of a call: a grpclib client ``Stream`` or a
    :class:`FramesCall`."""

    async def send_request(self) -> None: ...

    async def send_message(self, message: Any, *, end: bool = False) -> None: ...

    async def recv_message(self) -> Any: ...

    async def end(self) -> None: ...


class _Client(asyncio.Protocol):
    """The client's protocol: the peer's preface first, then frames into the pipe."""

    def __init__(self, limit: int) -> None:
        self.pipe: _Pipe | None = None
        self.greeted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._head = b""
        self._reader = FrameReader(limit)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.pipe = _Pipe(cast(asyncio.Transport, transport))  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        assert self.pipe is not None
        if not self.greeted.done():
            self._head += data
            if len(self._head) < len(PREFACE) and PREFACE.startswith(self._head):
                return
            if not self._head.startswith(PREFACE):
                self.greeted.set_exception(FramesRefused(
                    "the index did not answer Cortex frames (it speaks gRPC only)"))
                self.pipe.transport.abort()
                return
            self.greeted.set_result(None)
            data, self._head = self._head[len(PREFACE):], b""
        try:
            self.pipe.put(self._reader.feed(data))
        except (FrameTooLarge, ProtocolError) as exc:
            self.pipe.close(exc)
            self.pipe.transport.abort()

    def connection_lost(self, exc: BaseException | None) -> None:
        if not self.greeted.done():
            self.greeted.set_exception(StreamTerminatedError(
                "the index closed the connection before answering"))
        if self.pipe is not None:
            self.pipe.close(exc)

    def pause_writing(self) -> None:
        assert self.pipe is not None
        self.pipe.pause_writing()

    def resume_writing(self) -> None:
        assert self.pipe is not None
        self.pipe.resume_writing()


class FramesCall:
    """One call (``async with channel.request(...) as call``); errors are grpclib's:
    ``GRPCError`` for a status other than OK, ``StreamTerminatedError`` for a connection
    that ended without one, ``OSError`` when the index cannot be reached."""

    def __init__(self, channel: FramesChannel, path: str, request_type: Any, reply_type: Any,
                 authorization: str) -> None:
        self._channel = channel
        self._path = path
        self._request_type = request_type
        self._reply_type = reply_type
        self._authorization = authorization
        self._protocol: _Client | None = None
        self._ended = False

    def __repr__(self) -> str:
        return f"FramesCall({self._path!r}, open={self._protocol is not None})"

    async def __aenter__(self) -> FramesCall:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        protocol, self._protocol = self._protocol, None
        if protocol is not None and protocol.pipe is not None:
            protocol.pipe.transport.close()
        self._channel.calls.discard(self)

    async def send_request(self) -> None:
        """Connect, name the method, and wait for the index's preface."""
        if self._protocol is not None:
            return
        codec = self._channel.codec
        limit = getattr(codec, "max_message_bytes", _DEFAULT_LIMIT)
        loop = asyncio.get_running_loop()
        _, protocol = await loop.create_connection(lambda: _Client(limit),
                                                   self._channel.host, self._channel.port)
        self._protocol = protocol
        self._channel.calls.add(self)
        assert protocol.pipe is not None
        call = f"{self._path}\n{self._authorization}".encode()
        await protocol.pipe.write(PREFACE, frame(Kind.CALL, call))
        await protocol.greeted

    async def send_message(self, message: Any, *, end: bool = False) -> None:
        pipe = await self._pipe()
        data = self._channel.codec.encode(message, self._request_type)
        if end:
            self._ended = True
            await pipe.write(_HEADER.pack(len(data), Kind.MESSAGE), data, frame(Kind.END))
        else:
            await pipe.write(_HEADER.pack(len(data), Kind.MESSAGE), data)

    async def end(self) -> None:
        if not self._ended:
            self._ended = True
            await (await self._pipe()).write(frame(Kind.END))

    async def recv_message(self) -> Any:
        """The next reply; None when the call ended with OK."""
        pipe = await self._pipe()
        got = await pipe.get()
        if got is None:
            if isinstance(pipe.lost, FrameTooLarge):
                raise GRPCError(Status.RESOURCE_EXHAUSTED, str(pipe.lost))
            raise StreamTerminatedError("the index closed the connection")
        kind, body = got
        if kind is Kind.MESSAGE:
            return self._channel.codec.decode(body, self._reply_type)
        if kind is Kind.STATUS and body:
            status = Status(body[0])
            if status is Status.OK:
                return None
            raise GRPCError(status, body[1:].decode("utf-8", "replace"))
        raise ProtocolError(f"unexpected {kind.name} frame from the index")

    async def _pipe(self) -> _Pipe:
        if self._protocol is None:
            await self.send_request()
        assert self._protocol is not None and self._protocol.pipe is not None
        return self._protocol.pipe


class FramesChannel:
    """Calls to one index over frames (``request`` mirrors grpclib's ``Channel.request``;
    the cardinality is the server's business). ``close`` closes every open call."""

    def __init__(self, host: str, port: int, *, codec: CodecBase) -> None:
        self.host = host
        self.port = port
        self.codec = codec
        self.calls: set[FramesCall] = set()

    def __repr__(self) -> str:
        return f"FramesChannel({self.host}:{self.port}, calls={len(self.calls)})"

    def request(self, path: str, cardinality: Any, request_type: Any, reply_type: Any, *,
                metadata: Mapping[str, str] | None = None) -> FramesCall:
        del cardinality
        authorization = (metadata or {}).get("authorization", "")
        return FramesCall(self, path, request_type, reply_type, authorization)

    def close(self) -> None:
        for call in list(self.calls):
            call.close()

    async def __aenter__(self) -> FramesChannel:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
