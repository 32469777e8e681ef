"""Anthropic Messages → the engine's chat request (``cortex.chat.messages_api``).

The corpus check: ``agent_requests`` holds 300 agent-shaped Messages bodies (long system
prompt and tool schema, tool_use / tool_result turns, thinking enabled / disabled / absent,
billing headers, late system reminders) and what vLLM 0.32's and SGLang 0.5.23's own
conversion code made of each (``data/agent_apis.json.gz``, written by
``tools/realengines/agent_goldens.py``), for two templates whose probes differ. Cortex's
prompt must equal the prompt of the engine's chat request for every body (0 mismatches),
and what the engine refused Cortex refuses. Against a running vLLM:
``tests/realengines/test_real_agent_apis.py``.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from cortex.chat import ChatError, RenderArgs
from cortex.chat.errors import UnmodelledRequest
from cortex.chat.messages_api import (
    MessagesOptions,
    merges_inline_system,
    messages_chat_body,
    messages_options,
    messages_render_args,
)
from cortex.hashing import Engine

from .agent_requests import count_mismatches, golden, tokenizer


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize("template", ["qwen3.5", "deepseek_v4"])
def test_zero_token_mismatches_against_the_engines_conversion(template: str,
                                                              engine: str) -> None:
    kind = Engine(engine)
    options = messages_options(tokenizer(template), kind)
    ref = golden()["templates"][template][engine]
    assert options.merge_inline_system == ref["merge_inline_system"]
    if kind is Engine.VLLM:
        assert options.disabled_thinking_effort == ref["disabled_thinking_effort"]
    compared, refused, mismatches = count_mismatches(
        "messages", template, engine,
        lambda chat, body: chat.prompt(messages_render_args(body, kind, options)))
    assert mismatches == 0
    assert compared >= 200, (compared, refused)
    if kind is Engine.SGLANG:  # the tools the template sees, key order included
        for body, theirs in zip(golden()["messages"], ref["messages"], strict=True):
            if "error" not in theirs:
                assert _tool_json(messages_render_args(body, kind, options)) == json.dumps(
                    _template_tools(theirs))


def _tool_json(args: RenderArgs) -> str:
    return json.dumps(list(args.tools) if args.tools else None)


def _template_tools(chat: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The tools SGLang's ``_process_messages`` hands the template for a chat body."""
    tools, choice = chat.get("tools"), chat.get("tool_choice")
    if not tools or choice == "none":
        return None
    if isinstance(choice, dict):
        return [t for t in tools if t["function"]["name"] == choice["function"]["name"]] or None
    return list(tools)


def test_inline_system_probes() -> None:
    # a template that refuses a late system message merges it (both engines); one that
    # renders it keeps it in place (vLLM), SGLang also requires its text in the output
    refusing = ("{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
                "{{ raise_exception('late system') }}{% endif %}{{ m.content }}{% endfor %}")
    dropping = "{% for m in messages %}{% if m.role != 'system' or loop.first %}" \
               "{{ m.content }}{% endif %}{% endfor %}"
    keeping = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    assert merges_inline_system(refusing, Engine.VLLM)
    assert merges_inline_system(refusing, Engine.SGLANG)
    assert not merges_inline_system(dropping, Engine.VLLM)
    assert merges_inline_system(dropping, Engine.SGLANG)
    assert not merges_inline_system(keeping, Engine.VLLM)
    assert not merges_inline_system(keeping, Engine.SGLANG)
    assert merges_inline_system(None, Engine.VLLM)


BASE = {"model": "m", "max_tokens": 64}


def test_vllm_messages_conversion_details() -> None:
    body = {**BASE, "system": [
        {"type": "text", "text": "x-anthropic-billing-header: cch=1;"},
        {"type": "text", "text": "A"}, {"type": "text", "text": "B"}],
        "tools": [{"name": "t", "input_schema": {"properties": {}}, "strict": True}],
        "thinking": {"type": "disabled"},
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hm", "signature": "s"},
                {"type": "tool_use", "id": "u1", "name": "t", "input": {"a": 1}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "u1",
                 "content": [{"type": "text", "text": "r1"}, {"type": "text", "text": "r2"}]},
                {"type": "text", "text": "next"}]},
            {"role": "system", "content": "late"}]}
    chat = messages_chat_body(body, Engine.VLLM, MessagesOptions(merge_inline_system=True,
                                                                  disabled_thinking_effort="low"))
    assert chat["messages"] == [
        {"role": "system", "content": "ABlate"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "reasoning": "hm", "tool_calls": [
            {"id": "u1", "type": "function",
             "function": {"name": "t", "arguments": "{\"a\": 1}"}}]},
        {"role": "tool", "tool_call_id": "u1", "content": "r1\nr2"},
        {"role": "user", "content": "next"}]
    assert chat["reasoning_effort"] == "low"
    assert chat["tools"] == [{"type": "function", "function": {
        "name": "t", "description": None, "parameters": {"properties": {}, "type": "object"},
        "strict": True}}]


def test_sglang_messages_conversion_details() -> None:
    body = {**BASE, "system": "S", "tools": [{"name": "t", "input_schema": {}}],
            "tool_choice": {"type": "any"}, "messages": [
                {"role": "user", "content": [
                    {"type": "text", "text": "before"},
                    {"type": "tool_result", "tool_use_id": "u1", "content": "r"},
                    {"type": "text", "text": "after"}]},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "dropped", "signature": "s"}]}]}
    chat = messages_chat_body(body, Engine.SGLANG)
    assert chat["messages"] == [
        {"role": "system", "content": "S"}, {"role": "user", "content": "before"},
        {"role": "tool", "tool_call_id": "u1", "content": "r"},
        {"role": "user", "content": "after"}, {"role": "assistant", "content": ""}]
    assert chat["tool_choice"] == "required"
    assert chat["tools"][0]["function"]["description"] == ""
    with pytest.raises(ChatError, match="reasoning parser"):
        messages_chat_body({**body, "thinking": {"type": "enabled", "budget_tokens": 2048}},
                           Engine.SGLANG)


@pytest.mark.parametrize("engine", [Engine.VLLM, Engine.SGLANG])
def test_messages_rejections_and_unmodelled(engine: Engine) -> None:
    ok = {**BASE, "messages": [{"role": "user", "content": "hi"}]}
    messages_chat_body(ok, engine)
    for bad, param in (({**ok, "max_tokens": 0}, "max_tokens"),
                       ({**ok, "model": None}, "model"),
                       ({**ok, "messages": [{"role": "tool", "content": "x"}]}, "messages"),
                       ({**ok, "tool_choice": {"type": "tool"}}, "tool_choice"),
                       ({**ok, "tools": [{"name": "t"}]}, "tools")):
        with pytest.raises(ChatError) as raised:
            messages_chat_body(bad, engine)
        assert raised.value.param == param
    image = {"type": "image", "source": {"type": "url", "url": "http://x/a.png"}}
    with pytest.raises(UnmodelledRequest):
        messages_chat_body({**ok, "messages": [{"role": "user", "content": [image]}]}, engine)
    with pytest.raises(UnmodelledRequest):
        messages_chat_body({**ok, "tools": [{"type": "web_search_20250305",
                                             "name": "web_search"}]}, engine)


