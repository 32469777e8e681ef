"""``MemoryRegistry``: the in-process registry for unit tests and single-process setups."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

from cortex.registry.base import DEFAULT_TTL_S, Assertion, Listing, Registry, Tombstone
from cortex.registry.errors import RegistryUnavailable
from cortex.registry.spec import WorkerSpec

__all__ = ["MemoryRegistry"]


class MemoryRegistry(Registry):
    """Leases and tombstones in dicts, with an injectable monotonic clock (seconds).

    ``available = False`` makes every call raise ``RegistryUnavailable``, which lets tests
    exercise the degraded paths without a real outage; :meth:`wipe` forgets everything, as
    a Redis restarted without persistence does.
    """

    def __init__(
        self,
        default_ttl_s: float = DEFAULT_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(default_ttl_s)
        self._clock = clock
        self._entries: dict[str, tuple[WorkerSpec, float | None]] = {}  # id -> (spec, deadline)
        self._tombstones: dict[str, tuple[Tombstone, float | None]] = {}
        self._listeners: set[asyncio.Queue[str]] = set()
        self.available = True

    def __repr__(self) -> str:
        return (f"MemoryRegistry(workers={len(self._entries)}, "
                f"tombstones={len(self._tombstones)}, available={self.available})")

    def _check(self) -> None:
        if not self.available:
            raise RegistryUnavailable("memory registry marked unavailable")

    def _deadline(self, ttl: float | None) -> float | None:
        return self._clock() + ttl if ttl else None

    def _expire(self) -> None:
        now = self._clock()
        for table in (self._entries, self._tombstones):
            for key in [k for k, (_, deadline) in table.items()
                        if deadline is not None and deadline <= now]:
                del table[key]

    def _notify(self, worker_id: str) -> None:
        for queue in self._listeners:
            queue.put_nowait(worker_id)

    def wipe(self) -> None:
        """Forget every lease and tombstone (a Redis restarted empty)."""
        self._entries.clear()
        self._tombstones.clear()

    async def register(self, spec: WorkerSpec, ttl_s: float | None = None) -> None:
        self._check()
        self._tombstones.pop(spec.id, None)
        self._entries[spec.id] = (spec, self._deadline(self._ttl(ttl_s)))
        self._notify(spec.id)

    async def reassert(self, spec: WorkerSpec, ttl_s: float | None = None, *,
                       replace: bool = False) -> Assertion:
        self._check()
        self._expire()
        ttl = self._ttl(ttl_s)
        if spec.id in self._tombstones:
            return Assertion.TOMBSTONED
        entry = self._entries.get(spec.id)
        if entry is not None and not replace:
            self._entries[spec.id] = (entry[0], self._deadline(ttl))
            return Assertion.RENEWED
        self._entries[spec.id] = (spec, self._deadline(ttl))
        self._notify(spec.id)
        return Assertion.CREATED if entry is None else Assertion.REPLACED

    async def renew(self, worker_id: str, ttl_s: float | None = None) -> bool:
        self._check()
        self._expire()
        entry = self._entries.get(worker_id)
        if entry is None:
            return False
        self._entries[worker_id] = (entry[0], self._deadline(self._ttl(ttl_s)))
        return True

    async def deregister(self, worker_id: str) -> bool:
        self._check()
        self._expire()
        found = self._entries.pop(worker_id, None) is not None
        if found:
            self._notify(worker_id)
        return found

    async def remove(self, worker_id: str, *, tombstone_ttl_s: float | None = None,
                     reason: str = "") -> bool:
        self._check()
        self._expire()
        ttl = self._tombstone_ttl(tombstone_ttl_s)
        found = self._entries.pop(worker_id, None) is not None
        self._tombstones[worker_id] = (Tombstone(worker_id, reason, time.time()),
                                       self._deadline(ttl))
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

        def remaining(deadline: float | None) -> float | None:
            return None if deadline is None else max(0.0, deadline - now)

        return Listing(
            workers={wid: spec for wid, (spec, _) in self._entries.items()},
            ttl_s={wid: remaining(deadline) for wid, (_, deadline) in self._entries.items()},
            tombstones={wid: Tombstone(stone.worker_id, stone.reason, stone.at,
                                       remaining(deadline))
                        for wid, (stone, deadline) in self._tombstones.items()},
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
