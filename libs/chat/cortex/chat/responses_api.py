"""A stateless OpenAI Responses request (``POST /v1/responses``) → the engine's chat request
(pure).

Codex-style clients send the whole history as ``input`` items with ``store: false``; the
engine renders them as a chat. :func:`responses_chat_body` is that conversion, per engine.

**vLLM** (0.32, ``entrypoints/openai/responses/utils.py``: ``construct_input_messages``,
``construct_tool_dicts``; ``ResponsesRequest.build_chat_params``):

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

**SGLang** (0.5.23, ``entrypoints/openai/serving_responses.py``:
``_construct_input_messages``, ``_normalize_response_message_for_chat``,
``_merge_consecutive_assistant_messages``, ``_response_tools_to_chat_tools``, ``_make_request``;
``protocol.ResponsesRequest``), for a server rendering with the model's chat template (not
gpt-oss / harmony, not Beam, no ``muse`` tool parser):

- ``instructions`` (when not empty) → a leading system message; a string ``input`` → one
  user message;
- a ``developer`` item → a ``system`` message whose text starts ``Developer instructions:``
  and a newline (its first text part's, or a part of its own);
- ``function_call`` → an assistant tool call (``call_id``, else the item ``id``); arguments
  that are not a JSON object become ``{}``; ``custom_tool_call`` → a call of the same name
  with arguments ``{"input": <its input>}``; ``function_call_output`` /
  ``custom_tool_call_output`` → a ``tool`` message (a list output: its parts' texts joined);
- ``reasoning`` → an assistant ``reasoning_content``: the summary texts joined by a newline,
  else the content texts, else SGLang's own replayable ``encrypted_content``; an item with
  none is dropped;
- ``message`` items keep their keys but ``id`` / ``status`` / ``type`` and unset ones;
  ``input_text`` / ``output_text`` parts become text parts (assistant content stays a list);
- then **consecutive assistant messages merge** into one (same ``phase``, or the earlier one
  only reasoning): string contents joined by a blank line, parts concatenated, tool calls
  appended, reasoning joined by a newline;
- when the template does not render a system message after the first (the probe of
  :func:`cortex.chat.messages_api.merges_inline_system`, ``MessagesOptions``), every system
  message's text is joined by a blank line into one leading system message;
- ``function`` tools and named ``custom`` tools (a single string ``input`` parameter, the
  grammar folded into the description) → chat tools with ``strict`` (default false); other
  types dropped, ``shell`` a 400; ``tool_choice`` → chat's (``none`` when no tool is left,
  a named ``function`` / ``custom`` choice must name a declared tool, other objects are
  ``auto``);
- ``reasoning`` → ``reasoning_effort`` (``medium`` when ``reasoning`` is given without an
  effort); ``none`` also sets ``thinking`` / ``enable_thinking`` false in
  ``chat_template_kwargs`` (the caller's values win); the generation prompt is always added
  (a trailing assistant text becomes a user message, as on SGLang's chat path).

A request with ``previous_response_id`` is not stateless (the engine prepends what it
stored): it is :class:`UnmodelledRequest`, as are vLLM's ``custom`` / ``namespace`` tools
and ``custom_tool_call`` items, and SGLang ``background`` requests.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import zlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from cortex.chat.errors import InvalidChatRequest, UnmodelledRequest
from cortex.chat.request import RenderArgs, render_args
from cortex.hashing import Engine

if TYPE_CHECKING:
    from cortex.chat.messages_api import MessagesOptions

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


def _vllm_chat_body(body: Mapping[str, Any]) -> dict[str, Any]:
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


# ---- SGLang ----

_SGLANG_TOOL_TYPES = frozenset({
    "function", "web_search", "web_search_preview", "code_interpreter", "file_search",
    "image_generation", "computer_use_preview", "local_shell", "shell", "mcp", "custom",
    "namespace", "tool_search"})
_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "ultra", "max")
_SUMMARIES = ("auto", "concise", "detailed")
_DEVELOPER_LABEL = "Developer instructions:"
_REASONING_STATE = "sglang-reasoning-v1."
_DROPPED_KEYS = ("id", "status", "type")
_CUSTOM_PARAMETERS = {
    "type": "object",
    "properties": {"input": {"type": "string",
                             "description": "The freeform text payload for this tool."}},
    "required": ["input"], "additionalProperties": False}


def _developer_content(content: Any) -> Any:
    """A developer message's content with its label: on a string, on its first text part,
    else as a part of its own."""
    if isinstance(content, str):
        return f"{_DEVELOPER_LABEL}\n{content}"
    if isinstance(content, list):
        for i, part in enumerate(content):
            if isinstance(part, Mapping) and isinstance(part.get("text"), str):
                return [*content[:i], {**part, "text": f"{_DEVELOPER_LABEL}\n{part['text']}"},
                        *content[i + 1:]]
        return [{"type": "input_text", "text": _DEVELOPER_LABEL}, *content]
    return content


def _reasoning_state(blob: Any) -> str | None:
    """The reasoning text SGLang packed into an ``encrypted_content`` it wrote."""
    if not isinstance(blob, str) or not blob.startswith(_REASONING_STATE):
        return None
    try:
        raw = base64.urlsafe_b64decode(blob[len(_REASONING_STATE):])
        return zlib.decompress(raw).decode("utf-8")
    except (ValueError, binascii.Error, zlib.error, UnicodeDecodeError):
        return None


def _texts(parts: Any, where: str) -> list[str]:
    texts = []
    for part in parts if isinstance(parts, list) else ():
        if isinstance(part, Mapping) and part.get("text"):
            if not isinstance(part["text"], str):
                raise _invalid(f"{where}: a text must be a string")
            texts.append(part["text"])
    return texts


def _arguments(raw: Any) -> str:
    """A function call's arguments as SGLang replays them: a JSON object (string or
    object), anything else ``{}``."""
    if isinstance(raw, str):
        try:
            parsed = json.loads(raw, parse_constant=_no_constant,
                                parse_float=_finite) if raw else None
        except ValueError:
            parsed = None
        return raw if isinstance(parsed, dict) else "{}"
    if isinstance(raw, dict):
        return json.dumps(raw, ensure_ascii=False, separators=(",", ":"))
    return "{}"


def _no_constant(name: str) -> Any:
    raise ValueError(name)  # orjson, which SGLang parses with, takes no NaN / Infinity


def _finite(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(text)  # nor numbers beyond a double
    return value


def _tool_output(output: Any, where: str) -> Any:
    if not isinstance(output, list):
        return output
    texts = [part.get("text", "") for part in output if isinstance(part, Mapping)]
    if not all(isinstance(text, str) for text in texts):
        raise _invalid(f"{where}.output: a text must be a string")
    return "".join(texts)


def _content_part(part: Any) -> Any:
    if not isinstance(part, Mapping):
        return part
    kind = part.get("type")
    if kind in ("input_text", "output_text"):
        return {"type": "text", "text": part.get("text", "")}
    if kind == "input_image":
        image = part.get("image_url")
        url = dict(image) if isinstance(image, Mapping) else {"url": image}
        if not url.get("detail"):
            url["detail"] = part.get("detail") or "auto"
        for name in ("min_dynamic_patch", "max_dynamic_patch", "max_long_side_pixel"):
            if name in part and name not in url:
                url[name] = part[name]
        return {"type": "image_url", "image_url": url}
    if kind == "image_url":
        image = part.get("image_url")
        if isinstance(image, str):
            image = {"url": image, "detail": part.get("detail", "auto")}
        elif isinstance(image, Mapping):
            image = dict(image)
            if not image.get("detail"):
                image["detail"] = part.get("detail") or "auto"
        return {**part, "image_url": image}
    return dict(part)


def _call(item: Mapping[str, Any], name: Any, arguments: str) -> dict[str, Any]:
    return {"role": "assistant", "tool_calls": [
        {"id": item.get("call_id") or item.get("id"), "type": "function",
         "function": {"name": name, "arguments": arguments}}]}


def _sglang_item(item: Mapping[str, Any], where: str) -> dict[str, Any] | None:
    """One input item as a chat message (``None``: dropped)."""
    if isinstance(item.get("id"), str) and item.get("content") is not None:
        item = {k: v for k, v in item.items() if k != "id"}  # SGLang's validation drops it
    if item.get("role") == "developer":
        item = {**item, "role": "system", "content": _developer_content(item.get("content"))}
    kind = item.get("type")
    if kind == "function_call":
        return _call(item, item.get("name"), _arguments(item.get("arguments")))
    if kind == "custom_tool_call":
        return _call(item, item.get("name"),
                     json.dumps({"input": item.get("input") or ""}, ensure_ascii=False))
    if kind in ("function_call_output", "custom_tool_call_output"):
        return {"role": "tool", "tool_call_id": item.get("call_id"),
                "content": _tool_output(item.get("output", ""), where)}
    if kind == "reasoning":
        texts = _texts(item.get("summary"), where) or _texts(item.get("content"), where)
        if not texts:
            restored = _reasoning_state(item.get("encrypted_content"))
            texts = [restored] if restored else []
        return {"role": "assistant", "reasoning_content": "\n".join(texts)} if texts else None
    if kind not in (None, "message"):
        raise _invalid(f"Unsupported Responses API input item type: {kind!r}")
    message = {k: v for k, v in item.items() if v is not None and k not in _DROPPED_KEYS}
    if isinstance(message.get("content"), list):
        message["content"] = [_content_part(part) for part in message["content"]]
    return message


def _parts(content: Any) -> list[Any]:
    if isinstance(content, list):
        return list(content)
    return [{"type": "text", "text": content}] if isinstance(content, str) and content else []


def _merged(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Consecutive assistant messages as one (one Responses turn is several items)."""
    out: list[dict[str, Any]] = []
    for message in messages:
        previous = out[-1] if out else None
        if message.get("role") != "assistant" or previous is None \
                or previous.get("role") != "assistant" \
                or (previous.get("phase") != message.get("phase")
                    and set(previous) != {"role", "reasoning_content"}):
            out.append(message)
            continue
        merged = out[-1] = dict(previous)
        if message.get("phase") is not None:
            merged["phase"] = message["phase"]
        new = message.get("content")
        if new is not None and new != "":
            old = merged.get("content")
            if old is None or old == "":
                merged["content"] = new
            elif isinstance(old, str) and isinstance(new, str):
                merged["content"] = f"{old}\n\n{new}"
            else:
                merged["content"] = _parts(old) + _parts(new)
        if message.get("tool_calls"):
            merged["tool_calls"] = list(merged.get("tool_calls") or []) + list(
                message["tool_calls"])
        if message.get("reasoning_content"):
            earlier = merged.get("reasoning_content")
            merged["reasoning_content"] = (f"{earlier}\n{message['reasoning_content']}"
                                           if earlier else message["reasoning_content"])
    return out


def _one_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every system message's text joined into one leading system message."""
    chunks: list[str] = []
    others = []
    for message in messages:
        if message.get("role") != "system":
            others.append(message)
            continue
        content = message.get("content")
        if isinstance(content, str):
            chunks.append(content)
        elif isinstance(content, list):
            chunks += [part["text"] for part in content if isinstance(part, Mapping)
                       and isinstance(part.get("text"), str)]
    if chunks:
        return [{"role": "system", "content": "\n\n".join(chunks)}, *others]
    return others


def _sglang_tools(value: Any) -> tuple[list[Mapping[str, Any]], list[dict[str, Any]]]:
    """The request's tools (validated) and the chat tools SGLang makes of them."""
    if value is None:
        return [], []
    if not isinstance(value, list):
        raise _invalid("'tools' must be a list", "tools")
    chat = []
    for i, tool in enumerate(value):
        if not isinstance(tool, Mapping) or tool.get("type") not in _SGLANG_TOOL_TYPES:
            raise _invalid(f"tools[{i}] must be an object with a known 'type'", "tools")
        for name in ("name", "description"):
            if tool.get(name) is not None and not isinstance(tool[name], str):
                raise _invalid(f"tools[{i}].{name} must be a string", "tools")
        if tool.get("parameters") is not None and not isinstance(tool["parameters"], Mapping):
            raise _invalid(f"tools[{i}].parameters must be an object", "tools")
        strict = tool.get("strict", False)
        if not isinstance(strict, bool):
            raise _invalid(f"tools[{i}].strict must be a boolean", "tools")
        if tool["type"] == "function" and not tool.get("name"):
            raise _invalid("Function tools must include a name.", "tools")
        if tool["type"] == "function":
            description, parameters = tool.get("description"), tool.get("parameters")
        elif tool["type"] == "custom" and tool.get("name"):
            description, parameters = _custom_description(tool), _CUSTOM_PARAMETERS
        else:
            continue
        chat.append({"type": "function", "function": {
            "name": tool["name"], "description": description, "parameters": parameters,
            "strict": strict}})
    if any(tool["type"] == "shell" for tool in value):
        raise _invalid("Shell tools are not supported by this model", "tools")
    return value, chat


def _custom_description(tool: Mapping[str, Any]) -> str | None:
    parts = [tool["description"]] if tool.get("description") else []
    grammar = tool.get("format")
    if isinstance(grammar, Mapping) and grammar.get("type") == "grammar":
        parts.append(f"The payload must conform to this {grammar.get('syntax') or 'lark'} "
                     f"grammar:\n{grammar.get('definition') or ''}")
    return "\n\n".join(parts) or None


def _sglang_tool_choice(body: Mapping[str, Any], tools: list[Mapping[str, Any]],
                        chat_tools: list[dict[str, Any]]) -> Any:
    choice = body.get("tool_choice", "auto")  # an explicit null is a 400 too
    if not (isinstance(choice, Mapping) or choice in ("auto", "required", "none")):
        raise _invalid("'tool_choice' must be 'auto', 'required', 'none' or an object",
                       "tool_choice")
    callable_tools = [t for t in tools if t["type"] in ("function", "custom")]
    if choice == "required" and not callable_tools:
        raise _invalid('tool_choice="required" requires at least one tool with '
                       'type="function" or type="custom"', "tool_choice")
    if isinstance(choice, Mapping):
        function = choice.get("function")
        name = choice.get("name") or (function.get("name") if isinstance(function, Mapping)
                                      else None)
        if choice.get("type") in ("function", "custom") and name:
            if not any(t.get("name") == name for t in callable_tools):
                raise _invalid(f"Tool {name!r} is not declared in tools", "tool_choice")
            choice = {"type": "function", "function": {"name": name}}
        else:
            choice = "auto"
    return choice if chat_tools else "none"


def _sglang_reasoning(body: Mapping[str, Any], out: dict[str, Any]) -> None:
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise _invalid("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    reasoning = body.get("reasoning")
    if reasoning is not None:
        if not isinstance(reasoning, Mapping):
            raise _invalid("'reasoning' must be an object", "reasoning")
        effort = reasoning.get("effort", "medium")
        if effort is not None and effort not in _EFFORTS:
            raise _invalid(f"reasoning.effort must be one of {list(_EFFORTS)}", "reasoning")
        if reasoning.get("summary") is not None and reasoning["summary"] not in _SUMMARIES:
            raise _invalid(f"reasoning.summary must be one of {list(_SUMMARIES)}",
                           "reasoning")
        if effort is not None:
            out["reasoning_effort"] = effort
        if (reasoning.get("effort") or reasoning.get("reasoning_effort")) == "none":
            kwargs = {"thinking": False, "enable_thinking": False, **(kwargs or {})}
    if kwargs is not None:
        out["chat_template_kwargs"] = dict(kwargs)


def _sglang_chat_body(body: Mapping[str, Any], options: MessagesOptions | None
                      ) -> dict[str, Any]:
    if body.get("background"):
        raise UnmodelledRequest("a background request (SGLang needs its response store)")
    tools, chat_tools = _sglang_tools(body.get("tools"))
    choice = _sglang_tool_choice(body, tools, chat_tools)
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise _invalid("'instructions' must be a string", "instructions")
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    elif not isinstance(items, list):
        raise _invalid("'input' must be a string or a list of items")
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    for i, item in enumerate(items):
        if not isinstance(item, Mapping):
            raise _invalid(f"input[{i}] must be an object")
        message = _sglang_item(item, f"input[{i}]")
        if message is not None:
            messages.append(message)
    messages = _merged(messages)
    if options is None or options.merge_inline_system:
        messages = _one_system(messages)
    out: dict[str, Any] = {"messages": messages, "tool_choice": choice}
    if chat_tools:
        out["tools"] = chat_tools
    _sglang_reasoning(body, out)
    return out


def responses_chat_body(body: Mapping[str, Any], engine: Engine,
                        options: MessagesOptions | None = None) -> dict[str, Any]:
    """The chat-completion body (its rendering fields) ``engine`` renders for a stateless
    Responses ``body``; ``options``: what the engine probed from its chat template (SGLang:
    ``merge_inline_system``; default: merge). Raises :class:`InvalidChatRequest`,
    :class:`UnmodelledRequest`."""
    if not isinstance(body, Mapping):
        raise _invalid("the body must be an object", "body")
    if body.get("previous_response_id") is not None:
        raise UnmodelledRequest("a follow-up by previous_response_id")
    if Engine(engine) is Engine.VLLM:
        return _vllm_chat_body(body)
    return _sglang_chat_body(body, options)


def responses_render_args(body: Mapping[str, Any], engine: Engine,
                          options: MessagesOptions | None = None) -> RenderArgs:
    """The rendering arguments of the chat request ``engine`` makes of a stateless
    Responses ``body`` (tokenize them with ``ChatTokenizer.encode_chat``)."""
    return render_args(responses_chat_body(body, engine, options), engine)
