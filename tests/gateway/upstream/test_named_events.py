"""NamedEventStream: Anthropic / Responses SSE relayed byte for byte, usage and end read."""

from __future__ import annotations

import json
from typing import Any

from cortex.gateway.upstream.named_events import NamedEventStream
from cortex.gateway.upstream.sse import cached_tokens_of


def event(obj: dict[str, Any]) -> bytes:
    return f"event: {obj['type']}\ndata: {json.dumps(obj)}\n\n".encode()


MESSAGES = b"".join(event(e) for e in (
    {"type": "message_start", "message": {"id": "msg_1", "usage": {
        "input_tokens": 3, "output_tokens": 0, "cache_read_input_tokens": 32}}},
    {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
    {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "hi"}},
    {"type": "content_block_stop", "index": 0},
    {"type": "message_delta", "delta": {"stop_reason": "end_turn"},
     "usage": {"input_tokens": 3, "output_tokens": 1, "cache_read_input_tokens": 32}},
    {"type": "message_stop"}))

RESPONSES = b"".join(event(e) for e in (
    {"type": "response.created", "response": {"id": "resp_9", "usage": None}},
    {"type": "response.output_text.delta", "delta": "hi"},
    {"type": "response.completed", "response": {"id": "resp_9", "usage": {
        "input_tokens": 40, "input_tokens_details": {"cached_tokens": 16},
        "output_tokens": 1}}}))


def feed_split(data: bytes, at: int) -> tuple[NamedEventStream, bytes]:
    stream = NamedEventStream()
    out = b""
    for i in range(0, len(data), at):
        out += stream.feed(data[i:i + at])
    return stream, out


def test_messages_stream_is_relayed_untouched_and_its_usage_read() -> None:
    for at in (1, 7, 64, len(MESSAGES)):
        stream, out = feed_split(MESSAGES, at)
        assert out == MESSAGES and stream.done and not stream.malformed
        assert cached_tokens_of(stream.usage_holder) == 32
        assert stream.response_id is None


def test_responses_stream_gives_its_id_and_cached_tokens() -> None:
    stream, out = feed_split(RESPONSES, 5)
    assert out == RESPONSES and stream.done
    assert stream.response_id == "resp_9"
    assert cached_tokens_of(stream.usage_holder) == 16


def test_an_unfinished_or_broken_stream_is_seen() -> None:
    stream, _ = feed_split(MESSAGES[:MESSAGES.index(b"event: message_stop")], 9)
    assert not stream.done
    broken = NamedEventStream()
    broken.feed(b"event: message_start\n")
    assert broken.feed(b"<html>oops</html>\n\n") == b"" and broken.malformed
    assert NamedEventStream().usage_holder is None
