"""A stateless OpenAI Responses request (``POST /v1/responses``) → the engine's chat request
(pure).

Codex-style clients send the whole history as ``input`` items with ``store: false``; the
engine renders them as a chat. :func:`responses_chat_body` is that conversion, written from
vLLM 0.32's ``entrypoints/openai/responses/utils.py`` (``construct_input_messages``,
``construct_tool_dicts``) and ``ResponsesRequest.build_chat_params``:

- ``instructions`` → a leading system message; a string ``input`` → one user message;
- items: a ``reasoning`` item → ``reasoning`` of an assistant message (its first content
  text, else its first summary text; encrypted content is a 400); a ``function_call`` → a
  tool call (``call_id``, ``name``, ``arguments``); an assistant ``message`` → assistant
  content (its first part's text); these three join the previous assistant message while it
  lacks that field; ``function_call_output`` → a ``tool`` message; any other item with a
  ``role`` is a chat message as given (``input_text`` parts are text);
- ``tools`` of type ``function`` → chat tools (``strict`` when set), other tool types dropped;
- ``reasoning.effort`` → ``reasoning_effort`` (and ``enable_thinking`` unless
  ``chat_template_kwargs`` sets it); a last ``message`` / ``reasoning`` item with status
  ``in_progress`` or ``incomplete`` is continued (``continue_final_message``, no generation
  prompt).

A request with ``previous_response_id`` is not stateless (the engine prepends what it
stored): it is :class:`UnmodelledRequest`, as is every SGLang request (SGLang 0.5.23 passes
the items to its chat parser as they are, without tools, and falls back to a plain
``role: content`` text when that fails; not modelled), ``custom`` / ``namespace`` tools and
``custom_tool_call`` items.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cortex.chat.errors import InvalidChatRequest, UnmodelledRequest
from cortex.chat.request import RenderArgs, render_args
from cortex.hashing import Engine

__all__ = ["responses_chat_body", "responses_render_args"]

_CONTINUED = ("in_progress", "incomplete")


def _invalid(message: str, param: str = "input") -> InvalidChatRequest:
    return InvalidChatRequest(message, param)


def _first_text(parts: Any) -> Any:
    if isinstance(parts, list) and parts and isinstance(parts[0], Mapping):
        return parts[0].get("text")
    return None


def _join_assistant(messages: list[dict[str, Any]], field: str, value: Any) -> bool:
    """Set ``field`` on the previous assistant message when it lacks it."""
    previous = messages[-1] if messages else None
    if previous is not None and previous.get("role") == "assistant" \
            and previous.get(field) is None:
        previous[field] = value
        return True
    return False


def _item(item: Mapping[str, Any], messages: list[dict[str, Any]], where: str) -> None:
    kind = item.get("type")
    if kind == "function_call":
        for name in ("call_id", "name", "arguments"):
            if not isinstance(item.get(name), str):
                raise _invalid(f"{where}.{name} must be a string")
        if item.get("namespace"):
            raise UnmodelledRequest("a namespaced function_call")
        call = {"id": item["call_id"], "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]}}
        previous = messages[-1] if messages else None
        if previous is not None and previous.get("role") == "assistant":
            previous.setdefault("tool_calls", None)
            if previous["tool_calls"] is None:
                previous["tool_calls"] = [call]
            else:
                previous["tool_calls"].append(call)
            return
        messages.append({"role": "assistant", "tool_calls": [call]})
    elif kind == "reasoning":
        if item.get("encrypted_content"):
            raise _invalid("Encrypted content is not supported.")
        text = _first_text(item.get("content"))
        if text is None:
            text = _first_text(item.get("summary"))
        reasoning = text if text is not None else ""
        if not _join_assistant(messages, "reasoning", reasoning):
            messages.append({"role": "assistant", "reasoning": reasoning})
    elif kind in ("function_call_output", "custom_tool_call_output"):
        if kind != "function_call_output":
            raise UnmodelledRequest(f"a {kind!r} item")
        messages.append({"role": "tool", "content": item.get("output"),
                         "tool_call_id": item.get("call_id")})
    elif item.get("role") == "assistant":
        content = item.get("content")
        text = content if isinstance(content, str) else _first_text(content)
        if text is None:
            if kind == "message":
                raise _invalid(f"{where}.content must hold an output_text part")
            messages.append(dict(item))
        elif not _join_assistant(messages, "content", text):
            messages.append({"role": "assistant", "content": text})
    elif isinstance(item.get("role"), str):
        messages.append(dict(item))
    else:
        if kind in ("custom_tool_call",):
            raise UnmodelledRequest(f"a {kind!r} item")
        raise _invalid(f"Unsupported input item type: {kind}")


def _continued(items: Any) -> bool:
    if not isinstance(items, list) or not items:
        return False
    last = items[-1]
    return isinstance(last, Mapping) and last.get("type", "message") in (
        "message", "reasoning") and last.get("status") in _CONTINUED


def _tools(value: Any) -> list[dict[str, Any]] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise _invalid("'tools' must be a list", "tools")
    tools = []
    for i, tool in enumerate(value):
        if not isinstance(tool, Mapping) or not isinstance(tool.get("type"), str):
            raise _invalid(f"tools[{i}] must be an object with a 'type'", "tools")
        if tool["type"] in ("custom", "namespace"):
            raise UnmodelledRequest(f"a {tool['type']!r} tool")
        if tool["type"] != "function":
            continue
        if not isinstance(tool.get("name"), str):
            raise _invalid(f"tools[{i}].name must be a string", "tools")
        function: dict[str, Any] = {"name": tool["name"],
                                    "description": tool.get("description"),
                                    "parameters": tool.get("parameters")}
        if tool.get("strict") is not None:
            function["strict"] = tool["strict"]
        tools.append({"type": "function", "function": function})
    return tools or None


def responses_chat_body(body: Mapping[str, Any], engine: Engine) -> dict[str, Any]:
    """The chat-completion body (its rendering fields) ``engine`` renders for a stateless
    Responses ``body``. Raises :class:`InvalidChatRequest`, :class:`UnmodelledRequest`."""
    if not isinstance(body, Mapping):
        raise _invalid("the body must be an object", "body")
    if body.get("previous_response_id") is not None:
        raise UnmodelledRequest("a follow-up by previous_response_id")
    if Engine(engine) is not Engine.VLLM:
        raise UnmodelledRequest("SGLang's Responses conversion")
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise _invalid("'instructions' must be a string", "instructions")
    if instructions:
        messages.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
    elif isinstance(items, list):
        for i, item in enumerate(items):
            if not isinstance(item, Mapping):
                raise _invalid(f"input[{i}] must be an object")
            _item(item, messages, f"input[{i}]")
    else:
        raise _invalid("'input' must be a string or a list of items")
    continued = _continued(items)
    out: dict[str, Any] = {"messages": messages, "add_generation_prompt": not continued,
                           "continue_final_message": continued}
    reasoning = body.get("reasoning")
    if reasoning is not None:
        if not isinstance(reasoning, Mapping):
            raise _invalid("'reasoning' must be an object", "reasoning")
        if reasoning.get("effort") is not None:
            out["reasoning_effort"] = reasoning["effort"]
    if body.get("chat_template_kwargs") is not None:
        out["chat_template_kwargs"] = body["chat_template_kwargs"]
    tools = _tools(body.get("tools"))
    if tools is not None:
        out["tools"] = tools
    return out


def responses_render_args(body: Mapping[str, Any], engine: Engine) -> RenderArgs:
    """The rendering arguments of the chat request ``engine`` makes of a stateless
    Responses ``body`` (tokenize them with ``ChatTokenizer.encode_chat``)."""
    return render_args(responses_chat_body(body, engine), engine)
