"""Messages / Responses conversions against each engine's own code: zero token mismatches.

``data/agent_apis.json.gz`` holds an agent-shaped corpus (long system prompt and tool
schema, tool_use / tool_result turns, thinking on and off; 300 Messages and 240 Responses
bodies) and what vLLM 0.32's and SGLang 0.5.23's own conversion code made of each body — run
offline by ``tools/realengines/agent_goldens.py`` — for two chat templates whose probes
differ. For every body, Cortex's ids (:func:`messages_render_args` /
:func:`responses_render_args` + ``encode_chat``) must equal the ids of the engine's chat
request (its rendering by ``render_args`` + ``encode_chat`` is checked against
``transformers`` in ``test_chat_engine_exactness``), and what the engine refused Cortex
refuses. The real vLLM check is ``tests/realengines/test_real_agent_apis.py``.
"""

from __future__ import annotations

import functools
import gzip
import json
from pathlib import Path
from typing import Any

import pytest

from cortex.chat import ChatError, ChatPrompt, ChatTokenizer, render_args
from cortex.chat.errors import UnmodelledRequest
from cortex.chat.messages_api import (
    MessagesOptions,
    merges_inline_system,
    messages_chat_body,
    messages_options,
    messages_render_args,
)
from cortex.chat.responses_api import responses_chat_body, responses_render_args
from cortex.hashing import Engine

DATA = Path(__file__).parent / "data"


@functools.cache
def golden() -> dict[str, Any]:
    with gzip.open(DATA / "agent_apis.json.gz", "rt", encoding="utf-8") as f:
        loaded: dict[str, Any] = json.load(f)
    return loaded


@functools.cache
def tokenizer(name: str) -> ChatTokenizer:
    return ChatTokenizer.load(DATA / "qwen3.5" if name == "qwen3.5" else None)


def prompt_or_error(make: Any) -> ChatPrompt | Exception:
    """What the engine tokenizes (its ids are ``encode_prompt`` of it, a pure function: equal
    prompts are equal ids), or the refusal."""
    try:
        result: ChatPrompt = make()
    except (ChatError, UnmodelledRequest) as exc:
        return exc
    return result


CASES = [(t, e, a) for t in ("qwen3.5", "deepseek_v4") for e in ("vllm", "sglang")
         for a in ("messages", "responses") if not (e == "sglang" and a == "responses")]


@pytest.mark.parametrize(("template", "engine", "api"), CASES)
def test_zero_token_mismatches_against_the_engines_conversion(template: str, engine: str,
                                                              api: str) -> None:
    data = golden()
    chat = tokenizer(template)
    ref = data["templates"][template][engine]
    kind = Engine(engine)
    options = messages_options(chat, kind)
    assert options.merge_inline_system == ref["merge_inline_system"]
    if engine == "vllm":
        assert options.disabled_thinking_effort == ref["disabled_thinking_effort"]
    compared = refused = mismatches = 0
    for i, (body, theirs) in enumerate(zip(data[api], ref[api], strict=True)):
        if api == "messages":
            mine = prompt_or_error(lambda b=body: chat.prompt(
                messages_render_args(b, kind, options)))
        else:
            mine = prompt_or_error(lambda b=body: chat.prompt(responses_render_args(b, kind)))
        if "error" in theirs:
            assert isinstance(mine, ChatError), (i, theirs["error"], mine)
            refused += 1
            continue
        expected = prompt_or_error(lambda t=theirs: chat.prompt(render_args(t, kind)))
        if isinstance(expected, Exception):  # the template refuses the converted chat
            assert isinstance(mine, ChatError), (i, expected)
            refused += 1
            continue
        compared += 1
        mismatches += mine != expected
        if compared % 25 == 1:  # and the ids themselves, now and then
            assert isinstance(mine, ChatPrompt)
            assert chat.encode_prompt(mine) == chat.encode_prompt(expected)
    assert mismatches == 0
    assert compared >= 200, (compared, refused)


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
    with pytest.raises(UnmodelledRequest):
        responses_chat_body({"model": "m", "input": "hi"}, Engine.SGLANG)
    with pytest.raises(ChatError):
        responses_chat_body({"model": "m", "input": [{"type": "item_reference", "id": "x"}]},
                            Engine.VLLM)
