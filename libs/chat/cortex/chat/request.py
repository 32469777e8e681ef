"""An OpenAI chat request body → the engine's chat-rendering arguments (pure).

:func:`render_args` is the one place that reads the rendering fields of a
``/v1/chat/completions`` body, the way each engine's OpenAI server does before it calls
``apply_chat_template``:

- **vLLM**: ``messages`` are reduced to what vLLM's parser keeps (``role``, ``content``,
  ``tool_calls`` with their ``arguments`` parsed to objects, ``reasoning``, ``tool_call_id``,
  ``name``); ``tools`` as vLLM's pydantic models dump them; ``add_generation_prompt``
  (default true), ``continue_final_message``, ``documents`` and ``reasoning_effort`` override
  the same names in ``chat_template_kwargs``; both flags true is an error; a per-request
  ``chat_template`` is refused; the rendered text is tokenized with the request's
  ``add_special_tokens`` (default false); media parts (``image_url`` …) are kept as
  ``{"type": "image"}`` (``"video"``, ``"audio"``), never refused here.
- **SGLang** (0.5.23): roles are SGLang's (case-insensitive), unset fields dropped, assistant
  tool-call ``arguments`` must be JSON objects; ``tools`` go to the template only when
  ``tool_choice`` is not ``"none"`` (a named ``tool_choice`` keeps only that tool), each
  function as SGLang dumps it (the client's keys in the client's order, then the other
  fields; an unset ``strict`` / ``defer_loading`` left out); the generation prompt is always
  added; ``reasoning_effort`` (with ``thinking`` / ``enable_thinking`` set to whether it is
  not ``"none"``) then ``chat_template_kwargs`` are template variables; a trailing assistant
  message is continued (``continue_final_message``) or becomes a user message; special
  tokens are never added to the rendered text.

The result still holds list-of-parts contents: how they are flattened depends on the chat
template (see :mod:`cortex.chat.conversation`). Raises :class:`InvalidChatRequest`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from cortex.chat.errors import InvalidChatRequest
from cortex.chat.media import MEDIA_PARTS, SENTINEL, TEMPLATE_MEDIA
from cortex.hashing import Engine

__all__ = ["RenderArgs", "render_args", "sentinel_args", "text_add_special_tokens"]

_SGLANG_ROLES = frozenset({"system", "assistant", "tool", "function", "developer",
                           "latest_reminder"})
_TEXT_PARTS = frozenset({"text", "input_text"})
# apply_chat_template parameters SGLang passes itself (a duplicate is a TypeError → 400) …
_SGLANG_TAKEN = frozenset({"conversation", "tools", "tokenize", "add_generation_prompt",
                           "return_dict", "chat_template", "continue_final_message"})
# … and those apply_chat_template consumes instead of handing them to the template.
_HF_CONSUMED = frozenset({"padding", "truncation", "max_length", "return_tensors",
                          "return_assistant_tokens_mask", "tokenizer_kwargs"})
# SGLang's Function fields, in their order
_SGLANG_FUNCTION_FIELDS = ("description", "name", "parameters", "strict", "defer_loading")


@dataclass(frozen=True, slots=True)
class RenderArgs:
    """What one engine renders for a chat request, and how it tokenizes the text.

    ``messages`` are normalized the engine's way (contents may still be lists of parts);
    ``template_kwargs`` are extra template variables (they override the special tokens);
    ``continue_final_message``: continue the trailing assistant message (vLLM: the rendered
    text is cut after it; SGLang: it is removed and its content appended to the text);
    ``add_special_tokens``: the tokenizer adds its BOS/EOS template around the text.
    """

    engine: Engine
    messages: tuple[Mapping[str, Any], ...]
    tools: tuple[Mapping[str, Any], ...] | None = None
    documents: tuple[Mapping[str, Any], ...] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    add_special_tokens: bool = False

    @classmethod
    def of(cls, engine: Engine | str, messages: Sequence[Mapping[str, Any]],
           **body: Any) -> RenderArgs:
        """Shorthand: ``render_args({"messages": messages, **body}, engine)``."""
        return render_args({"messages": list(messages), **body}, Engine(engine))


def _invalid(message: str, param: str = "messages") -> InvalidChatRequest:
    return InvalidChatRequest(message, param)


def _flag(body: Mapping[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _invalid(f"'{name}' must be a boolean", name)
    return value


def _object(value: Any, name: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise _invalid(f"'{name}' must be an object", name)
    return dict(value)


def _content(message: Mapping[str, Any], where: str, engine: Engine) -> Any:
    """``None``, a string, or a tuple of parts: text parts as ``{"type": "text", ...}``."""
    content = message.get("content")
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _invalid(f"{where}.content must be a string, a list of parts or null")
    parts: list[Mapping[str, Any]] = []
    for part in content:
        if isinstance(part, str) and engine is Engine.VLLM:
            parts.append({"type": "text", "text": part})
            continue
        if not isinstance(part, Mapping) or not isinstance(part.get("type"), str):
            raise _invalid(f"{where}.content parts must be objects with a 'type'")
        if part["type"] in _TEXT_PARTS:
            if not isinstance(part.get("text"), str):
                raise _invalid(f"{where}.content: a text part needs a string 'text'")
            parts.append({"type": "text", "text": part["text"]})
        elif engine is Engine.VLLM:
            # vLLM's parser: a media part reaches the template as {"type": modality}; the
            # engine (not the gateway) refuses media a text-only model cannot take
            modality = MEDIA_PARTS.get(part["type"])
            parts.append({"type": modality.value} if modality is not None else dict(part))
        else:
            parts.append(dict(part))  # SGLang drops or keeps them by template format
    return tuple(parts)


def _function(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping) or not isinstance(value.get("function"), Mapping):
        raise _invalid(f"{where} must be an object with a 'function' object")
    fn: Mapping[str, Any] = value["function"]
    return fn


def _parsed_arguments(value: Any, where: str, engine: Engine) -> Any:
    if engine is Engine.VLLM:
        if not value:
            return {}
        if isinstance(value, dict | list):
            return value
    elif not isinstance(value, str):
        return value
    try:
        parsed = json.loads(value)
    except (TypeError, ValueError):
        raise _invalid(f"{where}.function.arguments must be valid JSON") from None
    if engine is Engine.SGLANG and not isinstance(parsed, dict):
        raise _invalid(f"{where}.function.arguments must be a JSON object")
    return parsed


def _tool_calls(value: Any, where: str, engine: Engine, parse: bool) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise _invalid(f"{where}.tool_calls must be a list")
    calls: list[dict[str, Any]] = []
    for i, call in enumerate(value):
        at = f"{where}.tool_calls[{i}]"
        fn = _function(call, at)
        arguments = fn.get("arguments")
        if parse:
            arguments = _parsed_arguments(arguments, at, engine)
        if engine is Engine.VLLM:
            calls.append({**call, "function": {**fn, "arguments": arguments}})
        else:  # SGLang's ToolCall model dump
            calls.append({"id": call.get("id"), "index": call.get("index"),
                          "type": call.get("type", "function"),
                          "function": {"name": fn.get("name"), "arguments": arguments}})
    return calls


def _vllm_message(message: Mapping[str, Any], where: str) -> dict[str, Any]:
    role = message["role"]
    out: dict[str, Any] = {"role": role, "content": _content(message, where, Engine.VLLM)}
    if role == "assistant":
        if message.get("tool_calls") is not None:
            out["tool_calls"] = _tool_calls(message["tool_calls"], where, Engine.VLLM, True)
        reasoning = message.get("reasoning")
        if reasoning is None:
            reasoning = message.get("reasoning_content")
        if reasoning is not None:
            out["reasoning"] = out["reasoning_content"] = reasoning
    elif role == "tool" and "tool_call_id" in message:
        out["tool_call_id"] = message["tool_call_id"]
    if isinstance(message.get("name"), str):
        out["name"] = message["name"]
    if role == "developer":
        out["tools"] = message.get("tools")
    return out


def _sglang_message(message: Mapping[str, Any], where: str) -> dict[str, Any]:
    role = message["role"]
    content = _content(message, where, Engine.SGLANG)
    if role == "user":
        if content is None:
            raise _invalid(f"{where}.content is required for a user message")
        return {"role": "user", "content": content}
    role = role.lower()
    if role not in _SGLANG_ROLES:
        raise _invalid(f"{where}.role must be one of {sorted(_SGLANG_ROLES | {'user'})}")
    calls = message.get("tool_calls")
    tools = message.get("tools")
    dumped: dict[str, Any] = {
        "role": role, "content": "" if content is None else content,
        "tool_call_id": message.get("tool_call_id"), "name": message.get("name"),
        "reasoning_content": message.get("reasoning_content"),
        "tool_calls": None if calls is None else _tool_calls(calls, where, Engine.SGLANG,
                                                             parse=role == "assistant"),
        "tools": None if tools is None else _tools(tools, Engine.SGLANG, f"{where}.tools"),
    }
    return {key: value for key, value in dumped.items() if value is not None}


def _messages(body: Mapping[str, Any], engine: Engine) -> tuple[dict[str, Any], ...]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _invalid("'messages' must be a non-empty list")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise _invalid(f"{where} must be an object with a string 'role'")
        out.append(_vllm_message(message, where) if engine is Engine.VLLM
                   else _sglang_message(message, where))
    return tuple(out)


def _tool(tool: Any, engine: Engine, where: str) -> dict[str, Any]:
    fn = _function(tool, where)
    if not isinstance(fn.get("name"), str):
        raise _invalid(f"{where}.function.name must be a string", "tools")
    if engine is Engine.VLLM:
        if tool.get("type", "function") != "function":
            raise _invalid(f"{where}.type must be 'function'", "tools")
        extra = {k: v for k, v in fn.items() if k not in ("name", "description", "parameters")}
        dumped = {"type": "function", "function": {
            "name": fn["name"], "description": fn.get("description"),
            "parameters": fn.get("parameters"), **extra}}
        if tool.get("defer_loading") is not None:
            dumped["defer_loading"] = tool["defer_loading"]
        return dumped
    # SGLang 0.5.23's Function dump: its fields, an unset strict / defer_loading left out
    # (the tool's defer_loading given to the function), in the client's key order first
    function = {name: fn.get(name) for name in _SGLANG_FUNCTION_FIELDS}
    if function["defer_loading"] is None:
        function["defer_loading"] = tool.get("defer_loading")
    for name in ("strict", "defer_loading"):
        if function[name] is None:
            del function[name]
    order = [key for key in fn if key in function]
    function = {key: function[key] for key in order + [k for k in function if k not in order]}
    return {"type": tool.get("type", "function"), "function": function,
            "defer_loading": tool.get("defer_loading")}


def _tools(value: Any, engine: Engine, where: str = "tools") -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise _invalid(f"'{where}' must be a list", "tools")
    return [_tool(tool, engine, f"{where}[{i}]") for i, tool in enumerate(value)]


def _reasoning_effort(body: Mapping[str, Any]) -> Any:
    effort = body.get("reasoning_effort")
    if effort is not None and (isinstance(effort, bool) or not isinstance(effort, str | int
                                                                           | float)):
        raise _invalid("'reasoning_effort' must be a string or a number", "reasoning_effort")
    return effort


def _documents(value: Any) -> tuple[Mapping[str, Any], ...] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise _invalid("'documents' must be a list of objects", "documents")
    return tuple(value)


def _vllm_args(body: Mapping[str, Any]) -> RenderArgs:
    if body.get("chat_template") is not None:
        raise _invalid("Chat template is passed with request, but --trust-request-chat-template "
                       "is not set. Refused request with untrusted chat template.",
                       "chat_template")
    kwargs = _object(body.get("chat_template_kwargs"), "chat_template_kwargs")
    unexpected = {"chat_template", "tokenize"} & kwargs.keys()
    if unexpected:
        raise _invalid(f"Found unexpected chat template kwargs from request: {sorted(unexpected)}",
                       "chat_template_kwargs")
    add_generation_prompt = _flag(body, "add_generation_prompt", True)
    continue_final = _flag(body, "continue_final_message", False)
    if add_generation_prompt and continue_final:
        raise _invalid("Cannot set both `continue_final_message` and `add_generation_prompt` "
                       "to True.", "continue_final_message")
    effort = _reasoning_effort(body)
    request_fields: dict[str, Any] = {
        "add_generation_prompt": add_generation_prompt,
        "continue_final_message": continue_final,
        "documents": body.get("documents"), "reasoning_effort": effort,
    }
    if effort is not None and "enable_thinking" not in kwargs:
        request_fields["enable_thinking"] = effort != "none"
    # vLLM's merge: the request's own fields win unless unset (None / "auto").
    merged = kwargs | {k: v for k, v in request_fields.items()
                       if v is not None and not (isinstance(v, str) and v == "auto")}
    tools = body.get("tools")
    kw_tools = merged.pop("tools", None)
    if tools is None:
        tools = kw_tools
    return RenderArgs(
        engine=Engine.VLLM,
        messages=_messages(body, Engine.VLLM),
        tools=None if tools is None else tuple(_tools(tools, Engine.VLLM)),
        documents=_documents(merged.pop("documents", None)),
        add_generation_prompt=bool(merged.pop("add_generation_prompt")),
        continue_final_message=bool(merged.pop("continue_final_message")),
        template_kwargs=merged,
        add_special_tokens=_flag(body, "add_special_tokens", False),
    )


def _sglang_tools(body: Mapping[str, Any], messages: Sequence[Mapping[str, Any]]
                  ) -> tuple[Mapping[str, Any], ...] | None:
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if choice is None:
        message_tools = any(m.get("role") in ("system", "developer") and m.get("tools")
                            for m in messages)
        choice = "none" if tools is None and not message_tools else "auto"
    if not tools or choice == "none":
        if tools is not None and not isinstance(tools, list):
            raise _invalid("'tools' must be a list", "tools")
        return None
    dumped = _tools(tools, Engine.SGLANG)
    if isinstance(choice, Mapping):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, Mapping) else None
        dumped = [tool for tool in dumped if tool["function"]["name"] == name]
    elif choice not in ("auto", "required"):
        raise _invalid("'tool_choice' must be 'none', 'auto', 'required' or a named function",
                       "tool_choice")
    return tuple(dumped)


def _sglang_args(body: Mapping[str, Any]) -> RenderArgs:
    messages = _messages(body, Engine.SGLANG)
    variables: dict[str, Any] = {}
    effort = _reasoning_effort(body)
    if effort is not None:  # ChatCompletionRequest.normalize_reasoning_inputs (0.5.23)
        variables["reasoning_effort"] = effort
        variables["thinking"] = variables["enable_thinking"] = effort != "none"
    variables.update(_object(body.get("chat_template_kwargs"), "chat_template_kwargs"))
    taken = _SGLANG_TAKEN & variables.keys()
    if taken:
        raise _invalid(f"chat_template_kwargs cannot set {sorted(taken)}", "chat_template_kwargs")
    documents = variables.pop("documents", None)
    for name in _HF_CONSUMED:
        variables.pop(name, None)
    return RenderArgs(
        engine=Engine.SGLANG,
        messages=messages,
        tools=_sglang_tools(body, messages),
        documents=_documents(documents),
        add_generation_prompt=True,
        continue_final_message=_flag(body, "continue_final_message", False),
        template_kwargs=variables,
        add_special_tokens=False,
    )


def render_args(body: Mapping[str, Any], engine: Engine) -> RenderArgs:
    """The rendering arguments ``engine`` derives from a chat request ``body``.

    Only rendering fields are read; the body is not modified. Raises
    :class:`~cortex.chat.errors.InvalidChatRequest` (a 400) for what the engine rejects.
    """
    if Engine(engine) is Engine.VLLM:
        return _vllm_args(body)
    return _sglang_args(body)


def text_add_special_tokens(body: Mapping[str, Any], engine: Engine) -> bool:
    """Whether a plain-text prompt (``/v1/completions``, ``/generate``) gets the tokenizer's
    special tokens: vLLM reads the request's ``add_special_tokens`` (default true), SGLang
    always adds them."""
    if Engine(engine) is Engine.VLLM:
        return _flag(body, "add_special_tokens", True)
    return True


def sentinel_args(args: RenderArgs) -> RenderArgs:
    """``args`` with its first media part replaced by a text part holding
    :data:`~cortex.chat.media.SENTINEL`: the token ids of both renderings agree exactly on
    the prompt's plain prefix, up to where the template first writes something of that
    item."""
    messages = list(args.messages)
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, tuple):
            continue
        for j, part in enumerate(content):
            if part.get("type") in TEMPLATE_MEDIA:
                parts = (*content[:j], {"type": "text", "text": SENTINEL}, *content[j + 1:])
                messages[i] = {**message, "content": parts}
                return dataclasses.replace(args, messages=tuple(messages))
    return args
