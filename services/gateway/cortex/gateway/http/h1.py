"""The gateway's HTTP/1.1 server: one :class:`asyncio.Protocol` per client connection,
requests parsed by llhttp (``httptools``), each served by the ASGI app in a task of its own.

Why not a general ASGI server: hypercorn (and h11 under it) cost the gateway about as much
Python per request as routing it did — a task group, a read task, an idle task and an h11
event machine per connection; per request a stream object, events built, checked and
dispatched through several coroutine layers, each response header checked by regular
expressions. This server does what the gateway needs and nothing else:

- the request head and body are parsed in C; the app gets the ASGI ``http`` scope
  (lower-case header names, a decoded ``path``) and a ``receive`` that hands it whatever
  arrived of the body; ``Expect: 100-continue`` is answered when the app first reads;
- a response's head is built once (a memo of the header lines found valid before) with its
  own framing: the app's ``Content-Length``, else a chunked body (HTTP/1.1), else the end of
  the connection (HTTP/1.0, which is never kept alive); no body for ``HEAD``, 1xx, 204, 304;
- bytes written in one turn of the event loop go out in one ``send``: a response's head and
  its first event, its last event and the end of the chunked body. They are joined, not
  held: the flush runs right after the step that wrote them, before the loop polls again;
- the :data:`BODY_WRITER` extension writes one piece of a chunked body at once, without the
  ASGI ``send`` coroutine, whenever the client has taken what was sent before;
- requests pipelined on one connection are answered in order (reading pauses while one
  waits); a request whose body was not read to its end closes the connection after its
  answer (the next request's start is not known).

The connection's deadlines (:class:`ConnectionDeadlines`): a new connection gets
``header_timeout_s`` for its first request's headers, the wait between requests
``keep_alive_timeout_s`` (one timer per idle period, none while a request is served); a
connection nothing was read from for ``read_timeout_s`` is closed; a write the client does
not take for ``write_timeout_s`` (it stopped reading) aborts the connection, so the request
sees a disconnect and cancels its upstream call. The peer closing (or a failed read) ends
the connection at once, whatever timer runs: its place under ``server.max_connections``
(:class:`~cortex.gateway.http.listener.CappedListener`) is given back with it. Each deadline
that fires is reported through ``on_timeout`` (``header`` | ``write``).

Refused at once, the connection closed after the answer: a request the parser rejects
(400), a head over ``max_head_bytes`` (431).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Protocol, cast
from urllib.parse import unquote
from wsgiref.handlers import format_date_time

import httptools

from cortex.gateway.errors import ErrorCode, error_body
from cortex.gateway.http.asgi import ASGIApp, Message

__all__ = ["BODY_WRITER", "BodyWriter", "ConnectionBounds", "ConnectionDeadlines",
           "H1Connection", "H1Server", "body_writer", "refusal", "response_head"]

log = logging.getLogger(__name__)

BODY_WRITER = "cortex.body_writer"
"""The ASGI extension (``scope["extensions"]``) of a request: a :data:`BodyWriter` for its
response."""

BodyWriter = Callable[[bytes], bool]
"""``write(data)``: one piece of a streamed response's body sent at once; ``False`` when it
was not (nothing was written: send it with the ASGI ``send``, which waits for the client)."""


def _never(data: bytes) -> bool:
    return False


def body_writer(scope: Mapping[str, Any]) -> BodyWriter:
    """The request's :data:`BODY_WRITER` (one that never writes where there is none: another
    server)."""
    extensions = scope.get("extensions") or {}
    writer: BodyWriter = extensions.get(BODY_WRITER, _never)
    return writer


@dataclass(frozen=True, slots=True)
class ConnectionDeadlines:
    """The deadlines of one connection (s), from ``server.*``."""

    header_timeout_s: float
    keep_alive_timeout_s: float
    write_timeout_s: float
    read_timeout_s: float | None = None


class ConnectionBounds(Protocol):
    """Who admits connections (:class:`~cortex.gateway.http.listener.CappedListener`)."""

    def admit(self, peer: str) -> bytes | None:
        """``None``, or the answer refusing a new connection from ``peer``."""

    def release(self, peer: str) -> None:
        """An admitted connection from ``peer`` closed."""


# ---- the response head ----

_NO_BODY = frozenset((204, 304))
_ASGI = {"version": "3.0", "spec_version": "2.3"}
_REASONS = {status.value: status.phrase.encode("ascii") for status in HTTPStatus}
_TOKEN = frozenset(b"!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyz"
                   b"ABCDEFGHIJKLMNOPQRSTUVWXYZ")
_FORBIDDEN_IN_VALUE = frozenset(b"\r\n\x00")

# what a header line tells the framing: nothing, its length, its connection tokens
_PLAIN, _LENGTH, _CONNECTION, _FRAMING = range(4)
_LINES_KEPT = 4096  # header lines remembered valid (then forgotten all at once)
_lines: dict[tuple[bytes, bytes], tuple[bytes, int]] = {}


def _line(name: bytes, value: bytes) -> tuple[bytes, int]:
    """``name: value\\r\\n`` and its kind; ``ValueError`` for a name that is not an HTTP token
    or a value holding CR, LF or NUL (header injection), whitespace around it stripped."""
    found = _lines.get((name, value))
    if found is not None:
        return found
    if not name or not _TOKEN.issuperset(name):
        raise ValueError(f"invalid response header name {name!r}")
    stripped = value.strip(b" \t")
    if not _FORBIDDEN_IN_VALUE.isdisjoint(stripped):
        raise ValueError(f"invalid value of response header {name!r}")
    lower = name.lower()
    kind = (_LENGTH if lower == b"content-length" else _CONNECTION if lower == b"connection"
            else _FRAMING if lower == b"transfer-encoding" else _PLAIN)
    if kind == _LENGTH and not stripped.isdigit():
        raise ValueError(f"invalid Content-Length {value!r}")
    found = (b"%b: %b\r\n" % (lower, stripped), kind)
    if len(_lines) >= _LINES_KEPT:
        _lines.clear()
    _lines[(name, value)] = found
    return found


_date_second = -1
_date_line = b""


def _date() -> bytes:
    """The ``Date`` line, formatted once per second (its resolution)."""
    global _date_second, _date_line
    second = int(time.time())
    if second != _date_second:
        _date_line = b"date: %b\r\n" % format_date_time(second).encode("ascii")
        _date_second = second
    return _date_line


# how a response's body is framed on the wire
_SIZED, _CHUNKED, _UNTIL_CLOSE, _NONE = range(4)


def response_head(status: int, headers: Iterable[tuple[bytes, bytes]], *, head_only: bool,
                  http_11: bool, keep_alive: bool) -> tuple[bytes, int, int, bool]:
    """The head of a response: (its bytes, its body's framing, the declared length (-1 if
    none), whether the connection stays open after it). ``head_only``: the request was a
    ``HEAD`` (no body follows, whatever the headers say); ``keep_alive``: the request allows
    it. ``ValueError`` for a header that cannot be sent."""
    parts = [b"HTTP/1.1 %d %b\r\n" % (status, _REASONS.get(status, b""))]
    length = -1
    for name, value in headers:
        line, kind = _line(name, value)
        if kind == _PLAIN:
            parts.append(line)
        elif kind == _LENGTH:
            length = int(value)
            parts.append(line)
        elif kind == _CONNECTION:
            if b"close" in value.lower():
                keep_alive = False
        # the app's Transfer-Encoding is dropped: the framing is this server's
    if head_only or status in _NO_BODY or status < 200:
        framing = _NONE
    elif length >= 0:
        framing = _SIZED
    elif http_11:
        framing = _CHUNKED
        parts.append(b"transfer-encoding: chunked\r\n")
    else:
        framing = _UNTIL_CLOSE
        keep_alive = False
    if not http_11:
        keep_alive = False  # as h11: an HTTP/1.0 client gets one answer per connection
    parts.append(_date())
    parts.append(b"\r\n" if keep_alive else b"connection: close\r\n\r\n")
    return b"".join(parts), framing, length, keep_alive


def refusal(status: int, message: str, code: ErrorCode, *,
            retry_after_s: int | None = None) -> bytes:
    """A whole answer the server (or the listener) writes itself before closing the
    connection: the OpenAI error object, ``Retry-After`` when given."""
    body = error_body(status, message, code)
    retry = b"retry-after: %d\r\n" % retry_after_s if retry_after_s is not None else b""
    return (b"HTTP/1.1 %d %b\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
            b"%bconnection: close\r\n\r\n%b"
            % (status, _REASONS[status], len(body), retry, body))


_BAD_REQUEST = refusal(400, "malformed HTTP/1.1 request", ErrorCode.INVALID_REQUEST)
_HEAD_TOO_LARGE = refusal(431, "request headers too large", ErrorCode.HEADERS_TOO_LARGE)
_INTERNAL = refusal(500, "internal error", ErrorCode.INTERNAL_ERROR)
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_BODY_HIGH_WATER = 256 << 10  # request body bytes buffered before reading pauses


# ---- the server ----


class H1Server:
    """What every connection of one listening socket shares: the app, the deadlines, the
    listener's bounds, the open connections (for a graceful shutdown)."""

    def __init__(self, app: ASGIApp, listener: ConnectionBounds, deadlines: ConnectionDeadlines,
                 *, max_head_bytes: int, on_timeout: Callable[[str], None]) -> None:
        self.app = app
        self.listener = listener
        self.deadlines = deadlines
        self.max_head_bytes = max_head_bytes
        self.on_timeout = on_timeout
        self.connections: set[H1Connection] = set()
        self.tasks: set[asyncio.Task[None]] = set()  # the requests being served
        self.closing = False
        self._all_closed: asyncio.Future[None] | None = None

    def connection(self) -> H1Connection:
        """The protocol factory for ``loop.create_server``."""
        return H1Connection(self)

    def opened(self, connection: H1Connection) -> None:
        self.connections.add(connection)

    def closed(self, connection: H1Connection) -> None:
        self.connections.discard(connection)
        if not self.connections and self._all_closed is not None \
                and not self._all_closed.done():
            self._all_closed.set_result(None)

    async def shutdown(self, grace_s: float) -> None:
        """Idle connections close at once, busy ones after their answer; after ``grace_s``
        the rest are cut and the requests still running (an answer's bookkeeping after its
        last byte included) cancelled."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        self.closing = True
        self._all_closed = loop.create_future()
        for connection in list(self.connections):
            connection.shutdown()
        if self.connections:
            try:
                await asyncio.wait_for(asyncio.shield(self._all_closed), grace_s)
            except TimeoutError:
                for connection in list(self.connections):
                    connection.cut()
        if self.tasks:
            _, late = await asyncio.wait(set(self.tasks),
                                         timeout=max(0.0, deadline - loop.time()))
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)

    def __repr__(self) -> str:
        return f"H1Server(connections={len(self.connections)}, closing={self.closing})"


class H1Connection(asyncio.Protocol):
    """One client connection (see the module's docstring)."""

    def __init__(self, server: H1Server) -> None:
        self.server = server
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self._parser = httptools.HttpRequestParser(self)
        self._peer = ""
        self._client: tuple[str, int] | None = None
        self._local: tuple[str, int] | None = None
        self._admitted = False
        self._read_ended = False  # refused, or upgraded: nothing more is read
        self._lost = False
        self._requests = 0
        # the request being parsed
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._head_bytes = 0  # of the head's complete parts (URL, header lines)
        self._in_head = False
        self._head_raw = 0  # bytes read while inside the head (its unfinished parts too)
        self._reading: Cycle | None = None  # the request whose body is arriving
        self._upgrade_body = 0  # body bytes of an Upgrade request still to come (below)
        # the request being answered, those waiting after it
        self.current: Cycle | None = None
        self._waiting: deque[Cycle] = deque()
        # writing
        self._unsent: list[bytes] = []
        self.behind = False  # the client is behind: the transport paused our writing
        self._drained: asyncio.Future[None] | None = None
        self._reading_paused = False
        # deadlines
        self._idle: asyncio.TimerHandle | None = None
        self._read_check: asyncio.TimerHandle | None = None
        self._last_read = 0.0

    # -- asyncio.Protocol --

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self.transport = transport
        peer = transport.get_extra_info("peername")
        self._peer = str(peer[0]) if isinstance(peer, tuple) else str(peer)
        refusal = self.server.listener.admit(self._peer)
        if refusal is not None:
            transport.write(refusal)  # small: fits the empty send buffer
            transport.close()
            return
        self._admitted = True
        self.server.opened(self)
        if isinstance(peer, tuple):
            self._client = (str(peer[0]), int(peer[1]))
        local = transport.get_extra_info("sockname")
        if isinstance(local, tuple):
            self._local = (str(local[0]), int(local[1]))
        now = self.loop.time()
        self._last_read = now
        deadlines = self.server.deadlines
        self._idle = self.loop.call_at(now + deadlines.header_timeout_s, self._idle_expired)
        if deadlines.read_timeout_s is not None:
            self._read_check = self.loop.call_at(now + deadlines.read_timeout_s,
                                                 self._check_read)
        if self.server.closing:
            self.shutdown()

    def data_received(self, data: bytes) -> None:
        if self._upgrade_body:
            self._take_upgrade_body(data)
        if not self._admitted or self._read_ended:
            return
        self._last_read = self.loop.time()
        was_in_head = self._in_head
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade as upgrade:
            # an Upgrade (h2c, websocket) is ignored, as a server may: the request is
            # answered over HTTP/1.1 and the connection closed after it; llhttp stops at
            # its head, so its body (curl --http2 sends one) is taken here, by its length
            self._read_ended = True
            for cycle in (self._reading, self.current, *self._waiting):
                if cycle is not None:
                    cycle.keep_alive = False
            if self._upgrade_body:
                self._take_upgrade_body(data[upgrade.args[0]:])
        except httptools.HttpParserError:
            too_large = self._head_bytes > self.server.max_head_bytes
            self._refuse(_HEAD_TOO_LARGE if too_large else _BAD_REQUEST)
            return
        if was_in_head and self._in_head:
            # httptools holds an unfinished header line until it ends: bound what it holds
            self._head_raw += len(data)
            if self._head_raw > self.server.max_head_bytes:
                self._refuse(_HEAD_TOO_LARGE)

    def _take_upgrade_body(self, data: bytes | memoryview) -> None:
        take = bytes(data[:self._upgrade_body])
        self._upgrade_body -= len(take)
        self._last_read = self.loop.time()
        cycle = self._reading
        if cycle is None:
            return
        if take:
            cycle.arrived(take)
        if not self._upgrade_body:
            self._reading = None
            cycle.complete()

    def eof_received(self) -> bool:
        return False  # the peer closed: the connection ends, whatever is under way

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        for handle in (self._idle, self._read_check):
            if handle is not None:
                handle.cancel()
        self._idle = self._read_check = None
        drained, self._drained = self._drained, None
        if drained is not None and not drained.done():
            drained.set_result(None)
        if self.current is not None:
            self.current.gone()
        for cycle in self._waiting:
            cycle.gone()
        self._waiting.clear()
        if self._admitted:
            self._admitted = False
            self.server.listener.release(self._peer)
            self.server.closed(self)

    def pause_writing(self) -> None:
        self.behind = True

    def resume_writing(self) -> None:
        self.behind = False
        drained, self._drained = self._drained, None
        if drained is not None and not drained.done():
            drained.set_result(None)

    # -- the parser's callbacks --

    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = []
        self._head_bytes = self._head_raw = 0
        self._in_head = True

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._head_bytes += len(url)
        if self._head_bytes > self.server.max_head_bytes:
            raise ValueError("request head too large")

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_bytes += len(name) + len(value) + 4
        if self._head_bytes > self.server.max_head_bytes:
            raise ValueError("request head too large")
        self._headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self._in_head = False
        parser = self._parser
        url = self._url
        if url[:1] == b"/":
            raw_path, _, query = url.partition(b"?")
        else:  # absolute-form (or *)
            parsed = httptools.parse_url(url) if url != b"*" else None
            raw_path = (parsed.path or b"/") if parsed is not None else url
            query = (parsed.query or b"") if parsed is not None else b""
        path = raw_path.decode("latin-1")
        if "%" in path:
            path = unquote(path, encoding="latin-1")
        version = parser.get_http_version()
        cycle = Cycle(self, {
            "type": "http", "asgi": _ASGI, "http_version": version, "scheme": "http",
            "method": parser.get_method().decode("ascii"), "path": path, "raw_path": raw_path,
            "root_path": "", "query_string": query, "headers": self._headers,
            "client": self._client, "server": self._local, "extensions": {},
        }, keep_alive=parser.should_keep_alive(), http_11=version == "1.1")
        if parser.should_upgrade():  # llhttp passes no body of it: taken by its length
            length = next((v for n, v in self._headers if n == b"content-length"), b"0")
            self._upgrade_body = int(length) if length.isdigit() else 0
        self._headers = []
        self._reading = cycle
        if self.current is None:
            self._start(cycle)
        else:
            self._waiting.append(cycle)
            self.pause_reading()

    def on_body(self, body: bytes) -> None:
        if self._reading is not None:
            self._reading.arrived(body)

    def on_message_complete(self) -> None:
        if self._upgrade_body:
            return  # the body of an Upgrade request is still to come
        cycle, self._reading = self._reading, None
        if cycle is not None:
            cycle.complete()

    # -- requests --

    def _start(self, cycle: Cycle) -> None:
        self.current = cycle
        self._requests += 1
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None
        cycle.scope["extensions"][BODY_WRITER] = cycle.write_body
        task = self.loop.create_task(self._serve(cycle))
        tasks = self.server.tasks
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    async def _serve(self, cycle: Cycle) -> None:
        try:
            await self.server.app(cycle.scope, cycle.receive, cycle.send)
        except Exception:
            log.exception("the app failed serving %s %s", cycle.scope["method"],
                          cycle.scope["path"])
        finally:
            if not cycle.ended:
                cycle.abandoned()

    def answered(self, cycle: Cycle) -> None:
        """``cycle``'s response was sent to its end: the next request, or the idle wait."""
        if cycle is not self.current or self._lost:
            return
        self.current = None
        transport = self.transport
        assert transport is not None
        if not cycle.keep_alive or not cycle.received or self.server.closing:
            self.flush()
            transport.close()
            return
        if self._waiting:
            self._start(self._waiting.popleft())
        else:
            self._idle = self.loop.call_at(
                self.loop.time() + self.server.deadlines.keep_alive_timeout_s,
                self._idle_expired)
        if self._reading_paused and not self._waiting:
            self._reading_paused = False
            transport.resume_reading()

    def _refuse(self, answer: bytes) -> None:
        """A request the server answers itself: nothing more is read; the answer goes out
        after the one under way (if any), then the connection closes."""
        transport = self.transport
        assert transport is not None
        self._read_ended = True
        self._reading = None
        self._waiting.clear()
        if self.current is None:
            self.write(answer)
            self.flush()
            transport.close()
        else:
            self.current.keep_alive = False
            self.pause_reading()

    def pause_reading(self) -> None:
        if not self._reading_paused and self.transport is not None and not self._lost:
            self._reading_paused = True
            self.transport.pause_reading()

    def body_taken(self) -> None:
        """The app read the body buffered so far: reading may go on."""
        if self._reading_paused and not self._waiting and not self._lost:
            self._reading_paused = False
            assert self.transport is not None
            self.transport.resume_reading()

    # -- deadlines --

    def _idle_expired(self) -> None:
        self._idle = None
        if self.current is not None or self._lost:
            return
        if self._requests == 0:
            self.server.on_timeout("header")
        assert self.transport is not None
        self.transport.close()

    def _check_read(self) -> None:
        limit = self.server.deadlines.read_timeout_s
        assert limit is not None and self.transport is not None
        due = self._last_read + limit
        if self.loop.time() >= due:
            self._read_check = None
            self.transport.close()
        else:
            self._read_check = self.loop.call_at(due, self._check_read)

    def shutdown(self) -> None:
        """The server is stopping: an idle connection closes now, a busy one after its
        answer."""
        if self.current is None and self.transport is not None:
            self.transport.close()

    def cut(self) -> None:
        """Past the grace period: the connection aborted (its request sees a disconnect;
        the server cancels what is still running)."""
        if self.transport is not None:
            self.transport.abort()

    # -- writing --

    def write(self, data: bytes) -> None:
        """``data`` sent with whatever else this turn of the loop writes, in its flush."""
        if not self._unsent:
            self.loop.call_soon(self.flush)
        self._unsent.append(data)

    def write_now(self, data: bytes) -> bool:
        """``data`` written without waiting, when the client has taken everything sent
        before (after what this turn of the loop wrote, in its flush); ``False`` (nothing
        written) when it has not."""
        transport = self.transport
        if (transport is None or self.behind or transport.is_closing()
                or transport.get_write_buffer_size()):
            return False
        if self._unsent:
            self._unsent.append(data)
        else:
            transport.write(data)
        return True

    def flush(self) -> None:
        """Write what this turn of the loop produced, in one piece."""
        unsent, self._unsent = self._unsent, []
        transport = self.transport
        if not unsent or transport is None or transport.is_closing():
            return
        transport.write(unsent[0] if len(unsent) == 1 else b"".join(unsent))

    async def drain(self) -> None:
        """Wait until the client took enough of what was written (within the write
        deadline: past it the connection is aborted)."""
        if not self.behind or self._lost:
            return
        if self._drained is None:
            self._drained = self.loop.create_future()
        try:
            async with asyncio.timeout(self.server.deadlines.write_timeout_s):
                await asyncio.shield(self._drained)
        except TimeoutError:
            self.server.on_timeout("write")
            assert self.transport is not None
            self.transport.abort()  # drops the unsent bytes; the request sees a disconnect

    def __repr__(self) -> str:
        return (f"H1Connection(peer={self._peer!r}, requests={self._requests}, "
                f"busy={self.current is not None}, waiting={len(self._waiting)}, "
                f"lost={self._lost})")


class Cycle:
    """One request/response cycle of a connection: the ASGI ``receive`` and ``send`` of its
    app call."""

    __slots__ = ("_body", "_buffered", "_complete", "_connection", "_continue", "_delivered",
                 "_framing", "_gone", "_head_only", "_http_11", "_length", "_sent",
                 "_waiter", "ended", "keep_alive", "scope", "started")

    def __init__(self, connection: H1Connection, scope: dict[str, Any], *, keep_alive: bool,
                 http_11: bool) -> None:
        self._connection = connection
        self.scope = scope
        self.keep_alive = keep_alive
        self._http_11 = http_11
        self._head_only = scope["method"] == "HEAD"
        self._body: list[bytes] = []
        self._buffered = 0
        self._complete = False  # the whole body arrived
        self._delivered = False  # ... and was handed to the app
        self._gone = False  # the connection was lost
        self._waiter: asyncio.Future[None] | None = None
        self._continue = self._http_11 and any(
            name == b"expect" and value.lower() == b"100-continue"
            for name, value in scope["headers"])
        self.started = False
        self.ended = False
        self._framing = _NONE
        self._length = -1
        self._sent = 0

    @property
    def received(self) -> bool:
        """The request's body arrived to its end (the next request can be read)."""
        return self._complete

    # -- from the connection --

    def arrived(self, body: bytes) -> None:
        self._body.append(body)
        self._buffered += len(body)
        if self._buffered > _BODY_HIGH_WATER:
            self._connection.pause_reading()
        self._wake()

    def complete(self) -> None:
        self._complete = True
        self._wake()

    def gone(self) -> None:
        self._gone = True
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    # -- ASGI --

    async def receive(self) -> Message:
        while True:
            if self._gone:
                return {"type": "http.disconnect"}
            if self._body or (self._complete and not self._delivered):
                body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
                self._body = []
                self._buffered = 0
                self._delivered = self._complete
                self._connection.body_taken()
                return {"type": "http.request", "body": body, "more_body": not self._complete}
            if self.ended and self._delivered:
                return {"type": "http.disconnect"}  # the cycle is over
            if self._continue and not self.started:
                self._continue = False
                self._connection.write(_CONTINUE)
            waiter = self._waiter = self._connection.loop.create_future()
            await waiter

    async def send(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.body":
            if not self.started or self.ended:
                raise RuntimeError("http.response.body outside a response")
            more = message.get("more_body", False)
            self._body_part(message.get("body", b""), more)
            if not more:
                self._end()
            elif self._connection.behind:
                await self._connection.drain()
        elif kind == "http.response.start":
            if self.started:
                raise RuntimeError("http.response.start sent twice")
            # an answer before the whole request arrived ends the connection (where the
            # next request starts is unknown): the client is told so
            head, self._framing, self._length, self.keep_alive = response_head(
                message["status"], message.get("headers", ()), head_only=self._head_only,
                http_11=self._http_11, keep_alive=self.keep_alive and self._complete)
            self.started = True
            self._continue = False
            if not self._gone:
                self._connection.write(head)
        else:
            raise RuntimeError(f"unexpected ASGI message {kind!r}")

    def _body_part(self, data: bytes, more: bool) -> None:
        if self._gone:
            return
        framing = self._framing
        connection = self._connection
        if framing == _CHUNKED:
            if data:
                connection.write(b"%x\r\n%b\r\n" % (len(data), data))
            if not more:
                connection.write(b"0\r\n\r\n")
        elif framing == _SIZED:
            self._sent += len(data)
            if self._sent > self._length:
                raise RuntimeError("response body longer than its Content-Length")
            if data:
                connection.write(data)
        elif framing == _UNTIL_CLOSE and data:
            connection.write(data)

    def _end(self) -> None:
        self.ended = True
        if self._framing == _SIZED and self._sent != self._length and not self._gone:
            self._cut()  # a truncated answer must not look complete
            return
        if self._framing == _UNTIL_CLOSE:
            self.keep_alive = False
        self._wake()
        self._connection.answered(self)

    def write_body(self, data: bytes) -> bool:
        """A :data:`BodyWriter`: ``data`` as one chunk of the chunked body under way."""
        if (not data or self._framing != _CHUNKED or self.ended or self._gone
                or self._connection.current is not self):
            return False
        return self._connection.write_now(b"%x\r\n%b\r\n" % (len(data), data))

    def abandoned(self) -> None:
        """The app returned (or failed) without ending its response."""
        self.ended = True
        if self._gone:
            self._connection.answered(self)
            return
        if not self.started:
            self.keep_alive = False
            self._connection.write(_INTERNAL)
            self._connection.answered(self)
        else:
            self._cut()

    def _cut(self) -> None:
        connection = self._connection
        connection.flush()
        if connection.transport is not None:
            connection.transport.abort()

    def __repr__(self) -> str:
        return (f"Cycle({self.scope['method']} {self.scope['path']}, "
                f"started={self.started}, ended={self.ended}, gone={self._gone})")

