"""SGLang 0.5.23's own conversion of Anthropic Messages bodies to chat requests, run offline.

SGLang is not installed here (no GPU); its conversion is pure Python, so it is imported from
the wheel with the few pure dependencies its modules import, and the engine state the
conversion reads is a stand-in for a server **without a reasoning parser** (the
``OpenAIServingChat`` methods it calls answer as SGLang's do then: no native reasoning
history, rewrapping history fails, enabling thinking is an error). Setup, once::

    PY=$CORTEX_REALVLLM/venv/bin/python   # any 3.11 env with pydantic, fastapi, openai
    $PY -m pip download sglang==0.5.23 --no-deps -d /tmp/sgl && cd /tmp/sgl && unzip -q *.whl
    $PY -m pip install --target /tmp/sgl-deps --no-deps orjson ipython traitlets

Then ``PYTHONPATH=/tmp/sgl-deps $PY tools/realengines/sglang_agent_reference.py /tmp/sgl``
reads ``{"messages": [body...], "merge_inline_system": bool}`` on stdin and writes
``{"messages": [chat | {"error": ...}]}``: the chat-completion body SGLang renders for each.
"""

from __future__ import annotations

import json
import sys
import types
from typing import Any


class _NoReasoningParser:
    """The chat server's answers the conversion asks for, without a reasoning parser."""

    reasoning_parser = None

    def supports_native_reasoning_history(self) -> bool:
        return False

    def wrap_reasoning_history(self, text: str) -> str:
        raise ValueError("Cannot rewrap thinking history: no reasoning detector is "
                         "configured for this model")

    def apply_reasoning_enabled(self, request: Any, enabled: bool) -> None:
        if enabled:
            raise ValueError("Anthropic thinking is not supported for models without a "
                             "reasoning parser")


def main() -> None:
    sys.path.insert(0, sys.argv[1])
    # the serving module imports request timing from a module that pulls in the whole
    # scheduler (torch, vision models); the conversion never uses it
    timing = types.ModuleType("sglang.srt.observability.req_time_stats")
    timing.monotonic_time = lambda: 0.0  # type: ignore[attr-defined]
    sys.modules["sglang.srt.observability.req_time_stats"] = timing
    from sglang.srt.entrypoints.anthropic.protocol import AnthropicMessagesRequest
    from sglang.srt.entrypoints.anthropic.serving import AnthropicServing

    job = json.load(sys.stdin)
    serving = object.__new__(AnthropicServing)
    serving.openai_serving_chat = _NoReasoningParser()
    serving._merge_inline_system = bool(job.get("merge_inline_system"))
    out = []
    for body in job["messages"]:
        try:
            request = AnthropicMessagesRequest.model_validate(body)
            chat = serving._convert_to_chat_completion_request(request)
        except Exception as exc:  # SGLang answers these with a 400
            out.append({"error": f"{type(exc).__name__}: {exc}"})
            continue
        dumped: dict[str, Any] = {
            "messages": [m if isinstance(m, dict) else m.model_dump(exclude_none=True)
                         for m in chat.messages]}
        if chat.tools is not None:
            dumped["tools"] = [tool.model_dump() for tool in chat.tools]
        if chat.tool_choice is not None:
            choice = chat.tool_choice
            dumped["tool_choice"] = choice if isinstance(choice, str) else choice.model_dump()
        for name in ("reasoning_effort", "chat_template_kwargs"):
            if getattr(chat, name, None) is not None:
                dumped[name] = getattr(chat, name)
        out.append(json.loads(json.dumps(dumped, default=lambda o: o.model_dump())))
    json.dump({"messages": out}, sys.stdout)


if __name__ == "__main__":
    main()
