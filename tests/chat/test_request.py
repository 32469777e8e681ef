"""A chat request body → each engine's rendering arguments."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from cortex.chat import InvalidChatRequest, RenderArgs, render_args, text_add_special_tokens
from cortex.hashing import Engine

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"},
                                         "x_extra": 1}}
CALL = {"id": "c1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def body(*messages: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": list(messages) or [{"role": "user", "content": "hi"}],
            **extra}


def test_vllm_request_fields_override_template_kwargs() -> None:
    args = render_args(body(add_generation_prompt=False, continue_final_message=True,
                            reasoning_effort="low", documents=[{"title": "t", "text": "x"}],
                            chat_template_kwargs={"add_generation_prompt": True, "thinking": 1,
                                                  "documents": None}), Engine.VLLM)
    assert (args.add_generation_prompt, args.continue_final_message) == (False, True)
    assert args.documents == ({"title": "t", "text": "x"},)
    assert args.template_kwargs == {"thinking": 1, "reasoning_effort": "low",
                                    "enable_thinking": True}
    assert args.add_special_tokens is False
    assert render_args(body(add_special_tokens=True), Engine.VLLM).add_special_tokens is True
    plain = render_args(body(), Engine.VLLM)
    assert (plain.add_generation_prompt, plain.template_kwargs, plain.tools) == (True, {}, None)


@pytest.mark.parametrize(("extra", "param"), [
    ({"continue_final_message": True}, "continue_final_message"),  # generation prompt too
    ({"chat_template": "{{ x }}"}, "chat_template"),
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": []}, "chat_template_kwargs"),
    ({"add_generation_prompt": "yes"}, "add_generation_prompt"),
    ({"tools": [{"type": "function"}]}, "messages"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools"),
])
def test_vllm_rejects_what_vllm_rejects(extra: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidChatRequest) as caught:
        render_args(body(**extra), Engine.VLLM)
    assert caught.value.param == param


def test_vllm_messages_tools_and_tool_call_arguments() -> None:
    original = body({"role": "system", "content": "s", "ignored": 1},
                    {"role": "user", "content": ["a", {"type": "text", "text": "b"}],
                     "name": "ann"},
                    {"role": "assistant", "content": None, "tool_calls": [CALL],
                     "reasoning_content": "hmm"},
                    {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
                    {"role": "wizard", "content": "custom roles pass"},
                    tools=[TOOL])
    kept = copy.deepcopy(original)
    args = render_args(original, Engine.VLLM)
    assert original == kept  # the body is forwarded upstream: never modified
    system, user, assistant, tool, wizard = args.messages
    assert system == {"role": "system", "content": "s"}
    assert user["name"] == "ann" and user["content"] == ({"type": "text", "text": "a"},
                                                         {"type": "text", "text": "b"})
    assert assistant["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert assistant["reasoning"] == assistant["reasoning_content"] == "hmm"
    assert tool["tool_call_id"] == "c1" and wizard["role"] == "wizard"
    assert args.tools == ({"type": "function", "function": {
        "name": "get_weather", "description": None, "parameters": {"type": "object"},
        "x_extra": 1}},)
    empty = dict(CALL, function={"name": "f", "arguments": ""})
    args = render_args(body({"role": "assistant", "content": "", "tool_calls": [empty]},
                            add_generation_prompt=False), Engine.VLLM)
    assert args.messages[0]["tool_calls"][0]["function"]["arguments"] == {}
    # media parts are never refused: vLLM's parser hands the template {"type": modality}
    media = render_args(body({"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}},
        {"type": "input_audio", "input_audio": {}}, {"type": "video_url"}]}), Engine.VLLM)
    assert media.messages[0]["content"] == ({"type": "text", "text": "a"}, {"type": "image"},
                                            {"type": "audio"}, {"type": "video"})


def test_sglang_messages_are_its_model_dumps() -> None:
    args = render_args(body({"role": "SYSTEM", "content": "s"},
                            {"role": "user", "content": [{"type": "text", "text": "a"},
                                                         {"type": "image_url"}]},
                            {"role": "assistant", "content": None, "tool_calls": [CALL]},
                            {"role": "tool", "content": "sunny", "tool_call_id": "c1"}),
                       Engine.SGLANG)
    system, user, assistant, tool = args.messages
    assert system == {"role": "system", "content": "s"}
    assert user["content"] == ({"type": "text", "text": "a"}, {"type": "image_url"})
    assert assistant == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "index": None, "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    assert tool == {"role": "tool", "content": "sunny", "tool_call_id": "c1"}
    assert (args.add_generation_prompt, args.add_special_tokens) == (True, False)


@pytest.mark.parametrize("messages", [
    [{"role": "wizard", "content": "x"}],
    [{"role": "user"}],
    [{"role": "assistant", "content": "", "tool_calls": [dict(CALL, function={
        "name": "f", "arguments": "[1]"})]}],
    [{"role": "user", "content": 5}],
    [],
])
def test_sglang_rejects_what_sglang_rejects(messages: list[dict[str, Any]]) -> None:
    with pytest.raises(InvalidChatRequest):
        render_args({"messages": messages}, Engine.SGLANG)


def test_sglang_tools_follow_tool_choice_and_kwargs_follow_reasoning_effort() -> None:
    other = {"type": "function", "function": {"name": "other"}}
    assert render_args(body(tools=[TOOL], tool_choice="none"), Engine.SGLANG).tools is None
    args = render_args(body(tools=[TOOL, other]), Engine.SGLANG)
    # SGLang 0.5.23 dumps a function in the client's key order, then its other fields;
    # an unset strict / defer_loading is left out
    assert args.tools is not None and args.tools[0] == {
        "type": "function", "function": {"name": "get_weather",
                                         "parameters": {"type": "object"}, "description": None},
        "defer_loading": None}
    assert list(args.tools[0]["function"]) == ["name", "parameters", "description"]
    deferred = render_args(body(tools=[{"defer_loading": True, "function": {
        "strict": True, "name": "f"}}]), Engine.SGLANG)
    assert deferred.tools is not None and list(deferred.tools[0]["function"].items()) == [
        ("strict", True), ("name", "f"), ("description", None), ("parameters", None),
        ("defer_loading", True)]
    named = render_args(body(tools=[TOOL, other], tool_choice={
        "type": "function", "function": {"name": "other"}}), Engine.SGLANG)
    assert named.tools is not None and [t["function"]["name"] for t in named.tools] == ["other"]
    args = render_args(body(reasoning_effort="none", add_generation_prompt=False,
                            chat_template_kwargs={"thinking": True, "padding": True}),
                       Engine.SGLANG)
    assert args.template_kwargs == {"reasoning_effort": "none", "thinking": True,
                                    "enable_thinking": False}
    assert args.add_generation_prompt is True  # SGLang has no such request field
    with pytest.raises(InvalidChatRequest):
        render_args(body(chat_template_kwargs={"add_generation_prompt": False}), Engine.SGLANG)


def test_text_prompts_and_shorthand() -> None:
    assert text_add_special_tokens({}, Engine.VLLM) is True
    assert text_add_special_tokens({"add_special_tokens": False}, Engine.VLLM) is False
    assert text_add_special_tokens({"add_special_tokens": False}, Engine.SGLANG) is True
    with pytest.raises(InvalidChatRequest):
        text_add_special_tokens({"add_special_tokens": 1}, Engine.VLLM)
    assert RenderArgs.of("vllm", [{"role": "user", "content": "x"}],
                         add_special_tokens=True).add_special_tokens is True
