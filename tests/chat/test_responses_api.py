"""A stateless Responses body → the engine's chat request (``cortex.chat.responses_api``).

The corpus check: 240 Codex-style bodies (instructions, tools, reasoning items, function
calls and outputs, assistant messages) against vLLM 0.32's own conversion
(``data/agent_apis.json.gz``, see ``test_messages_api``): 0 mismatches.
"""

from __future__ import annotations

import pytest

from cortex.chat import ChatError, RenderArgs, render_args
from cortex.chat.errors import UnmodelledRequest
from cortex.chat.responses_api import responses_chat_body, responses_render_args
from cortex.hashing import Engine

from .agent_requests import count_mismatches, tokenizer


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
    with pytest.raises(UnmodelledRequest):
        responses_chat_body({"model": "m", "input": "hi"}, Engine.SGLANG)
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
