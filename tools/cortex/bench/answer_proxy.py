"""``AnswerProxy``: an HTTP reverse proxy in front of a worker that, when armed, answers its
generation requests with a broken 200 (for ``cortex bench faults`` and the gateway tests).

Everything else (health, load, models, the generation requests while disarmed) is relayed
to the worker as it comes, so the gateway keeps the proxy in its pool; ``server_info``
fields, when set, override the worker's own (a worker that reports another capacity). The shapes
(:class:`Shape`) are what issue 32 saw reach clients as 200s, plus a huge answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from enum import StrEnum

import aiohttp
from aiohttp import web

__all__ = ["AnswerProxy", "Shape"]

_GENERATION = frozenset({"/v1/chat/completions", "/v1/completions", "/generate"})
_HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length",
                  "content-encoding"})


class Shape(StrEnum):
    NOT_JSON = "not_json"  # a 200 application/json whose body is HTML
    GARBAGE_SSE = "garbage_sse"  # a stream whose first bytes are not SSE
    LATE_GARBAGE_SSE = "late_garbage_sse"  # one good event, then garbage
    JSON_FOR_STREAM = "json_for_stream"  # a JSON object answering a streamed request
    HUGE = "huge"  # a 200 application/json of ``huge_bytes``, chunked, no length


class AnswerProxy:
    """``async with AnswerProxy(worker_url) as proxy``: listening on ``proxy.url``;
    ``proxy.shape`` set: generation requests get that answer (``answered`` counts them)."""

    def __init__(self, upstream: str, huge_bytes: int = 200 << 20) -> None:
        self.upstream = upstream.rstrip("/")
        self.huge_bytes = huge_bytes
        self.shape: Shape | None = None
        self.server_info: dict[str, object] = {}
        """Fields that override the worker's own in its ``/server_info`` answer."""
        self.answered = 0
        self.url = ""
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> AnswerProxy:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._session = aiohttp.ClientSession(auto_decompress=False)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        if self.shape is not None and request.path in _GENERATION:
            self.answered += 1
            stream = bool(json.loads(body or b"{}").get("stream"))
            return await self._broken(request, self.shape, stream)
        if self.server_info and request.path == "/server_info":
            assert self._session is not None
            async with self._session.get(self.upstream + request.path_qs) as upstream:
                info = await upstream.json(content_type=None)
            return web.json_response({**info, **self.server_info})
        return await self._relay(request, body)

    async def _broken(self, request: web.Request, shape: Shape, stream: bool
                      ) -> web.StreamResponse:
        if shape is Shape.NOT_JSON:
            return web.Response(body=b"<html>upstream error</html>",
                                content_type="application/json")
        if shape is Shape.JSON_FOR_STREAM or (shape is not Shape.HUGE and not stream):
            return web.json_response({"id": "x", "object": "chat.completion", "choices": []})
        response = web.StreamResponse(status=200)
        if shape is Shape.HUGE:
            response.content_type = "application/json"
            await response.prepare(request)
            piece = b"a" * (1 << 20)
            with contextlib.suppress(ConnectionError):  # the gateway stops reading: expected
                await response.write(b'{"id":"x","pad":"')
                for _ in range(self.huge_bytes // len(piece)):
                    await response.write(piece)
                await response.write(b'"}')
            return response
        response.content_type = "text/event-stream"
        await response.prepare(request)
        if shape is Shape.LATE_GARBAGE_SSE:
            await response.write(b'data: {"id":"x","choices":[{"index":0,"delta":'
                                 b'{"content":"ok"}}]}\n\n')
            await asyncio.sleep(0.2)  # the garbage in a later read, after the first byte
        await response.write(b"this is not an event stream\n\n")
        return response

    async def _relay(self, request: web.Request, body: bytes) -> web.StreamResponse:
        assert self._session is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP
                   and k.lower() != "host"}
        async with self._session.request(request.method, self.upstream + request.path_qs,
                                         data=body or None, headers=headers) as upstream:
            response = web.StreamResponse(status=upstream.status, headers={
                k: v for k, v in upstream.headers.items() if k.lower() not in _HOP})
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    def __repr__(self) -> str:
        return f"AnswerProxy({self.url} -> {self.upstream}, shape={self.shape})"
