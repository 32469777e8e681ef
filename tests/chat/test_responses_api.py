"""A stateless Responses body → the engine's chat request (``cortex.chat.responses_api``).

The corpus checks: 240 Codex-style bodies (instructions, tools, reasoning items, function
calls and outputs, assistant messages) against vLLM 0.32's own conversion
(``data/agent_apis.json.gz``, see ``test_messages_api``), and those plus 260 bodies of the
shapes SGLang decides on its own (developer items, assistant phases, reasoning summaries and
replayed state, non-object arguments, parallel calls, custom tools, tool choices, reasoning
settings, refusals) against SGLang 0.5.23's own conversion (``data/sglang_responses.json.gz``,
its ``serving_responses.py`` run from the wheel by
``tools/realengines/sglang_responses_reference.py``): 0 mismatches for both.
"""

from __future__ import annotations

import base64
import json
import zlib
from typing import Any

import pytest

from cortex.chat import ChatError, ChatPrompt, RenderArgs, render_args
from cortex.chat.errors import UnmodelledRequest
from cortex.chat.messages_api import MessagesOptions, messages_options
from cortex.chat.responses_api import responses_chat_body, responses_render_args
from cortex.hashing import Engine

from .agent_requests import (
    count_mismatches,
    prompt_or_error,
    sglang_responses_golden,
    tokenizer,
)


@pytest.mark.parametrize("template", ["qwen3.5", "deepseek_v4"])
def test_zero_token_mismatches_against_vllms_conversion(template: str) -> None:
    compared, refused, mismatches = count_mismatches(
        "responses", template, "vllm",
        lambda chat, body: chat.prompt(responses_render_args(body, Engine.VLLM)))
    assert mismatches == 0
    assert compared >= 200, (compared, refused)


def test_responses_conversion_details() -> None:
    body = {"model": "m", "instructions": "I", "reasoning": {"effort": "none"}, "input": [
        {"type": "reasoning", "id": "r", "summary": [{"type": "summary_text", "text": "s"}]},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c", "output": "o"},
        {"type": "message", "role": "assistant", "status": "incomplete",
         "content": [{"type": "output_text", "text": "par"}]}],
        "tools": [{"type": "function", "name": "f", "parameters": {}},
                  {"type": "web_search_preview"}]}
    chat = responses_chat_body(body, Engine.VLLM)
    assert chat["messages"] == [
        {"role": "system", "content": "I"},
        {"role": "assistant", "reasoning": "s", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "content": "o", "tool_call_id": "c"},
        {"role": "assistant", "content": "par"}]
    assert (chat["add_generation_prompt"], chat["continue_final_message"]) == (False, True)
    assert chat["reasoning_effort"] == "none"
    assert [t["function"]["name"] for t in chat["tools"]] == ["f"]
    args = render_args(chat, Engine.VLLM)
    assert args.template_kwargs["enable_thinking"] is False
    for unmodelled in ({**body, "previous_response_id": "resp_1"},
                       {**body, "tools": [{"type": "custom", "name": "patch"}]}):
        with pytest.raises(UnmodelledRequest):
            responses_chat_body(unmodelled, Engine.VLLM)
    with pytest.raises(ChatError):
        responses_chat_body({"model": "m", "input": [{"type": "item_reference", "id": "x"}]},
                            Engine.VLLM)


def test_developer_messages_become_system_where_the_template_lacks_the_role() -> None:
    # found by the real-engine test: vLLM 0.32 converts them (renderers/hf.py) and merges
    # the system messages into one, for a template that never names 'developer' (Qwen3.5)
    chat = tokenizer("qwen3.5")
    body = {"model": "m", "instructions": "I", "input": [
        {"type": "message", "role": "developer",
         "content": [{"type": "input_text", "text": "D"}]},
        {"role": "user", "content": "hi"}]}
    expected = RenderArgs.of(Engine.VLLM, [{"role": "system", "content": "I\n\nD"},
                                           {"role": "user", "content": "hi"}])
    assert chat.render(responses_render_args(body, Engine.VLLM)) == chat.render(expected)


@pytest.mark.parametrize("template", ["qwen3.5", "deepseek_v4"])
def test_zero_token_mismatches_against_sglangs_conversion(template: str) -> None:
    data = sglang_responses_golden()
    ref = data["templates"][template]
    chat = tokenizer(template)
    options = messages_options(chat, Engine.SGLANG)
    # SGLang's own probe of the template (detect_inline_system_support) agrees with Cortex's
    assert options.merge_inline_system is not ref["supports_inline_system"]
    compared = refused = mismatches = 0
    for i, (body, theirs) in enumerate(zip(data["responses"], ref["responses"], strict=True)):
        args = prompt_or_error(lambda b=body: responses_render_args(b, Engine.SGLANG, options))
        if "error" in theirs:  # SGLang answers a 400: so does Cortex
            assert isinstance(args, ChatError), (i, theirs["error"], args)
            refused += 1
            continue
        assert isinstance(args, RenderArgs), (i, args)
        theirs = dict(theirs)
        template_tools = theirs.pop("template_tools")
        # the tools the template sees, key order included (templates write them as JSON)
        assert json.dumps(list(args.tools) if args.tools else None) == json.dumps(
            template_tools), i
        mine, expected = chat.prompt(args), chat.prompt(render_args(theirs, Engine.SGLANG))
        compared += 1
        mismatches += mine != expected
        if compared % 25 == 1:
            assert isinstance(mine, ChatPrompt) and isinstance(expected, ChatPrompt)
            assert chat.encode_prompt(mine) == chat.encode_prompt(expected)
    assert mismatches == 0
    assert compared >= 450 and refused >= 10, (compared, refused)


def _blob(text: str) -> str:
    return "sglang-reasoning-v1." + base64.urlsafe_b64encode(
        zlib.compress(text.encode())).decode()


CALL = {"type": "function", "function": {"name": "f", "arguments": "{}"}}


def test_sglang_responses_conversion_details() -> None:
    # golden cases read off SGLang 0.5.23's serving_responses.py
    body: dict[str, Any] = {
        "model": "m", "instructions": "I", "reasoning": {"summary": "auto"},
        "tools": [{"type": "function", "name": "f", "parameters": {}},
                  {"type": "custom", "name": "patch", "format": {
                      "type": "grammar", "syntax": "lark", "definition": "start: /x/"}},
                  {"type": "web_search"}],
        "input": [
            {"type": "message", "role": "developer",
             "content": [{"type": "input_text", "text": "D"}]},
            {"role": "user", "content": "hi"},
            {"type": "reasoning", "id": "r1", "summary": [{"type": "summary_text", "text": "s"}],
             "content": [{"type": "reasoning_text", "text": "ignored: a summary is there"}]},
            {"type": "message", "role": "assistant", "id": "m1", "status": "completed",
             "content": [{"type": "output_text", "text": "looking", "annotations": []}]},
            {"type": "function_call", "id": "fc1", "name": "f", "arguments": "[1]"},
            {"type": "function_call", "call_id": "c2", "name": "f", "arguments": {"a": 1}},
            {"type": "function_call_output", "call_id": "fc1",
             "output": [{"type": "input_text", "text": "o"}, {"type": "input_text", "text": "k"}]},
            {"type": "reasoning", "summary": [], "encrypted_content": "opaque"},
            {"type": "reasoning", "summary": [], "encrypted_content": _blob("kept")},
            {"type": "message", "role": "assistant", "phase": "final_answer",
             "content": "done"},
            {"type": "message", "role": "assistant", "phase": "commentary", "content": "more"},
            {"type": "custom_tool_call", "call_id": "c3", "name": "patch", "input": "diff"},
            {"type": "custom_tool_call_output", "call_id": "c3", "output": "ok"}]}
    chat = responses_chat_body(body, Engine.SGLANG, MessagesOptions(merge_inline_system=True))
    call = {"type": "function", "function": {}}
    assert chat["messages"] == [
        {"role": "system", "content": "I\n\nDeveloper instructions:\nD"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "reasoning_content": "s",
         "content": [{"type": "text", "text": "looking"}],
         "tool_calls": [{**call, "id": "fc1", "function": {"name": "f", "arguments": "{}"}},
                        {**call, "id": "c2", "function": {"name": "f",
                                                          "arguments": '{"a":1}'}}]},
        {"role": "tool", "tool_call_id": "fc1", "content": "ok"},
        # the reasoning joins the next message whatever its phase; a phase change splits
        {"role": "assistant", "reasoning_content": "kept", "content": "done",
         "phase": "final_answer"},
        {"role": "assistant", "content": "more", "phase": "commentary"},
        # a call (no phase) after a phased message stays a message of its own
        {"role": "assistant", "tool_calls": [
            {**call, "id": "c3", "function": {"name": "patch",
                                              "arguments": '{"input": "diff"}'}}]},
        {"role": "tool", "tool_call_id": "c3", "content": "ok"}]
    assert chat["reasoning_effort"] == "medium"  # reasoning given without an effort
    assert chat["tool_choice"] == "auto"
    assert [t["function"]["name"] for t in chat["tools"]] == ["f", "patch"]
    assert chat["tools"][1]["function"]["description"] == (
        "The payload must conform to this lark grammar:\nstart: /x/")
    assert chat["tools"][1]["function"]["parameters"]["required"] == ["input"]
    # a template that renders late system messages keeps them in place
    kept = responses_chat_body(body, Engine.SGLANG, MessagesOptions(merge_inline_system=False))
    assert kept["messages"][:2] == [
        {"role": "system", "content": "I"},
        {"role": "system", "content": [{"type": "text", "text": "Developer instructions:\nD"}]}]


def test_sglang_responses_settings_and_refusals() -> None:
    base = {"model": "m", "input": "hi"}
    chat = responses_chat_body({**base, "reasoning": {"effort": "none"},
                                "chat_template_kwargs": {"thinking": True}}, Engine.SGLANG)
    assert chat["chat_template_kwargs"] == {"thinking": True, "enable_thinking": False}
    assert chat["messages"] == [{"role": "user", "content": "hi"}]
    assert chat["tool_choice"] == "none"  # no tool left for chat
    args = responses_render_args({**base, "reasoning": {"effort": "high"}}, Engine.SGLANG)
    assert args.template_kwargs == {"reasoning_effort": "high", "thinking": True,
                                    "enable_thinking": True}
    tools = [{"type": "function", "name": "f"}, {"type": "function", "name": "g"}]
    named = responses_render_args({**base, "tools": tools,
                                   "tool_choice": {"type": "function", "name": "g"}},
                                  Engine.SGLANG)
    assert named.tools is not None and [t["function"]["name"] for t in named.tools] == ["g"]
    hosted = responses_chat_body({**base, "tools": tools,
                                  "tool_choice": {"type": "web_search_preview"}}, Engine.SGLANG)
    assert hosted["tool_choice"] == "auto"
    for bad, param in (({"tools": [{"type": "shell"}]}, "tools"),
                       ({"tools": [{"type": "function"}]}, "tools"),
                       ({"tools": [{"type": "function", "name": "f", "strict": None}]}, "tools"),
                       ({"tool_choice": "required"}, "tool_choice"),
                       ({"tools": tools, "tool_choice": {"type": "function", "name": "h"}},
                        "tool_choice"),
                       ({"reasoning": {"effort": "extreme"}}, "reasoning"),
                       ({"input": [{"type": "item_reference", "id": "x"}]}, "input")):
        with pytest.raises(ChatError) as raised:
            responses_chat_body({**base, **bad}, Engine.SGLANG)
        assert raised.value.param == param, bad
    for unmodelled in ({**base, "previous_response_id": "resp_1"}, {**base, "background": True}):
        with pytest.raises(UnmodelledRequest):
            responses_chat_body(unmodelled, Engine.SGLANG)
