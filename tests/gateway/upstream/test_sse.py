"""SSE framing: event-aligned forwarding, usage stripping, error events (pure)."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cortex.gateway.upstream import sse
from cortex.gateway.upstream.sse import (
    EventStreamCheck,
    SSEForwarder,
    cached_tokens_of,
    is_event_stream,
    sse_error_event,
)


def chunk(content: str) -> bytes:
    obj = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content":
                                                                                  content}}]}
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


USAGE = (b'data: {"object":"chat.completion.chunk","choices":[],"usage":{"prompt_tokens":40,'
         b'"completion_tokens":3,"prompt_tokens_details":{"cached_tokens":32}}}\n\n')
STREAM = chunk("Hel") + chunk("lo") + USAGE + b"data: [DONE]\n\n"


def feed_all(forwarder: SSEForwarder, parts: list[bytes]) -> bytes:
    out = b"".join(forwarder.feed(p) for p in parts)
    return out + forwarder.finish()


@given(st.lists(st.integers(min_value=1, max_value=len(STREAM) - 1), max_size=12))
def test_any_chunking_forwards_the_same_events(cuts: list[int]) -> None:
    points = sorted(set(cuts))
    parts = [STREAM[a:b] for a, b in zip([0, *points], [*points, len(STREAM)], strict=True)]
    kept = SSEForwarder(strip_usage=False)
    assert feed_all(kept, parts) == STREAM
    stripped = SSEForwarder(strip_usage=True)
    assert feed_all(stripped, parts) == chunk("Hel") + chunk("lo") + b"data: [DONE]\n\n"
    for forwarder in (kept, stripped):
        assert forwarder.done and forwarder.cached_tokens == 32


def test_partial_event_is_held_until_its_blank_line() -> None:
    forwarder = SSEForwarder(strip_usage=True)
    assert forwarder.feed(b'data: {"choices":[{"delta":') == b""
    assert forwarder.feed(b'{}}]}\n') == b""
    assert forwarder.feed(b"\n") == b'data: {"choices":[{"delta":{}}]}\n\n'


def test_crlf_events_and_generate_meta_info() -> None:
    forwarder = SSEForwarder(strip_usage=False)
    data = (b'data: {"text":"a","meta_info":{"cached_tokens":5}}\r\n\r\n'
            b'data: {"text":"ab","meta_info":{"cached_tokens":16}}\r\n\r\ndata: [DONE]\r\n\r\n')
    assert forwarder.feed(data) == data
    assert forwarder.done and forwarder.cached_tokens == 16


def test_missing_done_is_visible() -> None:
    forwarder = SSEForwarder(strip_usage=True)
    assert forwarder.feed(chunk("x")) == chunk("x")
    assert forwarder.finish() == b"" and not forwarder.done


def test_error_event_shape() -> None:
    event = sse_error_event("worker failed", "upstream_stream_error")
    first, done = event.split(b"\n\n")[:2]
    assert json.loads(first.removeprefix(b"data: "))["error"]["code"] == "upstream_stream_error"
    assert done == b"data: [DONE]"


def test_cached_tokens_of_shapes() -> None:
    assert cached_tokens_of({"usage": {"prompt_tokens_details": {"cached_tokens": 7}}}) == 7
    assert cached_tokens_of({"meta_info": {"cached_tokens": 3}}) == 3
    assert cached_tokens_of({"usage": {"prompt_tokens": 3}}) is None
    assert cached_tokens_of(None) is None


def test_keepalives_and_done_inside_text_do_not_confuse_the_forwarder() -> None:
    forwarder = SSEForwarder(strip_usage=False)
    text = chunk("the model says data: [DONE] here")
    assert forwarder.feed(text) == text and not forwarder.done
    assert forwarder.feed(USAGE) == USAGE
    assert forwarder.feed(b": keep-alive\n\n") == b": keep-alive\n\n"
    assert forwarder.feed(b"data: [DONE]\n\n") == b"data: [DONE]\n\n"
    assert forwarder.done and forwarder.cached_tokens == 32


# ---- what counts as the engines' SSE ----

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


def test_a_relayed_stream_is_checked_across_chunk_borders() -> None:
    check = EventStreamCheck()
    halves = GOOD[:7], GOOD[7:]
    assert check.feed(halves[0]) and check.feed(halves[1]) and check.feed(b"da")
    assert check.feed(b"ta: [DONE]\n\n")
    broken = EventStreamCheck()
    assert broken.feed(GOOD) and not broken.feed(b"this is not an event stream\n\n")


def test_the_forwarder_flags_and_withholds_a_malformed_event() -> None:
    forwarder = SSEForwarder(strip_usage=False)
    assert forwarder.feed(GOOD) == GOOD and not forwarder.malformed
    assert forwarder.feed(b"this is not an event stream\n\n") == b""
    assert forwarder.malformed


def _well_formed_by_lines(block: bytes) -> bool:
    """The rule line by line (the reference the regex is checked against)."""
    for line in block.replace(b"\r\n", b"\n").split(b"\n"):
        if not line:
            continue
        if line.startswith(b"data:"):
            payload = line[5:].lstrip(b" ")
            if not payload.startswith(b"{") and payload != b"[DONE]":
                return False
        elif not line.startswith((b"data:", b":", b"event:", b"id:", b"retry:")):
            return False
    return True


def test_well_formed_agrees_with_the_rule_line_by_line() -> None:
    rng = random.Random(5)
    pieces = [b"data: ", b"data:", b"data:  ", b"{", b'"x": 1}', b"[DONE]", b"[DONE]x", b": ",
              b"event: m", b"id: 3", b"retry: 9", b"\n", b"\r\n", b"\r", b"\n\n", b"hi",
              b" ", b"da", b"ta:", b"}", b"\xff"]
    agreed = accepted = 0
    for _ in range(3000):
        block = b"".join(rng.choice(pieces) for _ in range(rng.randint(0, 12)))
        expected = _well_formed_by_lines(block)
        assert sse._well_formed(block) == expected, block
        agreed += 1
        accepted += expected
    assert agreed == 3000 and 300 < accepted < 2700  # both answers were exercised
