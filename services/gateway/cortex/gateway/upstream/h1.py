"""A lean HTTP/1.1 client for calls to plain-HTTP workers: one :class:`asyncio.Protocol` per
connection, kept alive in a pool per host.

Why not aiohttp here: a streamed answer costs aiohttp's client several Python calls per
received chunk (its protocol, payload parser, stream reader, flow control) and per request
(session, request and response objects, timers, tracing hooks); relaying a worker's answer
was half of what the gateway's own HTTP stack cost per request. This client does what the
relay needs and nothing else: it writes the request in one ``write``, parses the head once,
decodes a chunked or sized body as it arrives in the protocol's ``data_received``, and hands
the consumer whatever arrived since its last read. Reading stops (``pause_reading``) while
``high_water`` bytes wait unread, so a slow client holds back the worker, not the gateway's
memory.

Kept alive: a connection whose answer was read to its end, that neither side asked to close
and that holds no byte beyond that answer, goes back to its host's pool (newest first; one
idle longer than ``keepalive_s``, or closed by the worker meanwhile, is dropped). A request
that a *reused* connection lost before any byte of an answer (the worker closed it while
idle) is sent once more on a new connection.

Not for ``https`` workers (:class:`~cortex.gateway.upstream.client.UpstreamClient` sends
those through aiohttp). What both clients read of an answer the same way is here too:
:func:`retry_after` and :class:`IdleGuard` (a silent stream's watch).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable, Mapping
from typing import cast
from urllib.parse import urlsplit

from cortex.gateway.upstream.errors import FailureKind, UpstreamFailure

__all__ = ["H1Pool", "H1Response", "IdleGuard", "retry_after"]

_MAX_HEAD = 64 << 10
_NO_BODY = frozenset((204, 304))
_FRAMING = frozenset(("host", "content-length", "transfer-encoding", "connection"))
"""Headers this client writes itself (a caller's are left out: one framing per request)."""

# body framing of the answer being read
_HEAD, _SIZED, _CHUNK_SIZE, _CHUNK_DATA, _CHUNK_END, _TRAILER, _UNTIL_EOF, _DONE = range(8)


def retry_after(value: str | None) -> float | None:
    """A ``Retry-After`` in seconds (the HTTP-date form is ignored)."""
    if value is None or not value.strip().isdigit():
        return None
    return float(value.strip())


class IdleGuard:
    """Closes a response whose read has waited ``idle_s`` seconds for bytes.

    Only time spent waiting on the worker counts (not time the consumer spends sending to a
    slow client), and it costs one timer per idle period, not one per chunk."""

    __slots__ = ("_handle", "_loop", "_on_idle", "fired", "idle_s", "since")

    def __init__(self, idle_s: float, on_idle: Callable[[], None]) -> None:
        self._loop = asyncio.get_running_loop()
        self.idle_s = idle_s
        self._on_idle = on_idle
        self._handle: asyncio.TimerHandle | None = None
        self.since: float | None = None  # loop time the pending read started
        self.fired = False

    def reading(self) -> None:
        self.since = self._loop.time()
        if self._handle is None:
            self._handle = self._loop.call_at(self.since + self.idle_s, self._check)

    def got(self) -> None:
        self.since = None

    def _check(self) -> None:
        self._handle = None
        since = self.since
        if since is None:
            return  # not reading: re-armed by the next read
        if self._loop.time() - since >= self.idle_s:
            self.fired = True
            self._on_idle()
        else:
            self._handle = self._loop.call_at(since + self.idle_s, self._check)

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


def _until(data: bytes, sep: bytes, at: int, limit: int, what: str) -> int:
    """Where ``sep`` is in ``data`` from ``at`` (-1: not arrived yet); a protocol failure
    once more than ``limit`` bytes came without it."""
    end = data.find(sep, at)
    if end < 0 and len(data) - at > limit:
        raise UpstreamFailure(FailureKind.PROTOCOL, f"{what} too large")
    return end


class _Connection(asyncio.Protocol):
    """One TCP connection to a worker and the answer being read on it."""

    def __init__(self, key: tuple[str, int], high_water: int) -> None:
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.lost = False  # closed by either side, or failed
        self.reused = False  # served an answer before the current one
        self.idle_since = 0.0
        self._high = high_water
        self._rest = b""  # received, not yet parsed (a head, size line or CRLF not whole)
        self._state = _DONE
        self._left = 0  # bytes of the sized body, or of the current chunk
        self._keep = False  # the answer allows the connection to be reused
        self._head_only = False  # the request was HEAD: no body follows the head
        self._received_any = False
        self._head: asyncio.Future[tuple[int, dict[str, str]]] | None = None
        self._data: deque[bytes] = deque()
        self._data_bytes = 0
        self._waiter: asyncio.Future[None] | None = None
        self._error: UpstreamFailure | None = None
        self._paused = False

    # ---- the protocol ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # TCP_NODELAY: the loop's default

    def data_received(self, data: bytes) -> None:
        if self._state == _DONE:  # bytes nobody asked for: the connection cannot be reused
            self.close()
            return
        self._received_any = True
        if self._rest:  # the rest of an earlier piece comes first
            data = self._rest + data
        try:
            left = self._parse(data)
        except UpstreamFailure as exc:
            self._fail(exc)
            self.close()
            return
        self._rest = data[left:]
        self._wake()
        if self._data_bytes > self._high and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def eof_received(self) -> bool | None:
        if self._state == _UNTIL_EOF:
            self._state = _DONE
            self._keep = False
            self._wake()
        return None  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self._state == _UNTIL_EOF:
            self._state = _DONE
            self._keep = False
        elif self._state != _DONE:
            name = type(exc).__name__ if exc is not None else "ServerDisconnected"
            self._fail(UpstreamFailure(FailureKind.DISCONNECT, name))
        self._wake()

    # ---- parsing -----------------------------------------------------------------------

    def _parse(self, data: bytes) -> int:
        """Parse ``data`` from its start; returns where the unparsed rest begins (a head,
        chunk size line or chunk end not yet whole)."""
        at, size = 0, len(data)
        while at < size:
            state = self._state
            if state == _CHUNK_SIZE:
                end = _until(data, b"\r\n", at, 1024, "chunk size line")
                if end < 0:
                    return at
                try:
                    length = int(data[at:end].split(b";", 1)[0], 16)
                except ValueError:
                    raise UpstreamFailure(FailureKind.PROTOCOL, "bad chunk size") from None
                if length < 0:
                    raise UpstreamFailure(FailureKind.PROTOCOL, "bad chunk size")
                at = end + 2
                self._left = length
                self._state = _CHUNK_DATA if length else _TRAILER
            elif state == _CHUNK_DATA or state == _SIZED:
                take = min(self._left, size - at)
                self._push(data[at:at + take])
                at += take
                self._left -= take
                if not self._left:
                    self._state = _CHUNK_END if state == _CHUNK_DATA else _DONE
            elif state == _CHUNK_END:
                if data[at:at + 2] != b"\r\n"[:size - at]:
                    raise UpstreamFailure(FailureKind.PROTOCOL, "chunk not followed by CRLF")
                if size - at < 2:
                    return at
                at += 2
                self._state = _CHUNK_SIZE
            elif state == _HEAD:
                end = _until(data, b"\r\n\r\n", at, _MAX_HEAD, "answer head")
                if end < 0:
                    return at
                self._on_head(data[at:end])
                at = end + 4
            elif state == _TRAILER:
                end = _until(data, b"\r\n", at, _MAX_HEAD, "trailer")
                if end < 0:
                    return at
                if end == at:
                    self._state = _DONE
                at = end + 2
            elif state == _UNTIL_EOF:
                self._push(data[at:] if at else data)
                return size
            else:  # _DONE with bytes left: more than the answer
                self._keep = False
                return size
        return at

    def _on_head(self, head: bytes) -> None:
        lines = head.split(b"\r\n")
        parts = lines[0].split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
            raise UpstreamFailure(FailureKind.PROTOCOL, "bad status line")
        status = int(parts[1])
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep or not name or name != name.strip() or line[:1] in b" \t":
                raise UpstreamFailure(FailureKind.PROTOCOL, "bad header line")
            key = name.decode("latin-1").lower()
            text = value.strip().decode("latin-1")
            headers[key] = f"{headers[key]}, {text}" if key in headers else text
        if 100 <= status < 200:  # an interim answer: the real one follows
            return
        connection = headers.get("connection", "").lower()
        self._keep = parts[0] == b"HTTP/1.1" and "close" not in connection
        encoding = headers.get("transfer-encoding", "").lower()
        length = headers.get("content-length")
        if self._head_only or status in _NO_BODY:
            self._state = _DONE
        elif encoding:
            if encoding.rsplit(",", 1)[-1].strip() != "chunked":
                self._keep = False
                self._state = _UNTIL_EOF
            else:
                self._state = _CHUNK_SIZE
        elif length is not None:
            if not length.isdigit():
                raise UpstreamFailure(FailureKind.PROTOCOL, "bad content-length")
            self._left = int(length)
            self._state = _SIZED if self._left else _DONE
        else:
            self._keep = False
            self._state = _UNTIL_EOF
        if self._head is not None and not self._head.done():
            self._head.set_result((status, headers))

    def _push(self, data: bytes) -> None:
        if data:
            self._data.append(data)
            self._data_bytes += len(data)

    def _fail(self, exc: UpstreamFailure) -> None:
        if self._error is None:
            self._error = exc
        self._state = _DONE
        self._keep = False
        if self._head is not None and not self._head.done():
            self._head.set_exception(exc)

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # ---- what the response reads --------------------------------------------------------

    def send(self, request: bytes, body: bytes | None, head_only: bool
             ) -> asyncio.Future[tuple[int, dict[str, str]]]:
        """Write a request; the future resolves with the answer's (status, headers)."""
        assert self.transport is not None
        self._state = _HEAD
        self._keep = False
        self._head_only = head_only
        self._received_any = False
        self._error = None
        head = self._head = asyncio.get_running_loop().create_future()
        if body and len(body) > 65536:
            self.transport.write(request)
            self.transport.write(body)
        else:
            self.transport.write(request + body if body else request)
        return head

    @property
    def answered_nothing(self) -> bool:
        return not self._received_any

    @property
    def complete(self) -> bool:
        """The answer was read to its end (nothing left to hand out)."""
        return self._state == _DONE and self._error is None and not self._data

    @property
    def reusable(self) -> bool:
        return self.complete and self._keep and not self.lost and not self._rest

    @property
    def announced_length(self) -> int | None:
        return self._left if self._state == _SIZED else None

    async def read_some(self) -> bytes:
        """What arrived since the last read (waiting for it); ``b""`` at the answer's end.
        Raises :class:`UpstreamFailure` if the connection failed before the end."""
        while not self._data:
            if self._error is not None:
                raise self._error
            if self._state == _DONE:
                return b""
            waiter = self._waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            finally:
                self._waiter = None
        data = self._data.popleft() if len(self._data) == 1 else b"".join(self._data)
        self._data.clear()
        self._data_bytes = 0
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        return data

    def close(self) -> None:
        self.lost = True
        if self.transport is not None:
            self.transport.close()


class H1Response:
    """A worker's answer whose head arrived (the same contract as aiohttp's
    :class:`~cortex.gateway.upstream.client.UpstreamResponse`)."""

    __slots__ = ("_conn", "_pool", "content_type", "max_bytes", "retry_after_s", "status")

    def __init__(self, pool: H1Pool, conn: _Connection, status: int, headers: dict[str, str],
                 max_bytes: int | None) -> None:
        self._pool = pool
        self._conn: _Connection | None = conn
        self.max_bytes = max_bytes
        self.status = status
        self.content_type = headers.get("content-type", "application/json")
        self.retry_after_s = retry_after(headers.get("retry-after"))

    def _open(self) -> _Connection:
        if self._conn is None:
            raise UpstreamFailure(FailureKind.DISCONNECT, "response closed")
        return self._conn

    async def chunks(self, idle_timeout_s: float | None = None) -> AsyncGenerator[bytes, None]:
        """Body bytes as they arrive; :class:`UpstreamFailure` if the worker fails, or (kind
        ``timeout``) when it sends nothing for ``idle_timeout_s`` seconds (the connection is
        then closed: the engine aborts the request)."""
        conn = self._open()
        guard = (IdleGuard(idle_timeout_s, conn.close)
                 if idle_timeout_s is not None else None)
        try:
            while True:
                if guard is not None:
                    guard.reading()
                try:
                    chunk = await conn.read_some()
                except UpstreamFailure:
                    if guard is not None and guard.fired:
                        raise UpstreamFailure(FailureKind.TIMEOUT,
                                              f"no bytes for {idle_timeout_s}s") from None
                    raise
                if guard is not None:
                    guard.got()
                if not chunk:
                    break
                yield chunk
        finally:
            if guard is not None:
                guard.cancel()

    async def read(self) -> bytes:
        """The whole body; :class:`UpstreamFailure` (kind ``too_large`` when it announces or
        reaches more than ``max_bytes``: then nothing more is read)."""
        conn = self._open()
        limit = self.max_bytes
        declared = conn.announced_length
        if limit is not None and declared is not None and declared > limit:
            raise UpstreamFailure(FailureKind.TOO_LARGE, f"{declared} bytes announced")
        parts: list[bytes] = []
        size = 0
        while chunk := await conn.read_some():
            size += len(chunk)
            if limit is not None and size > limit:
                raise UpstreamFailure(FailureKind.TOO_LARGE, f"over {limit} bytes")
            parts.append(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def close(self) -> None:
        """Back to the pool when the body was read to its end, else the connection is
        closed (the worker sees the client leave)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            self._pool.release(conn)

    def __repr__(self) -> str:
        return f"H1Response(status={self.status}, type={self.content_type!r})"


class H1Pool:
    """Connections to plain-HTTP workers, kept alive per host; ``max_connections`` (0: no
    bound) counts open ones, idle included (an idle one is closed to make room)."""

    def __init__(self, *, connect_timeout_s: float, max_connections: int = 0,
                 keepalive_s: float = 30.0, high_water: int = 256 << 10) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.max_connections = max_connections
        self.keepalive_s = keepalive_s
        self.high_water = high_water
        self.opened = 0  # connections ever opened (reuse = requests - opened)
        self._idle: dict[tuple[str, int], deque[_Connection]] = {}
        self._open = 0
        self._slots: deque[asyncio.Future[None]] = deque()
        self._targets: dict[str, tuple[tuple[str, int], bytes]] = {}
        self._closed = False

    def __repr__(self) -> str:
        idle = sum(len(q) for q in self._idle.values())
        return f"H1Pool(open={self._open}, idle={idle}, opened={self.opened})"

    async def request(self, method: str, url: str, body: bytes | None,
                      headers: Mapping[str, str], max_bytes: int | None) -> H1Response:
        """Send a request and wait for the answer's head. :class:`UpstreamFailure`
        (connect, timeout, disconnect, protocol); ``ValueError`` for a header that holds a
        line break."""
        key, prefix = self._target(url)
        lines = [method.encode("ascii"), b" ", prefix]
        for name, value in headers.items():
            if "\n" in value or "\r" in value or "\n" in name or "\r" in name:
                raise ValueError(f"header {name!r} holds a line break")
            if name.lower() not in _FRAMING:
                lines.append(f"{name}: {value}\r\n".encode("latin-1"))
        if body is not None:
            lines.append(b"Content-Length: %d\r\n" % len(body))
        lines.append(b"\r\n")
        request = b"".join(lines)
        head_only = method == "HEAD"
        conn = await self._acquire(key)
        while True:
            try:
                status, answer = await conn.send(request, body, head_only)
            except UpstreamFailure:
                self.release(conn)
                if not (conn.reused and conn.answered_nothing):
                    raise
                # the worker closed it while idle: once more, on a new connection
                conn = await self._acquire(key, reuse=False)
            except BaseException:
                self.release(conn)
                raise
            else:
                return H1Response(self, conn, status, answer, max_bytes)

    def _target(self, url: str) -> tuple[tuple[str, int], bytes]:
        """(host, port) and the request line's target with ``Host``, per URL (cached)."""
        known = self._targets.get(url)
        if known is not None:
            return known
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"not a plain-HTTP URL: {url!r}")
        port = parts.port or 80
        path = parts.path or "/"
        if parts.query:
            path = f"{path}?{parts.query}"
        host = parts.hostname
        netloc = f"[{host}]" if ":" in host else host
        if parts.port is not None:
            netloc = f"{netloc}:{port}"
        prefix = f"{path} HTTP/1.1\r\nHost: {netloc}\r\n".encode("latin-1")
        if len(self._targets) > 4096:
            self._targets.clear()
        known = self._targets[url] = ((host, port), prefix)
        return known

    def _take(self, key: tuple[str, int]) -> _Connection | None:
        idle = self._idle.get(key)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if not conn.lost and now - conn.idle_since < self.keepalive_s:
                conn.reused = True
                return conn
            self._drop(conn)
        return None

    async def _acquire(self, key: tuple[str, int], reuse: bool = True) -> _Connection:
        """An idle connection to ``key`` (``reuse``), else a new one (when there is room)."""
        while True:
            conn = self._take(key) if reuse else None
            if conn is not None:
                return conn
            if await self._room():
                return await self._connect(key)

    async def _connect(self, key: tuple[str, int]) -> _Connection:
        self._open += 1
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(
                    lambda: _Connection(key, self.high_water), key[0], key[1])
        except BaseException as exc:
            self._open -= 1
            self._free_slot()
            if isinstance(exc, TimeoutError):
                raise UpstreamFailure(FailureKind.TIMEOUT, "connect timed out") from exc
            if isinstance(exc, OSError):
                raise UpstreamFailure(FailureKind.CONNECT, type(exc).__name__) from exc
            raise
        self.opened += 1
        return conn

    async def _room(self) -> bool:
        """True when a connection may be opened now (the longest-idle one is closed to make
        room if need be); False after waiting for one to be released (an idle one may be
        there to take)."""
        limit = self.max_connections
        if not limit or self._open < limit:
            return True
        oldest: _Connection | None = None
        for queue in self._idle.values():
            if queue and (oldest is None or queue[0].idle_since < oldest.idle_since):
                oldest = queue[0]
        if oldest is not None:
            self._idle[oldest.key].popleft()
            self._drop(oldest)
            return True
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._slots.append(waiter)
        try:
            await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                self._free_slot()  # woken as the wait ended: the next waiter looks instead
            raise
        finally:
            if waiter in self._slots:
                self._slots.remove(waiter)
        return False

    def _free_slot(self) -> None:
        while self._slots:
            waiter = self._slots.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def release(self, conn: _Connection) -> None:
        """A connection whose answer is done with: kept alive if it can be, else closed."""
        if conn.reusable and not self._closed:
            conn.idle_since = time.monotonic()
            self._idle.setdefault(conn.key, deque()).append(conn)
            self._free_slot()  # a waiter may take this one, or its room
        else:
            self._drop(conn)

    def _drop(self, conn: _Connection) -> None:
        conn.close()
        self._open -= 1
        self._free_slot()

    def close(self) -> None:
        self._closed = True
        for queue in self._idle.values():
            while queue:
                self._drop(queue.pop())
        self._idle.clear()
