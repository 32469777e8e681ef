"""The sim's answers beyond generation: its ``--api-key`` check, minimal embeddings,
rerank and score endpoints (enough for a gateway to relay them), and the store of
``/v1/responses`` answers.

What they answer is deterministic and small: an embedding is derived from the input's
hash, a rerank/score from word overlap. A response is kept in this process's memory (as
the engines keep theirs: :meth:`AuxiliaryRoutes.keep`) so that ``GET /v1/responses/{id}``,
its cancel and a follow-up's ``previous_response_id`` work only on the worker that produced
it; a follow-up (or what ``cortex.chat`` does not model) is answered here with a fixed
text (a stateless request is a generation, ``cortex.sim.routes``).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import itertools
import json
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Middleware

__all__ = ["AuxiliaryRoutes", "auth_middleware"]

_KEPT_RESPONSES = 10_000
_EMBEDDING_DIMS = 8

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

OPEN_PATHS = frozenset({"/health", "/health_generate", "/ping", "/metrics", "/metrics/",
                        "/version"})
"""Paths the engines answer without their ``--api-key``."""


def auth_middleware(api_key: str | None, seen: dict[str, str]) -> Middleware:
    """401 for a request without ``Authorization: Bearer <api_key>`` (``None``: open);
    ``seen`` keeps the ``traceparent`` of the last request that carried one (what a
    tracing gateway forwarded)."""
    expected = f"Bearer {api_key}".encode()

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if "traceparent" in request.headers:
            seen["traceparent"] = request.headers["traceparent"]
        if api_key is None or request.path in OPEN_PATHS or request.path.startswith("/sim/"):
            return await handler(request)
        given = request.headers.get("Authorization", "").encode()
        if not hmac.compare_digest(given, expected):
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    return check


def _vector(text: str) -> list[float]:
    digest = hashlib.sha256(text.encode()).digest()
    return [round((digest[i] - 127.5) / 127.5, 6) for i in range(_EMBEDDING_DIMS)]


def _words(text: str) -> set[str]:
    return {w.strip(".,;:!?").lower() for w in text.split() if w.strip(".,;:!?")}


def _overlap(a: str, b: str) -> float:
    """Share of ``a``'s words found in ``b`` (0..1): a deterministic stand-in for a score."""
    words = _words(a)
    return round(len(words & _words(b)) / len(words), 6) if words else 0.0


def _text_of(value: Any) -> str:
    """The text of an ``input``/``content``: a string, or the text parts of a list."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return " ".join(_text_of(v.get("content", v.get("text", "")) if isinstance(v, dict)
                                 else v) for v in value)
    return ""


def _sse(event: str | None, obj: Any) -> bytes:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(obj, separators=(',', ':'))}\n\n".encode()


class AuxiliaryRoutes:
    """``/v1/embeddings``, ``/v1/rerank``, ``/v1/score``, ``GET /v1/responses/{id}`` and its
    cancel of one sim serving ``model``, and :meth:`reply` (a ``previous_response_id``);
    ``answer``: the text such an answer is."""

    def __init__(self, model: str, served_by: Callable[[], dict[str, str]],
                 answer: str = "A short simulated answer.") -> None:
        self.model = model
        self._served_by = served_by
        self.answer = answer
        self.responses: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._ids = itertools.count(1)
        self._salt = hashlib.sha256(f"{time.time_ns()}".encode()).hexdigest()[:8]

    def add_to(self, app: web.Application) -> None:
        r = app.router
        r.add_post("/v1/embeddings", self._embeddings)
        r.add_post("/v1/rerank", self._rerank)
        r.add_post("/v1/score", self._score)
        r.add_get("/v1/responses/{id}", self._get_response)
        r.add_post("/v1/responses/{id}/cancel", self._cancel_response)

    def keep(self, response: dict[str, Any]) -> None:
        """Remember a response (the most recent ``_KEPT_RESPONSES``)."""
        self.responses[response["id"]] = response
        while len(self.responses) > _KEPT_RESPONSES:
            self.responses.popitem(last=False)

    def _new_id(self, prefix: str) -> str:
        return f"{prefix}_{self._salt}{next(self._ids):08d}"

    def _error(self, message: str, status: int = 400) -> web.Response:
        return web.json_response({"error": {"message": message, "type": "invalid_request_error",
                                            "code": status}}, status=status,
                                 headers=self._served_by())

    async def _body(self, request: web.Request) -> dict[str, Any] | web.Response:
        try:
            body = await request.json()
        except ValueError:
            return self._error("body is not JSON")
        if not isinstance(body, dict):
            return self._error("body must be an object")
        if body.get("model") != self.model:
            return self._error(f"model {body.get('model')!r} not found", 404)
        return body

    def _json(self, obj: Any) -> web.Response:
        return web.json_response(obj, headers=self._served_by())

    async def _embeddings(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if isinstance(body, web.Response):
            return body
        given = body.get("input")
        inputs = [given] if isinstance(given, str) else given
        if not isinstance(inputs, list) or not inputs:
            return self._error("input must be a string or a non-empty list")
        texts = [i if isinstance(i, str) else json.dumps(i) for i in inputs]
        tokens = sum(len(t.split()) for t in texts)
        return self._json({"object": "list", "model": self.model, "data": [
            {"object": "embedding", "index": n, "embedding": _vector(t)}
            for n, t in enumerate(texts)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    async def _rerank(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if isinstance(body, web.Response):
            return body
        query, documents = body.get("query"), body.get("documents")
        if not isinstance(query, str) or not isinstance(documents, list):
            return self._error("query must be a string and documents a list")
        texts = [_text_of(d) for d in documents]
        ranked = sorted(((_overlap(query, t), n) for n, t in enumerate(texts)), reverse=True)
        top = body.get("top_n")
        if isinstance(top, int) and top > 0:
            ranked = ranked[:top]
        return self._json({"id": self._new_id("rerank"), "model": self.model, "results": [
            {"index": n, "relevance_score": score, "document": {"text": texts[n]}}
            for score, n in ranked], "usage": {"total_tokens": len(query.split())}})

    async def _score(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if isinstance(body, web.Response):
            return body
        first, second = body.get("text_1"), body.get("text_2")
        if not isinstance(first, str):
            return self._error("text_1 must be a string")
        seconds = [second] if isinstance(second, str) else second
        if not isinstance(seconds, list):
            return self._error("text_2 must be a string or a list")
        return self._json({"id": self._new_id("score"), "object": "list", "model": self.model,
                           "data": [{"index": n, "object": "score",
                                     "score": _overlap(first, _text_of(s))}
                                    for n, s in enumerate(seconds)],
                           "usage": {"prompt_tokens": len(first.split())}})

    # ---- responses: kept in this process, like the engines keep theirs ----

    async def reply(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/responses`` the sim does not generate (a follow-up by
        ``previous_response_id``: 404 unless that response is kept here): a fixed answer,
        kept."""
        body = await self._body(request)
        if isinstance(body, web.Response):
            return body
        previous = body.get("previous_response_id")
        if previous is not None and previous not in self.responses:
            return self._error(f"response {previous!r} not found", 404)
        response_id = self._new_id("resp")
        response: dict[str, Any] = {"id": response_id, "object": "response",
                    "created_at": int(time.time()), "model": self.model,
                    "status": "completed", "previous_response_id": previous,
                    "output": [{"type": "message", "role": "assistant", "content": [
                        {"type": "output_text", "text": self.answer}]}],
                    "usage": {"input_tokens": len(_text_of(body.get("input")).split()),
                              "output_tokens": len(self.answer.split())}}
        self.keep(response)
        if body.get("stream") is not True:
            return self._json(response)
        stream = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                             **self._served_by()})
        await stream.prepare(request)
        await stream.write(_sse("response.created", {
            "type": "response.created", "response": {**response, "status": "in_progress",
                                                      "output": []}}))
        for word in self.answer.split():
            await asyncio.sleep(0)
            await stream.write(_sse("response.output_text.delta", {
                "type": "response.output_text.delta", "delta": word + " "}))
        await stream.write(_sse("response.completed", {"type": "response.completed",
                                                        "response": response}))
        await stream.write_eof()
        return stream

    async def _get_response(self, request: web.Request) -> web.Response:
        found = self.responses.get(request.match_info["id"])
        if found is None:
            return self._error("response not found", 404)
        return self._json(found)

    async def _cancel_response(self, request: web.Request) -> web.Response:
        found = self.responses.get(request.match_info["id"])
        if found is None:
            return self._error("response not found", 404)
        found["status"] = "cancelled"
        return self._json(found)
