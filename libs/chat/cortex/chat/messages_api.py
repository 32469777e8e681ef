"""An Anthropic Messages request (``POST /v1/messages``) → the engine's chat request (pure).

Both engines serve ``/v1/messages`` by converting the body to a chat-completion request and
rendering that like any chat: :func:`messages_chat_body` is that conversion, written from
each engine's serving code, and :func:`messages_render_args` the rendering arguments of its
result (:func:`cortex.chat.render_args`), whose ids ``ChatTokenizer.encode_chat`` computes.

**vLLM** (0.32, ``entrypoints/anthropic/serving.py``): the system prompt's text blocks are
joined without a separator (a block starting ``x-anthropic-billing-header`` is dropped);
``system``-role messages stay in place, or join the system prompt when the chat template
refuses a system message after the first (:attr:`MessagesOptions.merge_inline_system`);
text blocks become text parts (one alone: a string), ``thinking`` blocks the message's
``reasoning``, ``tool_use`` blocks ``tool_calls``, a user's ``tool_result`` blocks ``tool``
messages placed before it (list contents: text items joined by a newline), an assistant's a
``Tool result: …`` text part; tools become functions (``input_schema`` as ``parameters``,
``type: object`` added when missing), ``tool_addition`` / ``tool_removal`` blocks of system
messages applied; ``output_config.effort`` is the ``reasoning_effort``, and
``thinking: disabled`` sets it to :attr:`MessagesOptions.disabled_thinking_effort`;
``chat_template_kwargs`` pass through.

**SGLang** (0.5.23, ``entrypoints/anthropic/serving.py``), for a server without a reasoning
parser: system text joined by a newline (a blank string dropped); tool results split into
``tool`` messages in block order (text before them flushed as a user message); earlier
thinking dropped (``redacted_thinking`` and ``thinking`` enabled are 400s); an assistant
turn left empty gets ``""``; tools with ``description or ""`` and ``strict``; ``tool_choice``
mapped (``any`` → ``required``, ``tool`` → named) and ``auto`` when tools are given.

Raises :class:`InvalidChatRequest` where the engine answers 400 and
:class:`UnmodelledRequest` for valid shapes not modelled (images, documents, search results,
server tools, tool references).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jinja2
import jinja2.ext
import jinja2.sandbox

from cortex.chat.errors import ChatError, InvalidChatRequest, UnmodelledRequest
from cortex.chat.request import RenderArgs, render_args
from cortex.hashing import Engine

if TYPE_CHECKING:
    from cortex.chat.tokenizer import ChatTokenizer

__all__ = ["EFFORTS", "MessagesOptions", "merges_inline_system", "messages_chat_body",
           "messages_options", "messages_render_args"]

_BILLING = "x-anthropic-billing-header"
_VLLM_ROLES = frozenset({"user", "assistant", "system"})
_SGLANG_ROLES = frozenset({"user", "assistant", "system"})
_BLOCKS = frozenset({"text", "image", "tool_use", "tool_result", "tool_reference", "thinking",
                     "redacted_thinking", "tool_addition", "tool_removal", "document",
                     "search_result"})
EFFORTS = ("low", "medium", "high", "xhigh", "max")


@dataclass(frozen=True, slots=True)
class MessagesOptions:
    """What an engine decides once from its chat template, not from the request.

    ``merge_inline_system``: system messages after the first join the leading system prompt
    (vLLM and SGLang both probe the template with ``[system, user, system, user]``);
    ``disabled_thinking_effort``: vLLM's ``reasoning_effort`` for ``thinking: disabled``
    (``"none"``, or ``"low"`` when the template ignores or refuses ``"none"``)."""

    merge_inline_system: bool = False
    disabled_thinking_effort: str = "none"


def merges_inline_system(template: str | None, engine: Engine) -> bool:
    """The engine's probe of a chat template: whether system messages after the first
    join the leading system prompt. Both render ``[system, user, system, user]`` in a bare
    sandbox without globals (so ``raise_exception`` is undefined and fails); vLLM merges
    when that fails (or there is no template), SGLang also when the second system text is
    not in the output."""
    if not template:
        return True
    sentinel = "__cortex_inline_system_sentinel__"
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    try:
        rendered = env.from_string(template).render(
            messages=[{"role": "system", "content": "t"}, {"role": "user", "content": "t"},
                      {"role": "system", "content": sentinel},
                      {"role": "user", "content": "t"}],
            add_generation_prompt=False)
    except Exception:  # vLLM only catches TemplateError: it would not start on others
        return True
    return Engine(engine) is Engine.SGLANG and sentinel not in rendered


def messages_options(chat: ChatTokenizer, engine: Engine) -> MessagesOptions:
    """The :class:`MessagesOptions` ``engine`` derives from ``chat``'s template: the
    inline-system probe, and vLLM's ``thinking: disabled`` effort (``"low"`` when rendering
    with ``reasoning_effort: "none"`` fails or equals rendering with some effort)."""
    merge = merges_inline_system(chat.template.text, engine)
    if Engine(engine) is Engine.SGLANG:
        return MessagesOptions(merge_inline_system=merge)
    hello = [{"role": "user", "content": "Hi"}]

    def rendered(effort: str) -> str | None:
        try:
            return chat.render(RenderArgs.of(Engine.VLLM, hello, reasoning_effort=effort))
        except ChatError:
            return None

    none = rendered("none")
    disabled = "low" if none is None or any(rendered(e) == none for e in EFFORTS) else "none"
    return MessagesOptions(merge_inline_system=merge, disabled_thinking_effort=disabled)


def _invalid(message: str, param: str = "messages") -> InvalidChatRequest:
    return InvalidChatRequest(message, param)


def _blocks(value: Any, where: str) -> list[Mapping[str, Any]]:
    if not isinstance(value, list):
        raise _invalid(f"{where} must be a string or a list of content blocks")
    for i, block in enumerate(value):
        if not isinstance(block, Mapping) or block.get("type") not in _BLOCKS:
            raise _invalid(f"{where}[{i}] must be a content block with a known 'type'")
        for name in ("text", "thinking", "id", "tool_use_id", "name"):
            if block.get(name) is not None and not isinstance(block[name], str):
                raise _invalid(f"{where}[{i}].{name} must be a string")
        if block.get("input") is not None and not isinstance(block["input"], Mapping):
            raise _invalid(f"{where}[{i}].input must be an object")
        content = block.get("content")
        if content is not None and not isinstance(content, str | list):
            raise _invalid(f"{where}[{i}].content must be a string or a list")
    return value


def _messages(body: Mapping[str, Any], roles: frozenset[str]) -> list[Mapping[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise _invalid("'messages' must be a list")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or message.get("role") not in roles:
            raise _invalid(f"messages[{i}].role must be one of {sorted(roles)}")
        if not isinstance(message.get("content"), str):
            _blocks(message.get("content"), f"messages[{i}].content")
    return messages


def _system_blocks(body: Mapping[str, Any]) -> str | list[Mapping[str, Any]] | None:
    system = body.get("system")
    if system is None or isinstance(system, str):
        return system
    return _blocks(system, "system")


def _tools(body: Mapping[str, Any]) -> list[Mapping[str, Any]] | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise _invalid("'tools' must be a list", "tools")
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping) or not isinstance(tool.get("name"), str):
            raise _invalid(f"tools[{i}].name must be a string", "tools")
        if tool.get("type") not in (None, "custom"):
            raise UnmodelledRequest(f"tools[{i}]: server tool {tool.get('type')!r}")
        if not isinstance(tool.get("input_schema"), Mapping):
            raise _invalid(f"tools[{i}].input_schema must be an object", "tools")
    return tools


def _schema(tool: Mapping[str, Any]) -> dict[str, Any]:
    schema = dict(tool["input_schema"])
    schema.setdefault("type", "object")
    return schema


def _tool_choice(body: Mapping[str, Any]) -> Mapping[str, Any] | None:
    choice = body.get("tool_choice")
    if choice is None:
        return None
    if not isinstance(choice, Mapping) or choice.get("type") not in ("auto", "any", "tool",
                                                                      "none"):
        raise _invalid("tool_choice.type must be 'auto', 'any', 'tool' or 'none'",
                       "tool_choice")
    if choice["type"] == "tool" and not isinstance(choice.get("name"), str):
        raise _invalid("tool_choice.name is required when type is 'tool'", "tool_choice")
    return choice


def _thinking(body: Mapping[str, Any]) -> str | None:
    thinking = body.get("thinking")
    if thinking is None:
        return None
    if not isinstance(thinking, Mapping) or thinking.get("type") not in ("enabled", "disabled",
                                                                          "adaptive"):
        raise _invalid("thinking.type must be 'enabled', 'disabled' or 'adaptive'", "thinking")
    kind: str = thinking["type"]
    budget = thinking.get("budget_tokens")
    if kind == "enabled" and (not isinstance(budget, int) or isinstance(budget, bool)
                              or budget < 1024):
        raise _invalid("thinking.budget_tokens must be an integer >= 1024", "thinking")
    return kind


def _check_common(body: Mapping[str, Any]) -> None:
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise _invalid("'model' is required", "model")
    tokens = body.get("max_tokens")
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens <= 0:
        raise _invalid("'max_tokens' is required and must be a positive integer",
                       "max_tokens")
    stops = body.get("stop_sequences")
    if stops is not None and (not isinstance(stops, list)
                              or not all(isinstance(s, str) for s in stops)):
        raise _invalid("'stop_sequences' must be a list of strings", "stop_sequences")


# ---- vLLM ----


def _vllm_system_text(content: Any) -> str | None:
    """A system message's text (billing headers dropped), ``None`` when empty."""
    if isinstance(content, str):
        return None if content.startswith(_BILLING) else content
    parts = [block["text"] for block in content
             if block["type"] == "text" and block.get("text")
             and not block["text"].startswith(_BILLING)]
    return "".join(parts) if parts else None


def _vllm_tool_result_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return ""
    texts = []
    for item in content:
        if not isinstance(item, Mapping):
            continue
        if item.get("type") in ("image", "tool_reference"):
            raise UnmodelledRequest(f"a tool_result holding a {item['type']!r} item")
        if item.get("type") == "text":
            texts.append(item.get("text", ""))
    return "\n".join(texts)


def _tool_call(block: Mapping[str, Any], fallback_id: str) -> dict[str, Any]:
    return {"id": block.get("id") or fallback_id, "type": "function",
            "function": {"name": block.get("name") or "",
                         "arguments": json.dumps(block.get("input") or {})}}


def _vllm_content(message: Mapping[str, Any], out: list[dict[str, Any]]) -> None:
    """Append the chat messages of one block-list message to ``out``."""
    role = message["role"]
    chat: dict[str, Any] = {"role": role}
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for block in message["content"]:
        kind = block["type"]
        if kind == "text" and block.get("text"):
            parts.append({"type": "text", "text": block["text"]})
        elif kind in ("image", "document", "search_result") and (
                kind != "image" or block.get("source")):
            raise UnmodelledRequest(f"a {kind!r} content block")
        elif kind == "thinking" and block.get("thinking") is not None:
            reasoning.append(block["thinking"])
        elif kind == "tool_use":
            calls.append(_tool_call(block, f"call_{int(time.time())}"))
        elif kind == "tool_result":
            if role == "user":
                out.append({"role": "tool", "tool_call_id": block.get("tool_use_id") or "",
                            "content": _vllm_tool_result_text(block.get("content"))})
            else:
                content = block.get("content")
                parts.append({"type": "text",
                              "text": f"Tool result: {str(content) if content else ''}"})
    if reasoning:
        chat["reasoning"] = "".join(reasoning)
    if calls:
        chat["tool_calls"] = calls
    if parts:
        chat["content"] = parts[0]["text"] if len(parts) == 1 else parts
    if not (role == "user" and "content" not in chat):
        out.append(chat)


def _vllm_resolved_tools(body: Mapping[str, Any], messages: Sequence[Mapping[str, Any]]
                         ) -> list[Mapping[str, Any]] | None:
    """``tools`` with the ``tool_addition`` / ``tool_removal`` blocks applied."""
    tools = _tools(body)
    changes = [block for message in messages if not isinstance(message["content"], str)
               for block in message["content"]
               if block["type"] in ("tool_addition", "tool_removal")]
    if not changes:
        return tools
    by_name: dict[str, Mapping[str, Any]] = {t["name"]: t for t in tools or []}
    removed: set[str] = set()
    for block in changes:
        change = block.get("tool")
        if not isinstance(change, Mapping):
            raise _invalid(f"tool is required for {block['type']} blocks")
        if change.get("type") == "tool_definition":
            definition = change.get("definition")
            if block["type"] == "tool_removal" or not isinstance(definition, Mapping) \
                    or not isinstance(definition.get("name"), str):
                raise _invalid("tool_removal only accepts a tool_reference")
            name = definition["name"]
            by_name[name] = definition
        else:
            name = change.get("name")
            if not isinstance(name, str) or name not in by_name:
                raise _invalid(f"{block['type']} references tool {name!r}, which is not "
                               "declared in tools")
            if block["type"] == "tool_addition":
                by_name[name] = {**by_name[name], "defer_loading": None}
        if block["type"] == "tool_removal":
            removed.add(name)
        else:
            removed.discard(name)
    return [tool for name, tool in by_name.items() if name not in removed]


def _vllm_tool(tool: Mapping[str, Any]) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool["name"], "description": tool.get("description"),
                                "parameters": _schema(tool)}
    for name in ("strict", "defer_loading"):
        if tool.get(name) is not None:
            function[name] = tool[name]
    return {"type": "function", "function": function}


def _vllm_chat_body(body: Mapping[str, Any], options: MessagesOptions) -> dict[str, Any]:
    messages = _messages(body, _VLLM_ROLES)
    for message in messages:
        if message["role"] != "system" and not isinstance(message["content"], str) and any(
                block["type"] in ("tool_addition", "tool_removal")
                for block in message["content"]):
            raise _invalid("tool_addition / tool_removal blocks are only allowed in messages "
                           'with role "system"')
    system = _system_blocks(body)
    if isinstance(system, list) and any(b["type"] in ("tool_addition", "tool_removal")
                                        for b in system):
        raise _invalid("tool_addition / tool_removal blocks are only allowed in messages "
                       'with role "system"', "system")
    system_parts: list[str] = []
    if isinstance(system, str) and system:
        system_parts.append(system)
    elif system:
        system_parts += [block["text"] for block in system if block["type"] == "text"
                         and block.get("text") and not block["text"].startswith(_BILLING)]
    if options.merge_inline_system:
        for message in messages:
            text = _vllm_system_text(message["content"]) if message["role"] == "system" \
                else None
            if text:
                system_parts.append(text)
    chat: list[dict[str, Any]] = []
    if system_parts:
        chat.append({"role": "system", "content": "".join(system_parts)})
    for message in messages:
        if message["role"] == "system":
            text = None if options.merge_inline_system else _vllm_system_text(
                message["content"])
            if text:
                chat.append({"role": "system", "content": text})
        elif isinstance(message["content"], str):
            chat.append({"role": message["role"], "content": message["content"]})
        else:
            _vllm_content(message, chat)
    out: dict[str, Any] = {"messages": chat}
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None:
        out["chat_template_kwargs"] = kwargs
    output_config = body.get("output_config")
    if isinstance(output_config, Mapping) and output_config.get("effort") is not None:
        if output_config["effort"] not in EFFORTS:
            raise _invalid(f"output_config.effort must be one of {list(EFFORTS)}",
                           "output_config")
        out["reasoning_effort"] = output_config["effort"]
    thinking = _thinking(body)
    if thinking == "disabled":
        out["reasoning_effort"] = options.disabled_thinking_effort
    transfer = body.get("kv_transfer_params")
    if thinking == "enabled" and body["thinking"]["budget_tokens"] >= body["max_tokens"] \
            and not (isinstance(transfer, Mapping) and transfer.get("do_remote_decode")):
        raise _invalid("thinking.budget_tokens must be less than max_tokens", "thinking")
    _tool_choice(body)
    tools = _vllm_resolved_tools(body, messages)
    if tools is not None:
        out["tools"] = [_vllm_tool(tool) for tool in tools]
    return out


# ---- SGLang ----


def _sglang_system_text(content: Any) -> str | None:
    if isinstance(content, str):
        return content.strip() or None
    texts = [text for block in content if block["type"] == "text"
             and (text := (block.get("text") or "").strip())]
    return "\n".join(texts) if texts else None


def _sglang_tool_contents(content: Any) -> tuple[list[Any], str]:
    """A tool_result's ``tool`` message contents and its text."""
    if not isinstance(content, list):
        text = str(content) if content else ""
        return [text], text
    parts: list[dict[str, Any]] = []
    for item in content:
        if not isinstance(item, Mapping):
            continue
        kind = item.get("type")
        if kind == "text" and item.get("text"):
            parts.append({"type": "text", "text": item["text"]})
        elif kind in ("image", "tool_reference", "search_result"):
            raise UnmodelledRequest(f"a tool_result holding a {kind!r} item")
    text = "\n".join(part["text"] for part in parts)
    if not parts:
        return [""], text
    return [parts[0]["text"] if len(parts) == 1 else parts], text


def _sglang_content(message: Mapping[str, Any], chat: list[dict[str, Any]]) -> None:
    """Append the chat messages of one block-list message to ``chat``."""
    role = message["role"]
    blocks = message["content"]
    if role == "assistant" and any(b["type"] == "redacted_thinking" for b in blocks):
        raise _invalid("Anthropic redacted_thinking history is not supported")
    # without a reasoning parser, earlier thinking is dropped (SGLang logs a warning)
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    for block in blocks:
        kind = block["type"]
        if kind in ("thinking", "redacted_thinking"):
            continue
        if kind == "text" and block.get("text") is not None:
            parts.append({"type": "text", "text": block["text"]})
        elif kind in ("image", "search_result", "document"):
            raise UnmodelledRequest(f"a {kind!r} content block")
        elif kind == "tool_use":
            calls.append(_tool_call(block, f"call_{uuid.uuid4().hex}"))
        elif kind == "tool_result":
            contents, text = _sglang_tool_contents(block.get("content"))
            call_id = block.get("tool_use_id") or block.get("id") or ""
            if role == "user":
                if parts:  # what came before the result stays before it
                    chat.append({"role": "user", "content": parts[0]["text"]
                                 if len(parts) == 1 else list(parts)})
                    parts.clear()
                chat += [{"role": "tool", "tool_call_id": call_id, "content": content}
                         for content in contents]
            else:
                parts.append({"type": "text", "text": f"Tool result: {text}"})
    out: dict[str, Any] = {"role": role}
    if calls:
        out["tool_calls"] = calls
    if parts:
        out["content"] = parts[0]["text"] if len(parts) == 1 else parts
    elif not calls:
        if role == "user":
            return  # only tool results: their messages are in already
        out["content"] = ""  # an empty assistant turn keeps its place
    chat.append(out)


def _sglang_chat_body(body: Mapping[str, Any], options: MessagesOptions) -> dict[str, Any]:
    messages = _messages(body, _SGLANG_ROLES)
    system = _system_blocks(body)
    system_parts: list[str] = []
    if isinstance(system, str):
        if system.strip():
            system_parts.append(system)
    elif system:
        system_parts += [block["text"] for block in system
                         if block["type"] == "text" and block.get("text")]
    if options.merge_inline_system:
        system_parts += [text for m in messages if m["role"] == "system"
                         and (text := _sglang_system_text(m["content"]))]
    chat: list[dict[str, Any]] = []
    if system_parts:
        chat.append({"role": "system", "content": "\n".join(system_parts)})
    for message in messages:
        role = message["role"]
        if role == "system" and options.merge_inline_system:
            continue
        if isinstance(message["content"], str):
            chat.append({"role": role, "content": message["content"]})
            continue
        _sglang_content(message, chat)
    result: dict[str, Any] = {"messages": chat}
    thinking = _thinking(body)
    if thinking is not None and thinking != "disabled":
        raise _invalid("Anthropic thinking is not supported for models without a reasoning "
                       "parser", "thinking")
    output_config = body.get("output_config")
    if isinstance(output_config, Mapping) and output_config.get("effort") is not None:
        effort = output_config["effort"]
        result["reasoning_effort"] = "max" if effort == "xhigh" else effort
    tools = _tools(body)
    if tools:
        result["tools"] = [{"type": "function", "defer_loading": tool.get("defer_loading"),
                            "function": {"name": tool["name"],
                                         "description": tool.get("description") or "",
                                         "parameters": _schema(tool),
                                         "strict": tool.get("strict") or False}}
                           for tool in tools]
    choice = _tool_choice(body)
    if choice is not None:
        kind = choice["type"]
        if kind == "none":
            result["tool_choice"] = "none"
        elif tools:
            if kind == "tool" and not any(t["name"] == choice["name"] for t in tools):
                raise _invalid(f"tool_choice references tool {choice['name']!r} but it is "
                               "not in the forwarded tools list", "tool_choice")
            result["tool_choice"] = {"auto": "auto", "any": "required"}.get(kind) or {
                "type": "function", "function": {"name": choice.get("name")}}
        elif kind in ("any", "tool"):
            raise _invalid(f"tool_choice={kind!r} requires at least one custom tool",
                           "tool_choice")
    elif tools:
        result["tool_choice"] = "auto"
    return result


def messages_chat_body(body: Mapping[str, Any], engine: Engine,
                       options: MessagesOptions | None = None) -> dict[str, Any]:
    """The chat-completion body (its rendering fields: ``messages``, ``tools``,
    ``tool_choice``, ``reasoning_effort``, ``chat_template_kwargs``) ``engine`` converts a
    Messages ``body`` to. Raises :class:`InvalidChatRequest`, :class:`UnmodelledRequest`."""
    if not isinstance(body, Mapping):
        raise _invalid("the body must be an object", "body")
    _check_common(body)
    options = options or MessagesOptions()
    if Engine(engine) is Engine.VLLM:
        return _vllm_chat_body(body, options)
    return _sglang_chat_body(body, options)


def messages_render_args(body: Mapping[str, Any], engine: Engine,
                         options: MessagesOptions | None = None) -> RenderArgs:
    """The rendering arguments of the chat request ``engine`` makes of a Messages ``body``
    (tokenize them with ``ChatTokenizer.encode_chat``)."""
    return render_args(messages_chat_body(body, engine, options), engine)
