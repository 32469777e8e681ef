"""The lean HTTP/1.1 client: answers fed as canned wire bytes, cut at every place (the
parser must not care where TCP splits them), and a real pool against raw servers on
127.0.0.1 (keep-alive, a worker closing an idle connection, the connection bound,
back-pressure, a cancelled request)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from cortex.gateway.upstream.errors import FailureKind, UpstreamFailure
from cortex.gateway.upstream.h1 import H1Pool, _Connection
from cortex.testing import wait_until_async

pytestmark = pytest.mark.timeout(20)


class _Transport(asyncio.Transport):
    """Records writes; what a protocol fed by hand needs of a transport."""

    def __init__(self) -> None:
        super().__init__()
        self.written = b""
        self.closed = False
        self.paused = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written += bytes(data)

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False

    def get_extra_info(self, name: str, default: object = None) -> object:
        return default


def _fed(pieces: list[bytes], head_only: bool = False
         ) -> tuple[_Connection, _Transport, asyncio.Future[tuple[int, dict[str, str]]]]:
    conn = _Connection(("127.0.0.1", 1), high_water=1 << 20)
    transport = _Transport()
    conn.connection_made(transport)
    head = conn.send(b"POST / HTTP/1.1\r\n\r\n", None, head_only)
    for piece in pieces:
        conn.data_received(piece)
    return conn, transport, head


def _cuts(answer: bytes) -> list[list[bytes]]:
    """The answer whole, byte by byte, and cut once at every place."""
    return ([[answer], [answer[i:i + 1] for i in range(len(answer))]]
            + [[answer[:i], answer[i:]] for i in range(1, len(answer))])


async def _body(conn: _Connection) -> bytes:
    parts = []
    while chunk := await conn.read_some():
        parts.append(chunk)
    return b"".join(parts)


CHUNKED = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
           b"Transfer-Encoding: chunked\r\n\r\n"
           b"9\r\ndata: 1\n\n\r\n"
           b"a;ext=1\r\ndata: 22\n\n\r\n"
           b"0\r\nx-trailer: t\r\n\r\n")


async def test_a_chunked_answer_reads_the_same_wherever_it_is_cut() -> None:
    for pieces in _cuts(CHUNKED):
        conn, _, head = _fed(pieces)
        status, headers = await head
        assert (status, headers["content-type"]) == (200, "text/event-stream")
        assert await _body(conn) == b"data: 1\n\ndata: 22\n\n"
        assert conn.reusable


async def test_a_sized_answer_an_empty_one_and_a_head_answer() -> None:
    sized = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello"
    for pieces in _cuts(sized):
        conn, _, head = _fed(pieces)
        assert (await head)[0] == 200
        assert await _body(conn) == b"hello" and conn.reusable
    for answer, head_only in ((b"HTTP/1.1 204 No Content\r\n\r\n", False),
                              (b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n", False),
                              (b"HTTP/1.1 200 OK\r\nContent-Length: 99\r\n\r\n", True)):
        conn, _, head = _fed([answer], head_only)
        await head
        assert await _body(conn) == b"" and conn.reusable


async def test_an_interim_answer_is_skipped() -> None:
    conn, _, head = _fed([b"HTTP/1.1 100 Continue\r\n\r\n",
                          b"HTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\nok"])
    assert (await head)[0] == 201
    assert await _body(conn) == b"ok"


async def test_an_answer_without_length_ends_with_the_connection_and_is_not_kept() -> None:
    conn, _, head = _fed([b"HTTP/1.1 200 OK\r\n\r\nsome", b" bytes"])
    await head
    conn.eof_received()
    assert await _body(conn) == b"some bytes"
    assert not conn.reusable


async def test_close_asked_by_the_worker_or_http_1_0_is_not_kept() -> None:
    for answer in (b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 1\r\n\r\nx",
                   b"HTTP/1.0 200 OK\r\nContent-Length: 1\r\n\r\nx"):
        conn, _, head = _fed([answer])
        await head
        assert await _body(conn) == b"x" and not conn.reusable


@pytest.mark.parametrize("answer", [
    b"HTTP/1.1 2x0 OK\r\n\r\n",
    b"SPDY 200 OK\r\n\r\n",
    b"HTTP/1.1 200 OK\r\n folded: header\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1\r\nxy",
])
async def test_a_malformed_answer_is_a_protocol_failure_and_closes(answer: bytes) -> None:
    conn, transport, head = _fed([answer])
    with pytest.raises(UpstreamFailure) as caught:
        await head
        await _body(conn)
    assert caught.value.kind is FailureKind.PROTOCOL
    assert transport.closed and not conn.reusable


async def test_a_head_that_never_ends_is_refused() -> None:
    _, transport, head = _fed([b"HTTP/1.1 200 OK\r\n" + b"x: y\r\n" * 20000])
    with pytest.raises(UpstreamFailure, match="head too large"):
        await head
    assert transport.closed


async def test_the_connection_lost_mid_answer_is_a_disconnect() -> None:
    conn, _, head = _fed([b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\npart"])
    await head
    assert await conn.read_some() == b"part"
    conn.connection_lost(None)
    with pytest.raises(UpstreamFailure) as caught:
        await conn.read_some()
    assert caught.value.kind is FailureKind.DISCONNECT


async def test_bytes_beyond_the_answer_make_the_connection_unusable() -> None:
    conn, _, head = _fed([b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\nxEXTRA"])
    await head
    assert await _body(conn) == b"x"
    assert not conn.reusable


async def test_reading_pauses_above_the_high_water_mark_and_resumes_when_read() -> None:
    conn = _Connection(("127.0.0.1", 1), high_water=100)
    transport = _Transport()
    conn.connection_made(transport)
    head = conn.send(b"GET / HTTP/1.1\r\n\r\n", None, False)
    conn.data_received(b"HTTP/1.1 200 OK\r\nContent-Length: 300\r\n\r\n" + b"a" * 150)
    await head
    assert transport.paused
    assert await conn.read_some() == b"a" * 150
    assert not transport.paused
    conn.data_received(b"a" * 150)
    assert await _body(conn) == b"a" * 150


# ---- a real pool against raw servers ----

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]


@contextlib.asynccontextmanager
async def raw_server(handler: Handler) -> AsyncIterator[tuple[str, list[int]]]:
    """A server calling ``handler(reader, writer, n)`` for its n-th connection; yields its
    URL and the list of connection numbers seen."""
    seen: list[int] = []

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(len(seen))
        try:
            await handler(reader, writer, seen[-1])
        finally:
            writer.close()

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", seen
    finally:
        server.close()
        await server.wait_closed()


async def _request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    return head + await reader.readexactly(length)


async def _keep_answering(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                          n: int) -> None:
    with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
        while True:
            request = await _request(reader)
            body = request.split(b"\r\n\r\n", 1)[1]
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s"
                         % (len(body), body))
            await writer.drain()


async def _call(pool: H1Pool, url: str, body: bytes = b"x",
                headers: dict[str, str] | None = None) -> bytes:
    response = await pool.request("POST", url + "/v1/x", body, headers or {}, None)
    try:
        return await response.read()
    finally:
        response.close()


async def test_one_connection_serves_request_after_request() -> None:
    async with raw_server(_keep_answering) as (url, seen):
        pool = H1Pool(connect_timeout_s=2)
        for i in range(5):
            assert await _call(pool, url, b"n%d" % i) == b"n%d" % i
        assert (pool.opened, len(seen)) == (1, 1)
        pool.close()


async def test_the_request_is_written_as_asked() -> None:
    got: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

    async def record(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     n: int) -> None:
        got.set_result(await _request(reader))
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()

    async with raw_server(record) as (url, _):
        pool = H1Pool(connect_timeout_s=2)
        response = await pool.request("POST", url + "/path?q=1", b'{"a": 1}',
                                      {"Content-Type": "application/json",
                                       "content-length": "999", "Host": "elsewhere"}, None)
        assert await response.read() == b""
        response.close()
        head, body = (await got).split(b"\r\n\r\n", 1)
        lines = head.split(b"\r\n")
        assert lines[0] == b"POST /path?q=1 HTTP/1.1"
        assert lines[1] == url.replace("http://", "Host: ").encode()
        assert b"Content-Type: application/json" in lines
        assert b"Content-Length: 8" in lines and body == b'{"a": 1}'
        assert len(lines) == 4  # the caller's framing headers were left out
        pool.close()


async def test_a_header_with_a_line_break_is_refused_and_nothing_is_sent() -> None:
    async with raw_server(_keep_answering) as (url, seen):
        pool = H1Pool(connect_timeout_s=2)
        with pytest.raises(ValueError, match="line break"):
            await _call(pool, url, headers={"X-Id": "a\r\nX-Evil: 1"})
        assert seen == [] and pool.opened == 0
        pool.close()


async def test_a_connection_the_worker_closed_while_idle_is_replaced_unnoticed() -> None:
    async def once_then_drop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                             n: int) -> None:
        if n == 0:  # answers one request, then drops the connection on the next one
            await _request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()
            with contextlib.suppress(asyncio.IncompleteReadError):
                await _request(reader)
            return
        await _keep_answering(reader, writer, n)

    async with raw_server(once_then_drop) as (url, seen):
        pool = H1Pool(connect_timeout_s=2)
        assert await _call(pool, url) == b"ok"
        assert await _call(pool, url, b"again") == b"again"
        assert (pool.opened, len(seen)) == (2, 2)
        pool.close()


async def test_a_new_connection_closed_without_an_answer_is_a_disconnect() -> None:
    async def drop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                   n: int) -> None:
        await _request(reader)

    async with raw_server(drop) as (url, seen):
        pool = H1Pool(connect_timeout_s=2)
        with pytest.raises(UpstreamFailure) as caught:
            await _call(pool, url)
        assert caught.value.kind is FailureKind.DISCONNECT and len(seen) == 1
        pool.close()


async def test_the_connection_bound_makes_a_request_wait_for_a_free_one() -> None:
    release = asyncio.Event()

    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                   n: int) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                await _request(reader)
                await release.wait()
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\nk")
                await writer.drain()

    async with raw_server(slow) as (url, seen):
        pool = H1Pool(connect_timeout_s=2, max_connections=1)
        first = asyncio.create_task(_call(pool, url))
        second = asyncio.create_task(_call(pool, url))
        await wait_until_async(lambda: bool(seen and pool._slots), timeout=5,
                               what="the second request waiting for room")
        assert len(seen) == 1 and not second.done()
        release.set()
        assert await first == b"k" and await second == b"k"
        assert len(seen) == 1  # the second waited for the first's connection
        pool.close()


async def test_a_waiter_woken_and_cancelled_at_once_passes_its_turn_on() -> None:
    async with raw_server(_keep_answering) as (url, seen):
        pool = H1Pool(connect_timeout_s=2, max_connections=1)
        first = await pool.request("POST", url, b"1", {}, None)
        assert await first.read() == b"1"
        second = asyncio.create_task(_call(pool, url, b"2"))
        third = asyncio.create_task(_call(pool, url, b"3"))
        await wait_until_async(lambda: len(pool._slots) == 2, timeout=5,
                               what="both requests waiting for room")
        first.close()  # wakes the second ...
        second.cancel()  # ... which is cancelled before it runs: the third must go on
        assert await asyncio.wait_for(third, 5) == b"3"
        with pytest.raises(asyncio.CancelledError):
            await second
        assert len(seen) == 1
        pool.close()


async def test_a_cancelled_request_closes_its_connection() -> None:
    asked, closed = asyncio.Event(), asyncio.Event()

    async def never(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    n: int) -> None:
        await _request(reader)
        asked.set()
        with contextlib.suppress(ConnectionError):
            await reader.read()  # until the client closes
        closed.set()

    async with raw_server(never) as (url, _):
        pool = H1Pool(connect_timeout_s=2)
        task = asyncio.create_task(_call(pool, url))
        await asyncio.wait_for(asked.wait(), 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(closed.wait(), 5)
        assert repr(pool) == "H1Pool(open=0, idle=0, opened=1)"
        pool.close()


async def test_a_streamed_answer_is_held_back_while_nobody_reads_it() -> None:
    size = 48 << 20  # far more than the kernel's socket buffers hold
    written = asyncio.Event()

    async def flood(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    n: int) -> None:
        await _request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size)
        writer.write(b"a" * size)
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        written.set()

    async with raw_server(flood) as (url, _):
        pool = H1Pool(connect_timeout_s=2, high_water=64 << 10)
        response = await pool.request("POST", url, b"", {}, None)
        with pytest.raises(TimeoutError):  # the sender is blocked: the reader paused
            await asyncio.wait_for(written.wait(), 0.5)
        total = 0
        async for chunk in response.chunks():
            total += len(chunk)
        assert total == size
        response.close()
        pool.close()
