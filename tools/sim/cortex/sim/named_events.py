"""The Anthropic Messages and OpenAI Responses answers of the engines (pure shapes).

Both engines answer these APIs by converting their chat output; the simulator sends text
only (no tool calls, no reasoning), with each engine's usage fields:

- Messages usage: vLLM 0.32 ``input_tokens`` = prompt tokens less the cached ones, plus
  ``cache_read_input_tokens`` (with ``--enable-prompt-tokens-details``, which the sim
  always reports); SGLang 0.5.23 ``input_tokens`` = all prompt tokens, plus
  ``cache_read_input_tokens``. A stream is ``message_start`` (with that usage),
  ``content_block_start``, ``content_block_delta`` (``text_delta``) per piece,
  ``content_block_stop``, ``message_delta`` (stop reason and usage), ``message_stop``;
  each event as ``event: <type>`` + ``data: <json>``.
- Responses usage: ``input_tokens`` (all), ``input_tokens_details.cached_tokens``,
  ``output_tokens``, ``total_tokens``. A stream is ``response.created``,
  ``response.in_progress``, ``response.output_item.added``, ``response.content_part.added``,
  ``response.output_text.delta`` per piece, ``response.output_text.done``,
  ``response.content_part.done``, ``response.output_item.done``, ``response.completed``
  (the whole response with its usage), each with a ``sequence_number``.
"""

from __future__ import annotations

import json
from typing import Any

from cortex.hashing import Engine
from cortex.sim.protocol import Endpoint, GenRequest, SequenceResult

__all__ = ["closing_events", "event_bytes", "named_response", "opening_events",
           "piece_events"]

_STOP = {"stop": "end_turn", "length": "max_tokens"}


def event_bytes(obj: dict[str, Any]) -> bytes:
    """One named SSE event (the engines' compact JSON)."""
    data = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return f"event: {obj['type']}\ndata: {data}\n\n".encode()


def _messages_usage(engine: Engine, r: SequenceResult, output: int) -> dict[str, Any]:
    cached = r.cached_tokens
    uncached = r.prompt_tokens - cached if engine is Engine.VLLM else r.prompt_tokens
    return {"input_tokens": max(0, uncached), "output_tokens": output,
            "cache_read_input_tokens": cached}


def _responses_usage(r: SequenceResult, output: int) -> dict[str, Any]:
    return {"input_tokens": r.prompt_tokens,
            "input_tokens_details": {"cached_tokens": r.cached_tokens},
            "output_tokens": output, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": r.prompt_tokens + output}


def _item_id(req: GenRequest) -> str:
    return "msg_" + req.request_id.removeprefix("resp_")


def _message(req: GenRequest, text: str, status: str) -> dict[str, Any]:
    return {"id": _item_id(req), "type": "message", "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [],
                         "logprobs": []}] if status == "completed" else []}


def _response(req: GenRequest, r: SequenceResult | None, status: str, text: str = ""
              ) -> dict[str, Any]:
    done = status == "completed" and r is not None
    return {"id": req.request_id, "object": "response", "created_at": req.created,
            "model": req.model, "status": status,
            "output": [_message(req, text, "completed")] if done else [],
            "usage": _responses_usage(r, len(r.plan)) if done and r is not None else None}


def named_response(req: GenRequest, r: SequenceResult, engine: Engine) -> dict[str, Any]:
    """The whole (non-streamed) answer."""
    if req.endpoint is Endpoint.RESPONSES:
        return _response(req, r, "completed", r.plan.text)
    return {"id": req.request_id, "type": "message", "role": "assistant", "model": req.model,
            "content": [{"type": "text", "text": r.plan.text}],
            "stop_reason": _STOP.get(r.plan.finish_reason.value, "end_turn"),
            "stop_sequence": None,
            "usage": _messages_usage(engine, r, len(r.plan))}


def opening_events(req: GenRequest, r: SequenceResult, engine: Engine) -> list[dict[str, Any]]:
    """What a stream sends before its first piece."""
    if req.endpoint is Endpoint.RESPONSES:
        return [{"type": "response.created", "response": _response(req, None, "in_progress")},
                {"type": "response.in_progress",
                 "response": _response(req, None, "in_progress")},
                {"type": "response.output_item.added", "output_index": 0,
                 "item": _message(req, "", "in_progress")},
                {"type": "response.content_part.added", "item_id": _item_id(req),
                 "output_index": 0, "content_index": 0,
                 "part": {"type": "output_text", "text": "", "annotations": []}}]
    return [{"type": "message_start", "message": {
                "id": req.request_id, "type": "message", "role": "assistant", "content": [],
                "model": req.model, "stop_reason": None, "stop_sequence": None,
                "usage": _messages_usage(engine, r, 0)}},
            {"type": "content_block_start", "index": 0,
             "content_block": {"type": "text", "text": ""}}]


def piece_events(req: GenRequest, piece: str) -> list[dict[str, Any]]:
    """One streamed piece of text."""
    if not piece:
        return []
    if req.endpoint is Endpoint.RESPONSES:
        return [{"type": "response.output_text.delta", "item_id": _item_id(req),
                 "output_index": 0, "content_index": 0, "delta": piece, "logprobs": []}]
    return [{"type": "content_block_delta", "index": 0,
             "delta": {"type": "text_delta", "text": piece}}]


def closing_events(req: GenRequest, r: SequenceResult, engine: Engine) -> list[dict[str, Any]]:
    """What a stream sends after its last piece (the final usage)."""
    if req.endpoint is Endpoint.RESPONSES:
        text = r.plan.text
        return [{"type": "response.output_text.done", "item_id": _item_id(req),
                 "output_index": 0, "content_index": 0, "text": text, "logprobs": []},
                {"type": "response.content_part.done", "item_id": _item_id(req),
                 "output_index": 0, "content_index": 0,
                 "part": {"type": "output_text", "text": text, "annotations": []}},
                {"type": "response.output_item.done", "output_index": 0,
                 "item": _message(req, text, "completed")},
                {"type": "response.completed", "response": _response(req, r, "completed",
                                                                     text)}]
    return [{"type": "content_block_stop", "index": 0},
            {"type": "message_delta",
             "delta": {"stop_reason": _STOP.get(r.plan.finish_reason.value, "end_turn"),
                       "stop_sequence": None},
             "usage": _messages_usage(engine, r, len(r.plan))},
            {"type": "message_stop"}]


def numbered(events: list[dict[str, Any]], start: int) -> list[dict[str, Any]]:
    """Responses events with their ``sequence_number`` from ``start``."""
    return [{**event, "sequence_number": start + i} for i, event in enumerate(events)]
