"""Render arguments + a chat template → the exact messages the template sees (pure).

Both engines inspect the template to decide how list-of-parts contents reach it: a template
that loops over ``message['content']`` gets parts (``"openai"`` format), any other gets one
string (``"string"`` format: vLLM joins the text parts with newlines, SGLang with spaces).
SGLang then handles a trailing assistant message: with ``continue_final_message`` it is
removed and its text tokenized on its own and appended after the rendered prompt's ids,
otherwise it becomes a user message.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import jinja2.nodes as nodes

from cortex.chat.request import RenderArgs
from cortex.chat.template import ChatTemplate
from cortex.hashing import Engine

__all__ = ["ContentFormat", "Conversation", "build_conversation", "content_format"]

_MEDIA_WORDS = ("image", "audio", "video", "vision")
_VLLM_MEDIA = frozenset({"image", "audio", "video"})  # media parts as vLLM's parser gives them


class ContentFormat(StrEnum):
    """How message contents are given to a template."""

    STRING = "string"
    OPENAI = "openai"


@dataclass(frozen=True, slots=True)
class Conversation:
    """The template's input: ``messages``, whether the rendered text is cut after the final
    message (``transformers``' ``continue_final_message``), and ``suffix``: SGLang's
    continued assistant prefix, tokenized on its own and appended after the prompt's ids."""

    messages: list[dict[str, Any]]
    continue_final_message: bool = False
    suffix: str = ""


# -- template inspection (the engines' AST heuristics) ----------------------------------------


def _is_var(node: nodes.Node, name: str) -> bool:
    return isinstance(node, nodes.Name) and node.ctx == "load" and node.name == name


def _is_item(node: nodes.Node, name: str, key: str) -> bool:
    if isinstance(node, nodes.Getitem):
        return (_is_var(node.node, name) and isinstance(node.arg, nodes.Const)
                and node.arg.value == key)
    return isinstance(node, nodes.Getattr) and _is_var(node.node, name) and node.attr == key


def _accesses(node: nodes.Node, name: str, key: str | None = None) -> bool:
    """``name`` (or ``name[key]``), possibly through filters, tests and slices."""
    if isinstance(node, nodes.Filter):
        return node.node is not None and _accesses(node.node, name, key)
    if isinstance(node, nodes.Test):
        return _accesses(node.node, name, key)
    if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
        return _accesses(node.node, name, key)
    return _is_item(node, name, key) if key else _is_var(node, name)


def _aliases(root: nodes.Template, name: str) -> Iterator[str]:
    """``name`` and every variable assigned from it (transitively)."""
    yield name
    seen = {name}
    pending = deque([name])
    while pending:
        current = pending.popleft()
        for assign in root.find_all(nodes.Assign):
            target = assign.target
            if (_accesses(assign.node, current) and isinstance(target, nodes.Name)
                    and target.name not in seen):
                seen.add(target.name)
                pending.append(target.name)
                yield target.name


def _loops_over_content_vllm(root: nodes.Template) -> bool:
    """vLLM's (0.32) test: a loop over a message's ``content``, over a macro parameter that
    some call passes a message's ``content`` (Qwen3.5's ``render_content(message.content)``),
    or over a variable named ``content`` outside any macro."""
    lists = list(_aliases(root, "messages"))
    items = [loop.target.name for loop in root.find_all(nodes.For)
             if isinstance(loop.target, nodes.Name)
             and any(_accesses(loop.iter, name) for name in lists)]
    if any(_accesses(loop.iter, item, "content")
           for loop in root.find_all(nodes.For) for item in items):
        return True
    in_macros: set[int] = set()
    for macro in root.find_all(nodes.Macro):
        params = _content_params(root, macro, items)
        for loop in macro.find_all(nodes.For):
            in_macros.add(id(loop))
            if isinstance(loop.iter, nodes.Name) and loop.iter.name in params:
                return True
    return any(id(loop) not in in_macros and isinstance(loop.iter, nodes.Name)
               and loop.iter.name == "content" for loop in root.find_all(nodes.For))


def _content_params(root: nodes.Template, macro: nodes.Macro, items: list[str]) -> set[str]:
    """The parameters of ``macro`` that a call passes some message's ``content``."""
    names = [arg.name for arg in macro.args]
    found: set[str] = set()
    for call in root.find_all(nodes.Call):
        if not (isinstance(call.node, nodes.Name) and call.node.name == macro.name):
            continue
        for name, arg in zip(names, call.args, strict=False):
            if any(_accesses(arg, item, "content") for item in items):
                found.add(name)
        for keyword in call.kwargs:
            if keyword.key in names and any(_accesses(keyword.value, item, "content")
                                            for item in items):
                found.add(keyword.key)
    return found


def _loops_over_content_sglang(template: ChatTemplate) -> bool:
    if any(word in template.text for word in _MEDIA_WORDS):
        return True
    return any(_accesses(loop.iter, name, "content")
               for loop in template.parsed.find_all(nodes.For) for name in ("message", "msg", "m"))


def content_format(template: ChatTemplate, engine: Engine) -> ContentFormat:
    """The content format ``engine`` detects for ``template`` (its ``auto`` setting)."""
    if engine is Engine.VLLM:
        loops = _loops_over_content_vllm(template.parsed)
    else:
        loops = _loops_over_content_sglang(template)
    return ContentFormat.OPENAI if loops else ContentFormat.STRING


# -- messages ------------------------------------------------------------------------------


def _texts(content: Any) -> list[str]:
    return [part["text"] for part in content if part.get("type") == "text"]


def _vllm_message(message: Mapping[str, Any], fmt: ContentFormat) -> dict[str, Any]:
    out = dict(message)
    content = message.get("content")
    texts = [] if content is None else [content] if isinstance(content, str) else _texts(content)
    if fmt is ContentFormat.STRING:
        # vLLM writes its model's placeholder strings for media before the text here:
        # unknown to the gateway, which then keys only what precedes this message
        out["content"] = "\n".join(texts)
    elif isinstance(content, tuple):
        out["content"] = [part for part in content if part.get("type") == "text"
                          or part.get("type") in _VLLM_MEDIA]
    else:
        out["content"] = [{"type": "text", "text": text} for text in texts]
    return out


def _sglang_part(part: Mapping[str, Any]) -> Mapping[str, Any] | None:
    kind = part.get("type")
    if kind == "text":
        return part
    if kind in ("image_url", "input_image"):
        return {"type": "image"}
    if kind in ("video_url", "audio_url"):
        return {"type": kind.removesuffix("_url")}
    if kind == "tool_reference":
        return part
    return None


def _sglang_message(message: Mapping[str, Any], fmt: ContentFormat) -> dict[str, Any]:
    out = dict(message)
    content = message.get("content")
    if not isinstance(content, tuple):
        return out
    if fmt is ContentFormat.STRING:
        out["content"] = " ".join(_texts(content))
        return out
    parts = [p for p in (_sglang_part(part) for part in content) if p is not None]
    if out["role"] == "tool" and all(p.get("type") == "text" for p in parts):
        out["content"] = " ".join(str(p["text"]) for p in parts)
    else:
        out["content"] = parts
    return out


def build_conversation(args: RenderArgs, fmt: ContentFormat) -> Conversation:
    """What the template renders for ``args`` given the template's content format."""
    if args.engine is Engine.VLLM:
        return Conversation([_vllm_message(m, fmt) for m in args.messages],
                            continue_final_message=args.continue_final_message)
    messages = [_sglang_message(m, fmt) for m in args.messages]
    suffix = ""
    last = messages[-1]
    if last["role"] == "assistant" and isinstance(last.get("content"), str):
        if args.continue_final_message:
            suffix = last["content"]
            messages.pop()
        else:
            messages[-1] = {"role": "user", "content": last["content"]}
    return Conversation(messages, suffix=suffix)
