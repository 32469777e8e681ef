"""What a response's answers become for the next turn (pure): a stream folds into the
same messages as the JSON body of the same answer, whatever junk it carries."""

from __future__ import annotations

import json
from typing import Any

import pytest

from cortex.gateway.tokens.answers import chat_answers, completion_answers, stream_objects

pytestmark = pytest.mark.timeout(10)


def sse(*objects: Any) -> bytes:
    return b"".join(b"data: " + json.dumps(o).encode() + b"\n\n" for o in objects)


def test_a_streamed_chat_answer_folds_into_the_message_of_its_body() -> None:
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}
    body = {"choices": [{"index": 0, "message": {
        "role": "assistant", "content": "Sunny.", "reasoning_content": "look it up",
        "tool_calls": [call]}}]}
    events = sse(
        {"choices": [{"index": 0, "delta": {"role": "assistant", "reasoning_content": "look "}}]},
        {"choices": [{"index": 0, "delta": {"reasoning_content": "it up"}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 0, "id": "call_1", "function": {"name": "get_weather", "arguments": ""}}]}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 0, "function": {"arguments": '{"city":'}}]}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 0, "function": {"arguments": '"Paris"}'}}]}}]},
        {"choices": [{"index": 0, "delta": {"content": "Sun"}}]},
        {"choices": [{"index": 0, "delta": {"content": "ny."}}]},
        {"choices": [], "usage": {"prompt_tokens": 3}},
    ) + b"data: [DONE]\n\n"
    assert chat_answers(events=events) == chat_answers(obj=body) == [body["choices"][0]["message"]]


def test_choices_come_back_by_index_and_at_most_four() -> None:
    events = sse(*({"choices": [{"index": i, "text": f"t{i}"}]} for i in (5, 1, 0, 1)))
    assert completion_answers(events=events) == ["t0", "t1t1"]
    body = {"choices": [{"index": 0, "text": "a"}, {"index": 9, "text": "dropped"}]}
    assert completion_answers(obj=body) == ["a"]


def test_junk_yields_no_answer_and_nothing_raises() -> None:
    junk = b"data: {not json\n\n: a comment\n\ndata: [1,2]\n\ndata: [DONE]\n\n"
    assert list(stream_objects(junk)) == []
    assert chat_answers(events=junk) == [] and completion_answers(events=junk) == []
    assert chat_answers() == [] and completion_answers() == []
    assert chat_answers(obj={"choices": "nope"}) == []
    assert chat_answers(obj={"choices": [{"index": 0, "message": "nope"}]}) == []
    crlf = b'data: {"choices":[{"index":0,"text":"x"}]}\r\n\r\n'
    assert completion_answers(events=crlf) == ["x"]
