"""The sim's Messages / Responses answers: each engine's usage fields and event order."""

from __future__ import annotations

import json

import pytest

from cortex.chat import ChatTokenizer
from cortex.hashing import Engine
from cortex.sim import named_events as named
from cortex.sim.protocol import (
    Endpoint,
    RequestError,
    SequenceResult,
    parse_messages,
    parse_responses,
)
from cortex.sim.textgen import FinishReason, GenerationPlan

BODY = {"model": "m", "max_tokens": 4, "system": "S",
        "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def chat() -> ChatTokenizer:
    return ChatTokenizer.load()


def result(prompt: int = 40, cached: int = 32) -> SequenceResult:
    plan = GenerationPlan((5, 6), ("Hel", "lo"), FinishReason.LENGTH)
    return SequenceResult(index=0, prompt_tokens=prompt, cached_tokens=cached, plan=plan)


@pytest.mark.parametrize(("engine", "uncached"), [(Engine.VLLM, 8), (Engine.SGLANG, 40)])
def test_messages_usage_is_the_engines(chat: ChatTokenizer, engine: Engine, uncached: int
                                       ) -> None:
    req = parse_messages(BODY, chat, "m", engine=engine)
    assert req.endpoint is Endpoint.MESSAGES and req.max_tokens == 4
    answer = named.named_response(req, result(), engine)
    assert answer["usage"] == {"input_tokens": uncached, "output_tokens": 2,
                               "cache_read_input_tokens": 32}
    assert answer["content"] == [{"type": "text", "text": "Hello"}]
    assert answer["stop_reason"] == "max_tokens"
    events = [*named.opening_events(req, result(), engine), *named.piece_events(req, "Hel"),
              *named.closing_events(req, result(), engine)]
    assert [e["type"] for e in events] == [
        "message_start", "content_block_start", "content_block_delta", "content_block_stop",
        "message_delta", "message_stop"]
    wire = named.event_bytes(events[0]).decode()
    assert wire.startswith("event: message_start\ndata: {") and wire.endswith("}\n\n")
    assert json.loads(wire.split("data: ", 1)[1])["message"]["usage"]["output_tokens"] == 0


def test_responses_answer_and_stream(chat: ChatTokenizer) -> None:
    req = parse_responses({"model": "m", "input": "hi", "max_output_tokens": 3}, chat, "m",
                          engine=Engine.VLLM)
    assert req.request_id.startswith("resp_") and req.max_tokens == 3
    answer = named.named_response(req, result(), Engine.VLLM)
    assert answer["usage"]["input_tokens_details"] == {"cached_tokens": 32}
    assert answer["output"][0]["content"][0]["text"] == "Hello"
    events = named.numbered([*named.opening_events(req, result(), Engine.VLLM),
                             *named.closing_events(req, result(), Engine.VLLM)], 0)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["type"] == "response.created"
    assert events[-1]["response"]["usage"]["input_tokens"] == 40


def test_unmodelled_and_invalid_requests_are_refused(chat: ChatTokenizer) -> None:
    with pytest.raises(RequestError, match="not modelled"):  # it needs SGLang's store
        parse_responses({"model": "m", "input": "hi", "background": True}, chat, "m",
                        engine=Engine.SGLANG)
    with pytest.raises(RequestError, match="not modelled"):
        parse_responses({"model": "m", "input": "hi", "tools": [
            {"type": "custom", "name": "apply_patch"}]}, chat, "m", engine=Engine.VLLM)
    with pytest.raises(RequestError) as raised:
        parse_messages({**BODY, "max_tokens": 0}, chat, "m", engine=Engine.VLLM)
    assert raised.value.param == "max_tokens"
