"""An in-memory upstream beside the real one (:class:`~cortex.gateway.upstream.client.Upstream`):
workers that answer from a script, for tests of dispatch's logic without sockets.

``MemoryUpstream({"w0": [Reply(503), Reply()]})`` answers ``w0``'s first send with a 503 and
every later one with an SSE stream; ``Reply(fail=FailureKind.CONNECT)`` raises at the send as
a refused connection would, ``Reply(hang=True)`` never answers. Every send is kept in ``sent``
and every response in ``responses`` (whether dispatch closed it).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass, field

from cortex.gateway.upstream.client import FailureKind, UpstreamFailure
from cortex.registry import WorkerSpec

__all__ = ["EVENT", "MemoryResponse", "MemoryUpstream", "Reply"]

EVENT = b'data: {"choices":[{"index":0,"text":"x"}]}\n\n'
"""One SSE completion event, the default answer's body before ``[DONE]``."""


@dataclass(frozen=True)
class Reply:
    """A scripted answer: ``fail`` raises at the send, ``hang`` never answers."""

    status: int = 200
    body: tuple[bytes, ...] = (EVENT, b"data: [DONE]\n\n")
    retry_after_s: float | None = None
    fail: FailureKind | None = None
    hang: bool = False


@dataclass(eq=False)
class MemoryResponse:
    """A scripted answer as dispatch reads it (the real one's :class:`Response` contract)."""

    status: int
    parts: tuple[bytes, ...]
    retry_after_s: float | None
    content_type: str = "text/event-stream"
    closed: bool = False

    async def chunks(self, idle_timeout_s: float | None = None) -> AsyncGenerator[bytes, None]:
        for part in self.parts:
            yield part

    async def read(self) -> bytes:
        return b"".join(self.parts)

    def close(self) -> None:
        self.closed = True


@dataclass(eq=False)
class MemoryUpstream:
    """Workers answering from ``script`` (worker id → replies in order, the last repeats);
    every send is kept in ``sent`` and every response in ``responses``."""

    script: dict[str, list[Reply]]
    sent: list[tuple[str, bytes]] = field(default_factory=list)
    responses: list[MemoryResponse] = field(default_factory=list)

    async def post(self, url: str, body: bytes, headers: Mapping[str, str],
                   worker: WorkerSpec | None = None) -> MemoryResponse:
        if worker is None or not url.startswith(worker.url):
            raise ValueError(f"a send to {url} names no worker of its own")
        self.sent.append((worker.id, body))
        replies = self.script[worker.id]
        reply = replies.pop(0) if len(replies) > 1 else replies[0]
        if reply.hang:
            await asyncio.Event().wait()
        if reply.fail is not None:
            raise UpstreamFailure(reply.fail, "scripted")
        response = MemoryResponse(reply.status, reply.body, reply.retry_after_s)
        self.responses.append(response)
        return response

    def reached(self) -> list[str]:
        """The worker each send went to, in order."""
        return [worker for worker, _ in self.sent]
