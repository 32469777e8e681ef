"""The sim's answers beyond generation: its ``--api-key`` check, and minimal embeddings,
rerank, score, responses and messages endpoints (enough for a gateway to relay them).

What they answer is deterministic and small: an embedding is derived from the input's
hash, a rerank/score from word overlap; a response is kept in this process's memory (as
the engines keep theirs) so that ``GET /v1/responses/{id}``, its cancel and a follow-up's
``previous_response_id`` work only on the worker that produced it.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Awaitable, Callable

from aiohttp import web

__all__ = ["auth_middleware"]

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

OPEN_PATHS = frozenset({"/health", "/health_generate", "/ping", "/metrics", "/version"})
"""Paths the engines answer without their ``--api-key``."""


def auth_middleware(api_key: str | None) -> Callable[[web.Request, Handler],
                                                      Awaitable[web.StreamResponse]]:
    """401 for a request without ``Authorization: Bearer <api_key>`` (``None``: open)."""
    expected = f"Bearer {api_key}".encode()

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if api_key is None or request.path in OPEN_PATHS or request.path.startswith("/sim/"):
            return await handler(request)
        given = request.headers.get("Authorization", "").encode()
        if not hmac.compare_digest(given, expected):
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    return check


def _unit(text: str, dims: int) -> list[float]:
    digest = hashlib.sha256(text.encode()).digest()
    return [round((digest[i % len(digest)] - 127.5) / 127.5, 6) for i in range(dims)]
