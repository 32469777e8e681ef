"""cortex.gateway.http.h1, the wire: requests fed as bytes to one H1Connection over an
in-memory transport, its answers read back with h11 (an independent HTTP/1.1 parser).

The real sockets, the deadlines and the listener's bounds are test_h1_connection.py's; the
gateway's whole HTTP surface is tests/gateway/e2e/test_http.py's."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import h11
import pytest

from cortex.gateway.http.asgi import Message, Receive, Scope, Send
from cortex.gateway.http.h1 import (
    BODY_WRITER,
    ConnectionDeadlines,
    H1Connection,
    H1Server,
    body_writer,
    response_head,
)
from cortex.testing import wait_until_async

pytestmark = pytest.mark.timeout(30)

Handler = Callable[[Scope, Receive, Send], Awaitable[None]]


class Transport:
    """What H1Connection writes through: each ``write`` is one send."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.buffered = 0  # bytes the client has not taken
        self.closed = False
        self.aborted = False
        self.reading = True

    def write(self, data: bytes) -> None:
        assert not self.closed, "written after close"
        self.writes.append(bytes(data))

    def get_write_buffer_size(self) -> int:
        return self.buffered

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = self.aborted = True

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def get_extra_info(self, name: str) -> Any:
        return {"peername": ("127.0.0.1", 50000), "sockname": ("127.0.0.1", 8080)}.get(name)

    @property
    def sent(self) -> bytes:
        return b"".join(self.writes)


class Unbounded:
    def admit(self, peer: str) -> bytes | None:
        return None

    def release(self, peer: str) -> None:
        pass


class Wire:
    """One connection of a server whose app is ``handler``; ``scopes`` and ``bodies``: what
    the app saw of each request."""

    def __init__(self, handler: Handler, *, max_head_bytes: int = 16 << 10) -> None:
        self.scopes: list[Scope] = []
        self.bodies: list[bytes] = []

        async def app(scope: Scope, receive: Receive, send: Send) -> None:
            self.scopes.append(scope)
            await handler(scope, receive, send)

        self.timeouts: list[str] = []
        self.server = H1Server(app, Unbounded(), ConnectionDeadlines(50.0, 50.0, 50.0),
                               max_head_bytes=max_head_bytes, on_timeout=self.timeouts.append)
        self.transport = Transport()
        self.connection = H1Connection(self.server)
        self.connection.connection_made(self.transport)  # type: ignore[arg-type]

    def feed(self, data: bytes) -> None:
        self.connection.data_received(data)

    async def settled(self) -> None:
        """Until the app's tasks ended and their writes were flushed."""
        await wait_until_async(lambda: not self.server.tasks, timeout=10, what="apps done")
        await asyncio.sleep(0)  # the flush scheduled by the last write

    def responses(self, method: bytes = b"GET") -> list[tuple[h11.Response, bytes]]:
        """The answers sent, read by h11 (as a client that sent ``method`` requests)."""
        client = h11.Connection(h11.CLIENT)
        out: list[tuple[h11.Response, bytes]] = []
        client.receive_data(self.transport.sent)
        if self.transport.closed:
            client.receive_data(b"")
        while True:
            if client.our_state is h11.IDLE:
                client.send(h11.Request(method=method, target="/", headers=[("host", "x")]))
                client.send(h11.EndOfMessage())
            event = client.next_event()
            if event in (h11.NEED_DATA, h11.PAUSED) or isinstance(event, h11.ConnectionClosed):
                return out
            if isinstance(event, h11.Response):
                out.append((event, b""))
            elif isinstance(event, h11.Data):
                response, body = out[-1]
                out[-1] = (response, body + event.data)
            elif isinstance(event, h11.EndOfMessage) and client.their_state is h11.DONE:
                if client.our_state is h11.DONE:
                    client.start_next_cycle()


def answer(status: int = 200, headers: list[tuple[bytes, bytes]] | None = None,
           chunks: tuple[bytes, ...] = (b"hello",), read_body: bool = True) -> Handler:
    """An app that reads the body, then answers ``chunks`` (sized when ``headers`` carry a
    ``content-length``, else streamed)."""

    async def handler(scope: Scope, receive: Receive, send: Send) -> None:
        if read_body:
            while (await receive())["more_body"]:
                pass
        await send({"type": "http.response.start", "status": status,
                    "headers": headers or [(b"content-type", b"text/plain")]})
        for i, chunk in enumerate(chunks):
            await send({"type": "http.response.body", "body": chunk,
                        "more_body": i < len(chunks) - 1})

    return handler


def echo() -> Handler:
    """An app answering each request's whole body, sized."""

    async def handler(scope: Scope, receive: Receive, send: Send) -> None:
        parts = []
        while True:
            message = await receive()
            parts.append(message["body"])
            if not message["more_body"]:
                break
        body = b"".join(parts)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", b"%d" % len(body))]})
        await send({"type": "http.response.body", "body": body})

    return handler


GET = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"


async def test_the_scope_is_the_asgi_http_scope() -> None:
    wire = Wire(answer())
    wire.feed(b"GET /v1/a%20b?x=1&y=%20 HTTP/1.1\r\nHost: x\r\nX-Mixed-Case: V\r\n\r\n")
    await wire.settled()
    (scope,) = wire.scopes
    assert scope["type"] == "http" and scope["http_version"] == "1.1"
    assert scope["method"] == "GET" and scope["path"] == "/v1/a b"
    assert scope["raw_path"] == b"/v1/a%20b" and scope["query_string"] == b"x=1&y=%20"
    assert scope["headers"] == [(b"host", b"x"), (b"x-mixed-case", b"V")]
    assert scope["client"] == ("127.0.0.1", 50000) and scope["server"] == ("127.0.0.1", 8080)
    assert scope["extensions"][BODY_WRITER] is not None


async def test_an_absolute_form_target_gives_its_path_and_query() -> None:
    wire = Wire(answer())
    wire.feed(b"GET http://gw:8080/v1/models?a=b HTTP/1.1\r\nHost: gw\r\n\r\n")
    await wire.settled()
    assert wire.scopes[0]["path"] == "/v1/models"
    assert wire.scopes[0]["query_string"] == b"a=b"


@pytest.mark.parametrize("pieces", [1, 3, 40])
async def test_a_sized_body_arrives_whole_in_any_number_of_reads(pieces: int) -> None:
    body = bytes(range(256)) * 40
    request = (b"POST /echo HTTP/1.1\r\nHost: x\r\ncontent-length: %d\r\n\r\n" % len(body)
               + body)
    wire = Wire(echo())
    step = -(-len(request) // pieces)
    for i in range(0, len(request), step):
        wire.feed(request[i:i + step])
        await asyncio.sleep(0)
    await wire.settled()
    ((response, got),) = wire.responses(b"POST")
    assert response.status_code == 200 and got == body


async def test_a_chunked_request_body_is_decoded() -> None:
    wire = Wire(echo())
    wire.feed(b"POST /echo HTTP/1.1\r\nHost: x\r\ntransfer-encoding: chunked\r\n\r\n"
              b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n")
    await wire.settled()
    ((_, got),) = wire.responses(b"POST")
    assert got == b"hello world"


async def test_expect_100_continue_is_answered_when_the_app_reads() -> None:
    reading = asyncio.Event()

    async def handler(scope: Scope, receive: Receive, send: Send) -> None:
        reading.set()
        await echo()(scope, receive, send)

    wire = Wire(handler)
    wire.feed(b"POST /echo HTTP/1.1\r\nHost: x\r\nexpect: 100-continue\r\n"
              b"content-length: 4\r\n\r\n")
    await reading.wait()
    await wait_until_async(lambda: bool(wire.transport.writes), timeout=5, what="100 Continue")
    assert wire.transport.sent == b"HTTP/1.1 100 Continue\r\n\r\n"
    wire.feed(b"ping")
    await wire.settled()
    assert wire.transport.sent.count(b"100 Continue") == 1
    assert wire.transport.sent.endswith(b"\r\n\r\nping")


@pytest.mark.parametrize("chunks", [(b"hello",), (b"a", b"", b"b" * 70_000, b"c"), (b"",)])
async def test_a_streamed_answer_is_chunked_and_the_connection_kept(
        chunks: tuple[bytes, ...]) -> None:
    wire = Wire(answer(chunks=chunks))
    wire.feed(GET)
    await wire.settled()
    ((response, got),) = wire.responses()
    assert response.status_code == 200 and got == b"".join(chunks)
    assert (b"transfer-encoding", b"chunked") in response.headers
    assert b"date" in dict(response.headers)
    assert not wire.transport.closed


async def test_a_sized_answer_keeps_its_length_and_the_connection() -> None:
    wire = Wire(answer(headers=[(b"Content-Length", b"10")], chunks=(b"01234", b"56789")))
    wire.feed(GET)
    await wire.settled()
    ((response, got),) = wire.responses()
    assert got == b"0123456789" and (b"content-length", b"10") in response.headers
    assert b"transfer-encoding" not in dict(response.headers)
    assert not wire.transport.closed


async def test_a_sized_answer_that_falls_short_is_cut() -> None:
    wire = Wire(answer(headers=[(b"content-length", b"10")], chunks=(b"0123",)))
    wire.feed(GET)
    await wire.settled()
    assert wire.transport.aborted  # never a short body that looks whole


async def test_head_204_and_304_answers_have_no_body() -> None:
    for request, status in ((b"HEAD /x HTTP/1.1\r\nHost: x\r\n\r\n", 200),
                            (GET, 204), (GET, 304)):
        wire = Wire(answer(status=status, chunks=(b"ignored",)))
        wire.feed(request)
        await wire.settled()
        head, _, rest = wire.transport.sent.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 %d " % status) and rest == b""
        assert b"transfer-encoding" not in head and not wire.transport.closed


async def test_an_http_10_client_gets_one_answer_and_the_close() -> None:
    wire = Wire(answer(chunks=(b"a", b"b")))
    wire.feed(b"GET / HTTP/1.0\r\n\r\n")
    await wire.settled()
    head, _, rest = wire.transport.sent.partition(b"\r\n\r\n")
    assert b"connection: close" in head and b"transfer-encoding" not in head
    assert rest == b"ab" and wire.transport.closed


async def test_a_connection_close_from_the_app_or_the_client_closes_after_the_answer() -> None:
    for request, headers in (
            (GET, [(b"connection", b"close"), (b"content-length", b"5")]),
            (b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", None)):
        wire = Wire(answer(headers=headers))
        wire.feed(request)
        await wire.settled()
        ((response, got),) = wire.responses()
        assert (b"connection", b"close") in response.headers and got == b"hello"
        assert wire.transport.closed and not wire.transport.aborted


async def test_pipelined_requests_are_answered_in_order() -> None:
    wire = Wire(echo())
    wire.feed(b"".join(b"POST /%d HTTP/1.1\r\nHost: x\r\ncontent-length: 1\r\n\r\n%d" % (i, i)
                       for i in range(3)))
    assert not wire.transport.reading  # a request waits: reading paused
    await wait_until_async(lambda: len(wire.scopes) == 3, timeout=10, what="three served")
    await wire.settled()
    assert [body for _, body in wire.responses(b"POST")] == [b"0", b"1", b"2"]
    assert wire.transport.reading and not wire.transport.closed


async def test_what_one_turn_of_the_loop_writes_goes_out_in_one_send() -> None:
    async def handler(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"first", "more_body": True})
        await asyncio.sleep(0)  # the loop turns: flushed, not held
        await asyncio.sleep(0)
        await send({"type": "http.response.body", "body": b"last", "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    wire = Wire(handler)
    wire.feed(GET)
    await wire.settled()
    head, last = wire.transport.writes
    assert head.startswith(b"HTTP/1.1 200 OK\r\n") and head.endswith(b"\r\n\r\n5\r\nfirst\r\n")
    assert last == b"4\r\nlast\r\n0\r\n\r\n"


async def test_a_body_the_app_did_not_read_closes_the_connection_after_the_answer() -> None:
    wire = Wire(answer(status=413, headers=[(b"content-length", b"5")], read_body=False))
    wire.feed(b"POST / HTTP/1.1\r\nHost: x\r\ncontent-length: 100\r\n\r\nonly part")
    await wire.settled()
    ((response, _),) = wire.responses(b"POST")
    assert response.status_code == 413 and wire.transport.closed


async def test_a_malformed_request_is_a_400_and_the_end() -> None:
    wire = Wire(answer())
    wire.feed(b"GET / HTTP/1.1\r\nHost: x\r\nbad header\r\n\r\n")
    await asyncio.sleep(0)
    assert wire.transport.sent.startswith(b"HTTP/1.1 400 ") and wire.transport.closed
    assert b'"invalid_request"' in wire.transport.sent and wire.scopes == []
    wire.feed(GET)  # nothing more is read
    assert wire.scopes == []


async def test_a_head_over_the_bound_is_a_431_whole_or_in_pieces() -> None:
    wire = Wire(answer(), max_head_bytes=1024)
    wire.feed(b"GET / HTTP/1.1\r\nHost: x\r\nx-big: " + b"a" * 2000 + b"\r\n\r\n")
    assert wire.transport.sent.startswith(b"HTTP/1.1 431 ") and wire.transport.closed
    wire = Wire(answer(), max_head_bytes=1024)
    wire.feed(b"GET / HTTP/1.1\r\nHost: x\r\nx-big: ")
    for _ in range(5):  # a header line that never ends
        wire.feed(b"a" * 500)
    assert wire.transport.sent.startswith(b"HTTP/1.1 431 ") and wire.scopes == []


async def test_an_upgrade_is_ignored_and_the_connection_closed_after_the_answer() -> None:
    wire = Wire(answer())
    wire.feed(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings\r\n"
              b"Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAoAAAAAIAAAAA\r\n\r\nPRI * HTTP/2.0")
    await wire.settled()
    ((response, got),) = wire.responses()
    assert response.status_code == 200 and got == b"hello" and wire.transport.closed
    # with a body (curl --http2 sends one), in the head's read and after it
    wire = Wire(echo())
    wire.feed(b"POST / HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings\r\n"
              b"Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAoAAAAAIAAAAA\r\n"
              b"content-length: 9\r\n\r\nbody")
    wire.feed(b" and")
    wire.feed(b"!PRI * HTTP/2.0")
    await wire.settled()
    ((response, got),) = wire.responses(b"POST")
    assert response.status_code == 200 and got == b"body and!" and wire.transport.closed


async def test_an_app_that_fails_before_answering_gets_a_500_and_after_a_cut() -> None:
    async def fails_first(scope: Scope, receive: Receive, send: Send) -> None:
        raise RuntimeError("boom")

    wire = Wire(fails_first)
    wire.feed(GET)
    await wire.settled()
    ((response, got),) = wire.responses()
    assert response.status_code == 500 and b'"internal_error"' in got and b"boom" not in got

    async def fails_later(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"part", "more_body": True})
        raise RuntimeError("boom")

    wire = Wire(fails_later)
    wire.feed(GET)
    await wire.settled()
    assert wire.transport.aborted


@pytest.mark.parametrize("header", [(b"x-bad", b"a\r\nset-cookie: x"), (b"bad name", b"v"),
                                    (b"", b"v"), (b"x", b"nul\x00"),
                                    (b"content-length", b"ten")])
def test_a_header_that_cannot_be_sent_is_refused(header: tuple[bytes, bytes]) -> None:
    with pytest.raises(ValueError):
        response_head(200, [header], head_only=False, http_11=True, keep_alive=True)


def test_response_heads_are_what_h11_reads() -> None:
    head, _, _, keep = response_head(
        201, [(b"X-Request-Id", b" abc "), (b"content-type", b"application/json")],
        head_only=False, http_11=True, keep_alive=True)
    client = h11.Connection(h11.CLIENT)
    client.send(h11.Request(method="GET", target="/", headers=[("host", "x")]))
    client.receive_data(head)
    response = client.next_event()
    assert isinstance(response, h11.Response) and keep
    assert response.status_code == 201 and response.reason == b"Created"
    assert response.headers[0] == (b"x-request-id", b"abc")
    assert (b"transfer-encoding", b"chunked") in response.headers


async def test_the_body_writer_writes_chunks_only_in_a_chunked_body_under_way() -> None:
    writers: list[Callable[[bytes], bool]] = []
    proceed = asyncio.Event()

    async def handler(scope: Scope, receive: Receive, send: Send) -> None:
        write = body_writer(scope)
        writers.append(write)
        assert not write(b"too early")  # no response yet
        await send({"type": "http.response.start", "status": 200, "headers": []})
        assert write(b"first")  # joined to the head, in its flush
        await proceed.wait()
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        assert not write(b"too late")

    wire = Wire(handler)
    wire.feed(GET)
    await wait_until_async(lambda: bool(wire.transport.writes), timeout=5, what="head flushed")
    assert wire.transport.writes[0].endswith(b"\r\n\r\n5\r\nfirst\r\n")
    (write,) = writers
    assert write(b"next") and wire.transport.writes[-1] == b"4\r\nnext\r\n"  # at once
    wire.transport.buffered = 1  # the client is behind: the ASGI send must wait for it
    assert not write(b"held")
    wire.transport.buffered = 0
    assert not write(b"")
    proceed.set()
    await wire.settled()
    ((_, got),) = wire.responses()
    assert got == b"firstnext"


async def test_the_body_writer_writes_no_body_that_is_not_chunked() -> None:
    results: list[bool] = []

    async def handler(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", b"2")]})
        results.append(body_writer(scope)(b"no"))
        await send({"type": "http.response.body", "body": b"ok"})

    for request in (GET, b"GET / HTTP/1.0\r\n\r\n", b"HEAD / HTTP/1.1\r\nHost: x\r\n\r\n"):
        wire = Wire(handler)
        wire.feed(request)
        await wire.settled()
    assert results == [False, False, False]


def test_no_body_writer_is_one_that_never_writes() -> None:
    assert body_writer({"type": "http"})(b"x") is False


async def test_a_lost_connection_is_a_disconnect_to_the_app() -> None:
    seen: list[Message] = []

    async def handler(scope: Scope, receive: Receive, send: Send) -> None:
        seen.append(await receive())  # the body
        seen.append(await receive())  # then waits: the client leaves

    wire = Wire(handler)
    wire.feed(GET)
    await wait_until_async(lambda: len(seen) == 1, timeout=5, what="body read")
    wire.connection.connection_lost(None)
    await wire.settled()
    assert seen[1] == {"type": "http.disconnect"}
