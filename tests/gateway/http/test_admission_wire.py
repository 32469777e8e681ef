"""cortex.gateway.http.admission, the wire: LeanH11Connection sends what h11.Connection sends
(a differential test over the cases h11's framing step treats apart); CachedDateConfig writes
hypercorn's Date."""

from __future__ import annotations

import itertools

import h11
import pytest
from hypercorn.config import Config as HypercornConfig

from cortex.gateway.http.admission import CachedDateConfig, LeanH11Connection

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


def _exchange(connection: h11.Connection, request: bytes, status: int,
              headers: list[tuple[bytes, bytes]]) -> tuple[bytes, object, object]:
    connection.receive_data(request)
    while type(connection.next_event()) is not h11.EndOfMessage:
        pass
    wire = connection.send(h11.Response(status_code=status, headers=headers)) or b""
    if connection.our_state is h11.SEND_BODY:
        lengths = {v for k, v in headers if k.lower() == b"content-length"}
        body = b"data: x\n\n" if not lengths else b"{}"[:int(lengths.pop())]
        if request.startswith(b"HEAD") or status in (204, 304):
            body = b""
        if body:
            wire += connection.send(h11.Data(data=body)) or b""
        wire += connection.send(h11.EndOfMessage()) or b""
    return wire, connection.our_state, connection.their_state


@pytest.mark.parametrize(("request_name", "response_name"),
                         list(itertools.product(REQUESTS, RESPONSES)))
def test_lean_connection_sends_what_h11_sends(request_name: str, response_name: str) -> None:
    status, headers = RESPONSES[response_name]
    request = REQUESTS[request_name]
    expected = _exchange(h11.Connection(h11.SERVER), request, status, headers)
    assert _exchange(LeanH11Connection(h11.SERVER), request, status, headers) == expected


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
