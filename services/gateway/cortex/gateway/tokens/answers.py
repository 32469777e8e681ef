"""The answers a response carried, as the next turn of the conversation will resend them (pure).

After a response ends the gateway encodes its answer into the segment cache (off the
request path): clients resend the whole history every turn, so the next request then costs
only its new text. Chat answers become assistant messages (``content``, reasoning,
``tool_calls`` assembled from stream deltas), completion answers the text to append to the
prompt. A response that cannot be read yields no answer; nothing here raises.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from cortex.gateway.http.messages import json_loads

__all__ = ["chat_answers", "completion_answers", "stream_objects"]

MAX_CHOICES = 4
"""Answers taken from one response (``n`` > this: the first ones)."""


def stream_objects(events: bytes) -> Iterator[dict[str, Any]]:
    """The JSON objects of an SSE stream's data events (``[DONE]`` and junk skipped)."""
    for block in events.replace(b"\r\n", b"\n").split(b"\n\n"):
        data = b"\n".join(line[5:].lstrip(b" ") for line in block.split(b"\n")
                          if line.startswith(b"data:"))
        if not data or data == b"[DONE]":
            continue
        try:
            obj = json_loads(data)
        except ValueError:
            continue
        if isinstance(obj, dict):
            yield obj


def _index(choice: dict[str, Any]) -> int | None:
    index = choice.get("index", 0)
    return index if isinstance(index, int) and 0 <= index < MAX_CHOICES else None


def _choices(obj: dict[str, Any]) -> list[dict[str, Any]]:
    choices = obj.get("choices")
    return [c for c in choices if isinstance(c, dict)] if isinstance(choices, list) else []


def _message(content: str, reasoning: str, calls: list[dict[str, Any]]) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = calls
    return message


def chat_answers(obj: dict[str, Any] | None = None, events: bytes | None = None
                 ) -> list[dict[str, Any]]:
    """Assistant messages of a ``/v1/chat/completions`` answer: a JSON body (``obj``) or a
    stream's events (``events``), by choice index."""
    if obj is not None:
        out = []
        for choice in _choices(obj):
            msg = choice.get("message")
            if _index(choice) is None or not isinstance(msg, dict):
                continue
            content = msg.get("content")
            reasoning = msg.get("reasoning_content") or msg.get("reasoning")
            given = msg.get("tool_calls")
            out.append(_message(content if isinstance(content, str) else "",
                                reasoning if isinstance(reasoning, str) else "",
                                [c for c in given if isinstance(c, dict)]
                                if isinstance(given, list) else []))
        return out
    if events is None:
        return []
    contents: dict[int, list[str]] = {}
    reasonings: dict[int, list[str]] = {}
    calls: dict[int, dict[int, dict[str, Any]]] = {}
    for event in stream_objects(events):
        for choice in _choices(event):
            index = _index(choice)
            delta = choice.get("delta")
            if index is None or not isinstance(delta, dict):
                continue
            contents.setdefault(index, [])
            if isinstance(delta.get("content"), str):
                contents[index].append(delta["content"])
            reasoning = delta.get("reasoning_content") or delta.get("reasoning")
            if isinstance(reasoning, str):
                reasonings.setdefault(index, []).append(reasoning)
            for call in delta.get("tool_calls") or ():
                if isinstance(call, dict):
                    _merge_call(calls.setdefault(index, {}), call)
    return [_message("".join(contents[i]), "".join(reasonings.get(i, ())),
                     [calls[i][k] for k in sorted(calls.get(i, {}))])
            for i in sorted(contents)]


def _merge_call(calls: dict[int, dict[str, Any]], delta: dict[str, Any]) -> None:
    """Fold a streamed tool-call delta (id and name once, arguments in pieces) in."""
    index = delta.get("index", len(calls))
    if not isinstance(index, int):
        return
    call = calls.setdefault(index, {"id": None, "type": "function",
                                    "function": {"name": "", "arguments": ""}})
    if isinstance(delta.get("id"), str):
        call["id"] = delta["id"]
    fn = delta.get("function")
    if isinstance(fn, dict):
        if isinstance(fn.get("name"), str):
            call["function"]["name"] += fn["name"]
        if isinstance(fn.get("arguments"), str):
            call["function"]["arguments"] += fn["arguments"]


def completion_answers(obj: dict[str, Any] | None = None, events: bytes | None = None
                       ) -> list[str]:
    """Texts of a ``/v1/completions`` answer (JSON body or stream events), by choice."""
    texts: dict[int, list[str]] = {}
    objects = [obj] if obj is not None else list(stream_objects(events or b""))
    for item in objects:
        for choice in _choices(item):
            index = _index(choice)
            if index is not None and isinstance(choice.get("text"), str):
                texts.setdefault(index, []).append(choice["text"])
    return ["".join(texts[i]) for i in sorted(texts)]
