"""cortex.gateway.http.admission, the wire: LeanH11Connection sends what h11.Connection sends
(a differential test over the cases h11's framing step treats apart); the body writer sends
what h11 sends for a piece of a chunked body, and only in the middle of one; checked_headers
checks what h11's normalize_and_validate checks; CachedDateConfig writes hypercorn's Date."""

from __future__ import annotations

import itertools
from typing import Any

import h11
import pytest
from h11._headers import normalize_and_validate
from hypercorn.asyncio.worker_context import WorkerContext
from hypercorn.config import Config as HypercornConfig
from hypercorn.events import Event, RawData

from cortex.gateway.http import admission
from cortex.gateway.http.admission import (
    BODY_WRITER,
    CachedDateConfig,
    LeanH11Connection,
    LeanH11Protocol,
    body_writer,
    checked_headers,
)

pytestmark = pytest.mark.timeout(30)

REQUESTS = {
    "post 1.1": b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}",
    "get 1.1": b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n",
    "head 1.1": b"HEAD /health HTTP/1.1\r\nHost: x\r\n\r\n",
    "post 1.0": b"POST /v1/completions HTTP/1.0\r\nContent-Length: 2\r\n\r\n{}",
    "close 1.1": b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
}

SSE = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
       (b"x-request-id", b"abc"), (b"x-cortex-assigned-worker", b"sim-0")]
RESPONSES = {
    "stream": (200, SSE),
    "sized": (200, [(b"content-type", b"application/json"), (b"content-length", b"2")]),
    "sized twice": (200, [(b"Content-Length", b"2"), (b"content-length", b"2")]),
    "chunked given": (200, [(b"Transfer-Encoding", b"Chunked"), *SSE]),
    "keep-alive given": (200, [(b"connection", b"keep-alive"), *SSE]),
    "close given": (200, [(b"Connection", b"Close"), *SSE]),
    "no content": (204, [(b"x-request-id", b"abc")]),
    "not modified": (304, []),
    "error": (503, [(b"content-length", b"0"), (b"retry-after", b"1")]),
}


STREAMED = [b"data: x\n\n", b"", bytearray(b"data: y\n\n"), memoryview(b"z" * 70_000)]


def _exchange(connection: h11.Connection, request: bytes, status: int,
              headers: list[tuple[bytes, bytes]]) -> tuple[bytes, object, object]:
    connection.receive_data(request)
    while type(connection.next_event()) is not h11.EndOfMessage:
        pass
    wire = connection.send(h11.Response(status_code=status, headers=headers)) or b""
    if connection.our_state is h11.SEND_BODY:
        lengths = {v for k, v in headers if k.lower() == b"content-length"}
        chunks: list[bytes | bytearray | memoryview] = (
            STREAMED if not lengths else [b"{}"[:int(lengths.pop())]])
        if request.startswith(b"HEAD") or status in (204, 304):
            chunks = []
        for chunk in chunks:  # several chunks, an empty one among them
            wire += connection.send(h11.Data(data=chunk)) or b""
        wire += connection.send(h11.EndOfMessage()) or b""
    return wire, connection.our_state, connection.their_state


@pytest.mark.parametrize(("request_name", "response_name"),
                         list(itertools.product(REQUESTS, RESPONSES)))
def test_lean_connection_sends_what_h11_sends(request_name: str, response_name: str) -> None:
    status, headers = RESPONSES[response_name]
    request = REQUESTS[request_name]
    expected = _exchange(h11.Connection(h11.SERVER), request, status, headers)
    assert _exchange(LeanH11Connection(h11.SERVER), request, status, headers) == expected


class _Spawner:
    """hypercorn's task group as the protocol uses it: the app is not run, its scope kept."""

    def __init__(self) -> None:
        self.scopes: list[dict[str, Any]] = []

    async def spawn_app(self, app: object, config: object, scope: dict[str, Any],
                        send: object) -> Any:
        self.scopes.append(scope)

        async def put(message: object) -> None:
            pass
        return put


class _Guarded:
    """What the body writer writes through (GuardedConnection.write_now, tested below)."""

    def __init__(self) -> None:
        self.written: list[bytes] = []

    def write_now(self, data: bytes) -> bool:
        self.written.append(data)
        return True


async def _served(request: bytes) -> tuple[LeanH11Protocol, _Guarded, list[bytes],
                                           dict[str, Any]]:
    """A LeanH11Protocol that read ``request``: (it, its guarded connection, the bytes its
    ASGI side sent, the app's scope)."""
    guarded, sent, spawner = _Guarded(), [], _Spawner()

    async def send(event: Event) -> None:
        if isinstance(event, RawData):
            sent.append(bytes(event.data))

    protocol = LeanH11Protocol(None, HypercornConfig(), WorkerContext(None), spawner, {},
                               False, None, None, send,
                               guarded=guarded)  # type: ignore[arg-type]
    await protocol.handle(RawData(request))
    (scope,) = spawner.scopes
    return protocol, guarded, sent, scope


@pytest.mark.parametrize("response_name", ["stream", "chunked given", "close given"])
async def test_the_body_writer_sends_what_h11_sends_for_a_chunk(response_name: str) -> None:
    status, headers = RESPONSES[response_name]
    request = REQUESTS["post 1.1"]
    protocol, guarded, sent, scope = await _served(request)
    assert body_writer(scope) == protocol.write_body  # the app finds it in its scope
    assert scope["extensions"][BODY_WRITER] == protocol.write_body
    assert not protocol.write_body(b"data: early\n\n")  # no response started
    stream = protocol.stream
    assert stream is not None
    await stream.app_send({"type": "http.response.start", "status": status, "headers": headers})
    for chunk in STREAMED:
        assert protocol.write_body(chunk) == bool(chunk)  # an empty one is no chunk
    await stream.app_send({"type": "http.response.body", "body": b"", "more_body": False})
    assert not protocol.write_body(b"data: late\n\n")  # the body ended
    reference = h11.Connection(h11.SERVER)
    reference.receive_data(request)
    while type(reference.next_event()) is not h11.EndOfMessage:
        pass
    reference.send(h11.Response(status_code=status, headers=headers))
    assert guarded.written == [reference.send(h11.Data(data=c)) for c in STREAMED if c]
    assert sent[-1] == reference.send(h11.EndOfMessage())


@pytest.mark.parametrize(("request_name", "response_name"),
                         [("post 1.1", "sized"), ("post 1.0", "stream"),
                          ("head 1.1", "stream"), ("post 1.1", "no content")])
async def test_the_body_writer_writes_no_body_that_is_not_chunked(
        request_name: str, response_name: str) -> None:
    status, headers = RESPONSES[response_name]
    protocol, guarded, _, _ = await _served(REQUESTS[request_name])
    stream = protocol.stream
    assert stream is not None
    await stream.app_send({"type": "http.response.start", "status": status, "headers": headers})
    assert not protocol.write_body(b"{}")  # the ASGI send frames it, or refuses it
    assert guarded.written == []


def test_no_body_writer_is_one_that_never_writes() -> None:
    assert body_writer({"type": "http", "extensions": {}})(b"data") is False
    assert body_writer({"type": "http"})(b"data") is False


def test_lean_connection_still_refuses_data_after_the_end() -> None:
    connection = LeanH11Connection(h11.SERVER)
    _exchange(connection, REQUESTS["post 1.1"], *RESPONSES["stream"])
    with pytest.raises(h11.LocalProtocolError):
        connection.send(h11.Data(data=b"late"))


def test_lean_connection_still_refuses_invalid_headers() -> None:
    connection = LeanH11Connection(h11.SERVER)
    connection.receive_data(REQUESTS["get 1.1"])
    connection.next_event()
    with pytest.raises(h11.LocalProtocolError):
        connection.send(h11.Response(status_code=200, headers=[(b"x-bad", b"a\r\nb")]))


def test_lean_connection_serves_keep_alive_cycles() -> None:
    connection = LeanH11Connection(h11.SERVER)
    for _ in range(3):
        _, ours, theirs = _exchange(connection, REQUESTS["post 1.1"], *RESPONSES["stream"])
        assert ours is theirs is h11.DONE
        connection.start_next_cycle()


def test_cached_date_is_hypercorns() -> None:
    ours, theirs = CachedDateConfig(), HypercornConfig()
    for config in (ours, theirs):
        config.include_server_header = False
    for _ in range(3):
        before = theirs.response_headers("h11")
        got = ours.response_headers("h11")
        after = theirs.response_headers("h11")
        assert got in (before, after)  # the second may turn between the calls
        assert got is not ours.response_headers("h11")  # a fresh list: callers extend it


def test_cached_date_config_defers_to_hypercorn_for_other_headers() -> None:
    config = CachedDateConfig()
    config.include_server_header = True
    assert (b"server", b"hypercorn-h11") in config.response_headers("h11")


HEADER_LISTS = [
    SSE,
    [*SSE, (b"date", b"Sun, 06 Dec 2026 16:00:00 GMT")],
    [(b"Content-Type", b"application/json"), (b"Content-Length", b"2")],
    [(b"content-length", b"2"), (b"content-length", b"2")],
    [(b"content-length", b"2, 2")],
    [(b"Transfer-Encoding", b"Chunked"), (b"x-a", b"")],
    [(b"x-obs-text", "caf\u00e9".encode()), (b"x-spaces", b"a  b")],
]
INVALID_LISTS = [
    [(b"x-bad", b"a\r\nb")],
    [(b"bad name", b"x")],
    [(b"x-lead", b" padded")],
    [(b"content-length", b"2"), (b"content-length", b"3")],
    [(b"content-length", b"x")],
    [(b"transfer-encoding", b"chunked"), (b"transfer-encoding", b"chunked")],
    [(b"transfer-encoding", b"gzip")],
    [*SSE, (b"x-bad", b"\x00")],
]


def _items(headers: object) -> list[tuple[bytes, bytes, bytes]]:
    return list(headers._full_items)  # type: ignore[attr-defined]


@pytest.mark.parametrize("lines", HEADER_LISTS)
def test_checked_headers_are_h11s(lines: list[tuple[bytes, bytes]]) -> None:
    for _ in range(2):  # the second time from the memo
        assert _items(checked_headers(lines)) == _items(normalize_and_validate(lines))


@pytest.mark.parametrize("lines", INVALID_LISTS)
def test_checked_headers_refuse_what_h11_refuses(lines: list[tuple[bytes, bytes]]) -> None:
    with pytest.raises(h11.LocalProtocolError):
        normalize_and_validate(lines)
    checked_headers(SSE)  # valid lines remembered: the invalid ones are still refused
    for _ in range(2):
        with pytest.raises(h11.LocalProtocolError):
            checked_headers(lines)


def test_checked_headers_forget_past_their_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(admission, "_CHECKED_KEPT", 3)
    admission._checked_lines.clear()
    for i in range(10):
        lines = [(b"x-request-id", str(i).encode()), *SSE]
        assert _items(checked_headers(lines)) == _items(normalize_and_validate(lines))
        assert len(admission._checked_lines) <= 3
