"""What counts as the engines' SSE (cortex.gateway.upstream.sse), pure."""

from __future__ import annotations

import pytest

from cortex.gateway.upstream.sse import SSEForwarder, is_event_stream

GOOD = b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\n'


@pytest.mark.parametrize("head", [
    GOOD, GOOD + b"data: [DONE]\n\n", b": keep-alive\n\n" + GOOD, b"da", b"data: {\"ch",
    b"event: message\r\ndata: {}\r\n\r\n", b"\n",
])
def test_the_start_of_an_event_stream_is_recognised(head: bytes) -> None:
    assert is_event_stream(head)


@pytest.mark.parametrize("head", [
    b"<html>", b'{"id": "x", "choices": []}', b"data: hello\n\n", GOOD + b"garbage\n\n",
    b"hello world",
])
def test_anything_else_is_not(head: bytes) -> None:
    assert not is_event_stream(head)


def test_the_forwarder_flags_and_withholds_a_malformed_event() -> None:
    forwarder = SSEForwarder(strip_usage=False)
    assert forwarder.feed(GOOD) == GOOD and not forwarder.malformed
    assert forwarder.feed(b"this is not an event stream\n\n") == b""
    assert forwarder.malformed
