"""Admission control: a concurrency limit with a bounded FIFO queue (sglang-router's
``--max-concurrent-requests`` / ``--queue-size`` / ``--queue-timeout-secs``).

At most ``max_concurrent`` inference requests are in service in this process; up to
``queue_size`` more wait, first come first served, at most ``queue_timeout_s`` seconds. A
request finding the queue full is refused at once (429 ``queue_full``), one that waited too
long gets 503 ``queue_timeout``; both carry ``Retry-After``. Waiting happens before the body
is read, so the memory of queued requests stays in the sockets.

One client connection: hypercorn's TCP server with the gateway's connection deadlines.
hypercorn keeps a connection's keep-alive timer running after the peer closed it before a
request: the socket then sits in CLOSE-WAIT, holding its place under
``server.max_connections``, until the timer fires (75 s) — about 55 connects a second kept
every client out. Here:

- the peer closing (or a failed read) ends the connection at once, whatever timer runs;
- a new connection gets ``header_timeout_s`` for its first request's headers (the
  keep-alive timer applies between requests), then is closed without an answer;
- a write the client does not take for ``write_timeout_s`` (it stopped reading) aborts the
  connection: the request sees a disconnect and cancels its upstream call;
- bytes written in one turn of the event loop go out in one ``send``: a response's headers
  and its first event, its last event and the end of the chunked body. They are joined, not
  held: the flush runs right after the step that wrote them, before the loop polls again.
- the header and keep-alive deadlines are one task per connection whose deadline moves
  (:class:`IdleWatch`), not a task made and cancelled per request;
- HTTP/1.1 is h11 through :class:`LeanH11Connection`: h11 checks every header of a response
  against its grammar when the response event is built, then again, all of them, each time
  it sets a framing header (``Content-Length`` cleared and ``Transfer-Encoding: chunked``
  set for a stream: two more passes over a dozen headers: ``x-request-id``, the
  ``x-cortex-*`` decision headers, the SSE ones); this one checks them once, its framing
  step editing the checked headers and adding only its own constant ones, and
  :class:`LeanH11Protocol` (hypercorn's, over it) checks them through a memo of the lines
  found valid before (:func:`checked_headers`). The bytes sent and the headers refused are
  h11's (``tests/gateway/http/test_admission_wire.py`` compares both).
  :class:`CachedDateConfig` formats the ``Date`` header once per second (its resolution),
  not per response.
- a streamed answer's events can skip the ASGI ``send`` (hypercorn's stream, h11's event
  machinery, a coroutine chain: a dozen calls and objects per event): the request's
  :data:`BODY_WRITER` extension writes one piece of a chunked body at once, in h11's
  framing, whenever the client has taken what was sent before; otherwise (the client is
  behind, the answer is not a chunked body under way) it writes nothing and says so, and
  the ``send`` that waits for the client takes the piece.

Each deadline that fires is reported through ``on_timeout`` (``header`` | ``write``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from ssl import SSLError
from typing import Any, cast
from wsgiref.handlers import format_date_time

import h11
from h11._connection import _body_framing
from h11._headers import Headers, get_comma_header, normalize_and_validate
from h11._writers import ChunkedWriter
from hypercorn.asyncio.task_group import TaskGroup
from hypercorn.asyncio.tcp_server import MAX_RECV, TCPServer
from hypercorn.config import Config as HypercornConfig
from hypercorn.events import Closed, Event, RawData, Updated
from hypercorn.protocol.events import Event as StreamEvent
from hypercorn.protocol.events import Response as HypercornResponse
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.protocol.http_stream import HTTPStream

from cortex.gateway.config.gateway import AdmissionConfig
from cortex.gateway.errors import ErrorCode, ServiceUnavailable

__all__ = ["BODY_WRITER", "Admission", "BodyWriter", "CachedDateConfig", "ConnectionDeadlines",
           "GuardedConnection", "IdleWatch", "LeanH11Connection", "LeanH11Protocol",
           "body_writer", "checked_headers"]

BODY_WRITER = "cortex.body_writer"
"""The ASGI extension (``scope["extensions"]``) of a request on an HTTP/1.1 connection: a
:data:`BodyWriter` for its response."""

BodyWriter = Callable[[bytes], bool]
"""``write(data)``: one piece of a streamed response's body sent at once; ``False`` when it
was not (nothing was written: send it with the ASGI ``send``, which waits for the client)."""


def _never(data: bytes) -> bool:
    return False


def body_writer(scope: Mapping[str, Any]) -> BodyWriter:
    """The request's :data:`BODY_WRITER` (one that never writes where there is none: HTTP/2,
    another server)."""
    extensions = scope.get("extensions") or {}
    writer: BodyWriter = extensions.get(BODY_WRITER, _never)
    return writer


# ---- connection ----


@dataclass(frozen=True, slots=True)
class ConnectionDeadlines:
    """The deadlines of one connection (s), from ``server.*``."""

    header_timeout_s: float
    keep_alive_timeout_s: float
    write_timeout_s: float


class GuardedConnection(TCPServer):
    """``await GuardedConnection(..., deadlines=..., on_timeout=...)`` serves one connection
    (hypercorn's arguments first) until it closes."""

    def __init__(self, *args: object, deadlines: ConnectionDeadlines,
                 on_timeout: Callable[[str], None]) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        self.deadlines = deadlines
        self._on_timeout = on_timeout
        self._requests = 0
        self._read_ended = False
        self._unsent: list[bytes] = []  # written this turn of the loop, flushed at its end
        self.idle_task = IdleWatch(self)  # type: ignore[assignment]

    async def _read_data(self) -> None:
        """hypercorn's read loop, its ``read_timeout`` one deadline moved at each read
        (hypercorn wraps every read in ``wait_for``: a task and a timer per read)."""
        self._lean_h11()
        limit = self.config.read_timeout
        loop = self.loop
        try:
            async with asyncio.timeout(None) as silence:
                while not self.reader.at_eof():
                    if limit is not None:
                        silence.reschedule(loop.time() + limit)
                    try:
                        data = await self.reader.read(MAX_RECV)
                    except (ConnectionError, OSError, SSLError):
                        break
                    silence.reschedule(None)  # the protocol's turn is not the peer's silence
                    await self.protocol.handle(RawData(data))
        except TimeoutError:
            pass
        await self.protocol.handle(Closed())
        # nothing more can arrive: no timer may keep the socket (and its place) open
        self._read_ended = True
        await self._idle_watch.end()

    def _lean_h11(self) -> None:
        """Serve HTTP/1.1 with :class:`LeanH11Protocol` (nothing was read yet: the protocol
        hypercorn made is fresh; an HTTP/2 upgrade replaces it as it would hypercorn's)."""
        wrapper = self.protocol
        if type(wrapper.protocol) is H11Protocol:
            wrapper.protocol = LeanH11Protocol(
                wrapper.app, wrapper.config, wrapper.context, wrapper.task_group,
                wrapper.state, wrapper.ssl, wrapper.client, wrapper.server, wrapper.send,
                guarded=self)

    @property
    def _idle_watch(self) -> IdleWatch:
        return self.idle_task  # type: ignore[return-value]

    def idle_deadline(self) -> float:
        """Loop time the connection, idle from now, is closed: the first request's headers
        get ``header_timeout_s``, the wait between requests ``keep_alive_timeout_s``."""
        first = self._requests == 0
        return self.loop.time() + (self.deadlines.header_timeout_s if first
                                   else self.deadlines.keep_alive_timeout_s)

    async def watch_idle(self, watch: IdleWatch) -> None:
        """The body of :class:`IdleWatch`'s task: close the connection once it stayed idle
        past its deadline, or the server shuts down while it is idle (a request then being
        served closes it when it turns idle again); at once once the read ended."""
        if not self._read_ended:
            try:
                # a request may have come before this task ran: no deadline while served
                when = self.idle_deadline() if watch.idle else None
                async with asyncio.timeout_at(when) as deadline:
                    watch.deadline = deadline
                    await self.context.terminated.wait()
            except TimeoutError:
                if self._requests == 0:
                    self._on_timeout("header")
            else:
                if not watch.idle:
                    return  # shutting down mid-request: IdleWatch.restart closes it after
            finally:
                watch.deadline = None
        await asyncio.shield(self._initiate_server_close())

    async def protocol_send(self, event: Event) -> None:
        if isinstance(event, Updated) and not event.idle:
            self._requests += 1  # a request's headers arrived
        if not isinstance(event, RawData):
            self._flush()  # a close must not overtake bytes written before it
            await super().protocol_send(event)
            return
        if not self._unsent:
            self.loop.call_soon(self._flush)
        self._unsent.append(event.data)
        if not self.writer.transport.get_write_buffer_size():
            return  # everything flushed so far is in the kernel: nothing to wait for
        try:
            async with self.send_lock, asyncio.timeout(self.deadlines.write_timeout_s):
                await self.writer.drain()  # the client's window, as of the last flush
        except (ConnectionError, RuntimeError):
            await self.protocol.handle(Closed())
        except TimeoutError:
            self._on_timeout("write")
            self.writer.transport.abort()  # drops the unsent bytes; the read ends too
            await self.protocol.handle(Closed())

    def write_now(self, data: bytes) -> bool:
        """``data`` written without waiting, when the client has taken everything sent
        before (after what this turn of the loop wrote, in its flush); ``False`` (nothing
        written) when it has not: :meth:`protocol_send` waits for it, within the write
        deadline."""
        transport = self.writer.transport
        if transport.is_closing() or transport.get_write_buffer_size():
            return False
        if self._unsent:
            self._unsent.append(data)
        else:
            transport.write(data)
        return True

    async def _close(self) -> None:
        self._flush()  # what the last turn wrote goes out before the end of the stream
        try:
            await super()._close()
        finally:
            await self._idle_watch.end()  # hypercorn's stop() only pauses it here

    def _flush(self) -> None:
        """Write what this turn of the loop produced, in one piece."""
        unsent, self._unsent = self._unsent, []
        if not unsent or self.writer.transport.is_closing():
            return  # closing: the read side ends the connection
        self.writer.write(unsent[0] if len(unsent) == 1 else b"".join(unsent))

    def __repr__(self) -> str:
        return (f"GuardedConnection(requests={self._requests}, "
                f"read_ended={self._read_ended})")


class IdleWatch:
    """hypercorn's idle task of a connection (``restart``: it turned idle; ``stop``: a
    request arrived) as one task per connection whose deadline moves: hypercorn's made a
    task for each idle period and cancelled it at the next request (a task created, one
    cancelled and awaited, a timer and an event waiter per request)."""

    __slots__ = ("_connection", "_task", "deadline", "idle")

    def __init__(self, connection: GuardedConnection) -> None:
        self._connection = connection
        self._task: asyncio.Task[None] | None = None
        self.deadline: asyncio.Timeout | None = None  # set while the task waits
        self.idle = False

    async def restart(self, task_group: TaskGroup, action: object) -> None:
        """The connection turned idle (``action``, hypercorn's idle coroutine, is not
        used: :meth:`GuardedConnection.watch_idle` is)."""
        self.idle = True
        task, deadline = self._task, self.deadline
        if task is None or task.done():
            self._task = task_group._task_group.create_task(  # as hypercorn does
                self._connection.watch_idle(self))
        elif deadline is not None and not deadline.expired():
            deadline.reschedule(self._connection.idle_deadline())

    async def stop(self) -> None:
        """A request arrived: no deadline while it is served."""
        self.idle = False
        deadline = self.deadline
        if deadline is not None and not deadline.expired():
            deadline.reschedule(None)

    async def end(self) -> None:
        """The connection is over: the task ends (unless it is the one closing it)."""
        self.idle = False
        task, self._task = self._task, None
        if task is not None and not task.done() and task is not asyncio.current_task():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def __repr__(self) -> str:
        return f"IdleWatch(idle={self.idle}, armed={self.deadline is not None})"


# ---- the wire ----


def _set_checked(headers: Headers, name: bytes, values: list[bytes]) -> Headers:
    """h11's ``set_comma_header`` for headers it already checked and constant ``values``
    (lower-case, valid): the same items, without checking all of them again."""
    items = [item for item in headers._full_items if item[1] != name]
    raw = name.title()
    items += [(raw, name, value) for value in values]
    return Headers(items)


class LeanH11Connection(h11.Connection):
    """An ``h11.Connection`` whose responses' headers are checked once (when the
    ``h11.Response`` is built), not again at each framing header it sets."""

    def _clean_up_response_headers_for_sending(self, response: h11.Response) -> h11.Response:
        # h11 0.16's method, with _set_checked for set_comma_header
        headers = response.headers
        need_close = False
        method = cast(bytes, self._request_method)
        if method == b"HEAD":
            method = b"GET"
        framing_type, _ = _body_framing(method, response)
        if framing_type in ("chunked", "http/1.0"):
            headers = _set_checked(headers, b"content-length", [])
            if self.their_http_version is None or self.their_http_version < b"1.1":
                headers = _set_checked(headers, b"transfer-encoding", [])
                if self._request_method != b"HEAD":
                    need_close = True
            else:
                headers = _set_checked(headers, b"transfer-encoding", [b"chunked"])
        if not self._cstate.keep_alive or need_close:
            connection = set(get_comma_header(headers, b"connection"))
            connection.discard(b"keep-alive")
            connection.add(b"close")
            headers = _set_checked(headers, b"connection", sorted(connection))
        return h11.Response(headers=headers, status_code=response.status_code,
                            http_version=response.http_version, reason=response.reason)


_CHECKED_KEPT = 4096  # header lines remembered valid (then forgotten all at once)
_checked_lines: dict[tuple[bytes, bytes], tuple[bytes, bytes, bytes]] = {}
_FRAMING = (b"content-length", b"transfer-encoding")


def checked_headers(lines: list[tuple[bytes, bytes]]) -> Headers:
    """``lines`` checked against h11's header grammar, as h11's ``normalize_and_validate``
    does (raises ``h11.LocalProtocolError``), each line through a memo of the lines found
    valid before: most of a response's lines (content type, worker, match mode and reason)
    repeat from one response to the next. The framing headers, which h11 checks across
    lines, go through h11 whole."""
    items = []
    memo = _checked_lines
    for line in lines:
        item = memo.get(line)
        if item is None:
            (item,) = normalize_and_validate([line])._full_items
            if item[1] in _FRAMING:
                return normalize_and_validate(lines)
            if len(memo) >= _CHECKED_KEPT:
                memo.clear()
            memo[line] = item
        items.append(item)
    return Headers(items)


class LeanH11Protocol(H11Protocol):
    """hypercorn's HTTP/1.1 protocol over :class:`LeanH11Connection`, a response's headers
    checked by :func:`checked_headers`."""

    def __init__(self, *args: Any, guarded: GuardedConnection | None = None) -> None:
        super().__init__(*args)
        self.connection = LeanH11Connection(
            h11.SERVER, max_incomplete_event_size=self.config.h11_max_incomplete_size)
        self._guarded = guarded

    async def _create_stream(self, request: h11.Request) -> None:
        await super()._create_stream(request)
        stream = self.stream
        if type(stream) is HTTPStream and self._guarded is not None:
            # the app's task was made, not yet run; it reads the extension when it streams
            extensions: dict[str, Any] = stream.scope["extensions"]
            extensions[BODY_WRITER] = self.write_body

    def write_body(self, data: bytes) -> bool:
        """A :data:`BodyWriter`: ``data`` as one chunk of the chunked body under way, the
        bytes h11 would write for it, without h11's event (which changes no state in the
        middle of a body)."""
        connection = self.connection
        if (not data or connection.our_state is not h11.SEND_BODY
                or type(connection._writer) is not ChunkedWriter):
            return False
        assert self._guarded is not None
        return self._guarded.write_now(b"%x\r\n%b\r\n" % (len(data), data))

    async def stream_send(self, event: StreamEvent) -> None:
        if (type(event) is HypercornResponse and event.status_code >= 200
                and self.keep_alive_requests < self.config.keep_alive_max_requests):
            # hypercorn's own branch for a final response, the headers checked once
            headers = checked_headers([*event.headers, *self.config.response_headers("h11")])
            await self._send_h11_event(h11.Response(headers=headers,
                                                    status_code=event.status_code))
            return
        await super().stream_send(event)


class CachedDateConfig(HypercornConfig):
    """hypercorn's config with the ``Date`` header formatted once per second."""

    _date_second = -1
    _date = b""

    def response_headers(self, protocol: str) -> list[tuple[bytes, bytes]]:
        if (not self.include_date_header or self.include_server_header
                or self.alt_svc_headers or self._quic_addresses):
            return super().response_headers(protocol)
        second = int(time.time())
        if second != self._date_second:
            self._date = format_date_time(second).encode("ascii")  # what hypercorn writes
            self._date_second = second
        return [(b"date", self._date)]


# ---- admission ----


class Admission:
    """The limit and its queue (event-loop only). ``max_concurrent_requests`` 0 = none."""

    def __init__(self, config: AdmissionConfig) -> None:
        self.config = config
        self.active = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def acquire(self) -> None:
        """Take a slot, waiting in the queue if need be; raises :class:`ServiceUnavailable`
        (429 queue full, 503 waited too long). Every success needs one :meth:`release`."""
        cfg = self.config
        if not cfg.max_concurrent_requests or (
                self.active < cfg.max_concurrent_requests and not self._waiters):
            self.active += 1
            return
        if len(self._waiters) >= cfg.queue_size:
            raise ServiceUnavailable("the gateway is at its concurrency limit and its queue is "
                                     "full", code=ErrorCode.QUEUE_FULL, status=429,
                                     retry_after_s=cfg.retry_after_s)
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout(cfg.queue_timeout_s):
                await waiter
        except BaseException as exc:
            granted = waiter.done() and not waiter.cancelled()
            with contextlib.suppress(ValueError):
                self._waiters.remove(waiter)
            if granted:  # the slot arrived as the wait ended: pass it on
                self.release()
            if isinstance(exc, TimeoutError):
                raise ServiceUnavailable(
                    f"no capacity within {cfg.queue_timeout_s:g}s", code=ErrorCode.QUEUE_TIMEOUT,
                    status=503, retry_after_s=cfg.retry_after_s) from None
            raise

    def release(self) -> None:
        """Hand the slot to the first live waiter, else free it."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self.active -= 1

    def __repr__(self) -> str:
        return (f"Admission(active={self.active}, waiting={self.waiting}, "
                f"limit={self.config.max_concurrent_requests})")
