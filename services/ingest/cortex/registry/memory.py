"""``MemoryRegistry``: the in-process registry for unit tests and single-process setups."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

from cortex.registry.base import DEFAULT_TTL_S, Listing, Registry
from cortex.registry.errors import RegistryUnavailable
from cortex.registry.spec import WorkerSpec

__all__ = ["MemoryRegistry"]


class MemoryRegistry(Registry):
    """Leases in a dict, with an injectable monotonic clock (seconds).

    ``available = False`` makes every call raise ``RegistryUnavailable``, which lets tests
    exercise the degraded paths without a real outage.
    """

    def __init__(
        self,
        default_ttl_s: float = DEFAULT_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(default_ttl_s)
        self._clock = clock
        self._entries: dict[str, tuple[WorkerSpec, float | None]] = {}  # id -> (spec, deadline)
        self._listeners: set[asyncio.Queue[str]] = set()
        self.available = True

    def __repr__(self) -> str:
        return f"MemoryRegistry(workers={len(self._entries)}, available={self.available})"

    def _check(self) -> None:
        if not self.available:
            raise RegistryUnavailable("memory registry marked unavailable")

    def _expire(self) -> None:
        now = self._clock()
        for worker_id in [
            wid for wid, (_, deadline) in self._entries.items()
            if deadline is not None and deadline <= now
        ]:
            del self._entries[worker_id]

    def _notify(self, worker_id: str) -> None:
        for queue in self._listeners:
            queue.put_nowait(worker_id)

    async def register(self, spec: WorkerSpec, ttl_s: float | None = None) -> None:
        self._check()
        ttl = self._ttl(ttl_s)
        self._entries[spec.id] = (spec, self._clock() + ttl if ttl else None)
        self._notify(spec.id)

    async def renew(self, worker_id: str, ttl_s: float | None = None) -> bool:
        self._check()
        self._expire()
        entry = self._entries.get(worker_id)
        if entry is None:
            return False
        ttl = self._ttl(ttl_s)
        self._entries[worker_id] = (entry[0], self._clock() + ttl if ttl else None)
        return True

    async def deregister(self, worker_id: str) -> bool:
        self._check()
        self._expire()
        found = self._entries.pop(worker_id, None) is not None
        if found:
            self._notify(worker_id)
        return found

    async def get(self, worker_id: str) -> WorkerSpec | None:
        self._check()
        self._expire()
        entry = self._entries.get(worker_id)
        return entry[0] if entry else None

    async def list(self) -> Listing:
        self._check()
        self._expire()
        now = self._clock()
        return Listing(
            workers={wid: spec for wid, (spec, _) in self._entries.items()},
            ttl_s={
                wid: None if deadline is None else max(0.0, deadline - now)
                for wid, (_, deadline) in self._entries.items()
            },
        )

    async def changes(self) -> AsyncIterator[str]:
        self._check()
        queue: asyncio.Queue[str] = asyncio.Queue()
        self._listeners.add(queue)
        try:
            while True:
                yield await queue.get()
                self._check()
        finally:
            self._listeners.discard(queue)

    async def close(self) -> None:
        self._listeners.clear()
