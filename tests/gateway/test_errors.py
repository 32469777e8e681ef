"""The error objects: OpenAI's, and Anthropic's for the Messages API (pure)."""

from __future__ import annotations

import json

import pytest

from cortex.gateway.errors import (
    ErrorCode,
    anthropic_error,
    anthropic_error_event,
    error_body,
    relayed_error,
)


@pytest.mark.parametrize(("status", "kind"), [
    (400, "invalid_request_error"), (401, "authentication_error"), (403, "permission_error"),
    (404, "not_found_error"), (405, "invalid_request_error"), (413, "request_too_large"),
    (429, "rate_limit_error"), (500, "api_error"), (502, "api_error"), (503, "overloaded_error"),
    (504, "api_error")])
def test_an_openai_error_becomes_anthropics_with_its_message(status: int, kind: str) -> None:
    openai = error_body(status, "max_tokens: must be at least 1", ErrorCode.INVALID_REQUEST,
                        "max_tokens")
    assert json.loads(anthropic_error(status, openai)) == {
        "type": "error", "error": {"type": kind, "message": "max_tokens: must be at least 1"}}


def test_an_engine_anthropic_error_passes_unchanged_and_garbage_says_only_the_status() -> None:
    engine = b'{"type":"error","error":{"type":"invalid_request_error","message":"bad tool"}}'
    assert anthropic_error(400, engine) == engine
    for garbage in (b"<html>oops</html>", b"", b"[1, 2]", b'{"error": "text"}', b"\xff"):
        assert json.loads(anthropic_error(502, garbage)) == {
            "type": "error", "error": {"type": "api_error",
                                       "message": "the request failed (HTTP 502)"}}
    # a relayed engine refusal keeps its message through both shapes
    status, body = relayed_error(400, b'{"object": "error", "message": "too many tools"}')
    assert json.loads(anthropic_error(status, body))["error"]["message"] == "too many tools"


def test_a_stream_error_is_a_named_anthropic_event_without_done() -> None:
    event = anthropic_error_event(504, "the worker stopped sending")
    name, data, *rest = event.split(b"\n")
    assert name == b"event: error" and rest == [b"", b""]
    assert json.loads(data.removeprefix(b"data: ")) == {
        "type": "error", "error": {"type": "api_error", "message": "the worker stopped sending"}}
    assert b"[DONE]" not in event
