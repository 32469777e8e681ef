"""A stand-in for the Kubernetes API's pod endpoints, on 127.0.0.1, for tests.

No API server can run where Cortex is tested: this one answers
``GET /api/v1/namespaces/<ns>/pods`` the way the real one does — list answers (pages, or a
status code with a ``Status`` body) from :attr:`FakeKubernetesApi.lists` in order, and each
watch from a queue the test feeds event by event (every line split across two writes, as a
chunked stream may be) — and records every request (path, query, ``Authorization``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from cortex.testing.procs import serve_app

__all__ = ["FakeKubernetesApi", "Watch", "fake_kubernetes_api"]


@dataclass
class Watch:
    """One open watch: its query, and the events still to send (``None`` ends it)."""

    query: dict[str, str]
    events: asyncio.Queue[dict[str, Any] | None] = field(default_factory=asyncio.Queue)


@dataclass
class FakeKubernetesApi:
    namespace: str
    url: str = ""
    lists: deque[tuple[int, dict[str, Any]]] = field(default_factory=deque)
    watch_statuses: deque[tuple[int, dict[str, Any]]] = field(default_factory=deque)
    watches: asyncio.Queue[Watch] = field(default_factory=asyncio.Queue)
    requests: list[tuple[str, dict[str, str], str]] = field(default_factory=list)
    _open: list[Watch] = field(default_factory=list)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        query = dict(request.query)
        self.requests.append((request.path, query, request.headers.get("Authorization", "")))
        if request.path != f"/api/v1/namespaces/{self.namespace}/pods":
            return web.json_response({"kind": "Status", "code": 404}, status=404)
        if query.get("watch") != "1":
            status, body = self.lists.popleft()
            return web.json_response(body, status=status)
        if self.watch_statuses:
            status, body = self.watch_statuses.popleft()
            return web.json_response(body, status=status)
        watch = Watch(query)
        self._open.append(watch)
        await self.watches.put(watch)
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        while (event := await watch.events.get()) is not None:
            line = json.dumps(event).encode() + b"\n"
            await resp.write(line[:37])
            await resp.write(line[37:])
        await resp.write_eof()
        return resp

    async def next_watch(self, timeout_s: float = 10.0) -> Watch:
        """The next watch the client opens."""
        async with asyncio.timeout(timeout_s):
            return await self.watches.get()

    def calls(self, *, watch: bool) -> list[tuple[dict[str, str], str]]:
        """(query, Authorization) of every list (``watch=False``) or watch request."""
        return [(q, auth) for _, q, auth in self.requests if (q.get("watch") == "1") == watch]

    def end_watches(self) -> None:
        for watch in self._open:
            watch.events.put_nowait(None)


@contextlib.asynccontextmanager
async def fake_kubernetes_api(namespace: str) -> AsyncIterator[FakeKubernetesApi]:
    """The fake API server on a free port of 127.0.0.1 (``api.url``)."""
    api = FakeKubernetesApi(namespace)
    app = web.Application()
    app.router.add_get("/{tail:.*}", api.handle)
    async with serve_app(app) as api.url:
        try:
            yield api
        finally:
            api.end_watches()
