"""The picker's reading of an answer it saw pass (pure): where the engine's usage is."""

from __future__ import annotations

from cortex.gateway.epp.picker import answer_object

USAGE = b'"usage":{"prompt_tokens":40,"prompt_tokens_details":{"cached_tokens":32}}'


def test_a_json_answer_is_the_object() -> None:
    assert answer_object(b'{"choices":[],' + USAGE + b"}")["usage"]["prompt_tokens"] == 40


def test_a_stream_s_usage_is_its_last_event_with_one() -> None:
    stream = (b'data: {"choices":[{"delta":{"content":"a"}}],"usage":null}\n\n'
              b'data: {"choices":[],' + USAGE + b"}\n\n"
              b"data: [DONE]\n\n")
    event = answer_object(stream)
    assert event["usage"]["prompt_tokens_details"]["cached_tokens"] == 32


def test_no_usage_or_no_json_is_none() -> None:
    assert answer_object(b'data: {"choices":[]}\n\ndata: [DONE]\n\n') is None
    assert answer_object(b"{not json") is None
    assert answer_object(b"") is None
