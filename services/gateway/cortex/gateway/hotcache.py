"""The gateway's hot cache of index answers: repeated prefixes skip the gRPC round trip.

An answer is reused only for the very same query (same domain, same number of blocks, same
last chained key, which pins every earlier block) and only while younger than the staleness
bound. The index's change feed invalidates it: removed blocks or a cleared / removed /
no-longer-READY source drop every answer that credited that source (coarse on purpose: a
dropped answer costs one round trip, a kept wrong one over-predicts), and a feed ``reset``
drops everything. Stores are not fed: a stale answer then only under-estimates.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from cortex.gateway.matching import LedgerState, MatchAnswer

__all__ = ["HotCache", "HotCacheStats"]

CacheKey = tuple[str, int, int]  # (domain id, query blocks, last key)


@dataclass(slots=True)
class HotCacheStats:
    hits: int = 0
    misses: int = 0
    stale: int = 0
    invalidated: int = 0
    resets: int = 0


class HotCache:
    """Bounded LRU of :class:`MatchAnswer` with a staleness bound (ms) and invalidation by
    source. Pure and synchronous; the clock (seconds) is injectable for tests."""

    def __init__(
        self,
        max_entries: int,
        staleness_ms: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_entries = max_entries
        self.staleness_s = staleness_ms / 1000.0
        self.stats = HotCacheStats()
        self._clock = clock
        self._entries: OrderedDict[CacheKey, tuple[float, MatchAnswer]] = OrderedDict()
        # worker id -> keys of entries that credit (or report READY for) it
        self._by_worker: dict[str, set[CacheKey]] = {}
        self.enabled = max_entries > 0 and staleness_ms > 0

    @staticmethod
    def key(domain_id: str, keys: list[int]) -> CacheKey | None:
        return (domain_id, len(keys), keys[-1]) if keys else None

    def get(self, key: CacheKey) -> MatchAnswer | None:
        """A fresh answer for exactly this query, or ``None``."""
        if not self.enabled:
            return None
        entry = self._entries.get(key)
        if entry is None:
            self.stats.misses += 1
            return None
        stored_at, answer = entry
        if self._clock() - stored_at > self.staleness_s:
            self.stats.stale += 1
            self._drop(key)
            return None
        self.stats.hits += 1
        return answer

    def put(self, key: CacheKey, answer: MatchAnswer) -> None:
        if not self.enabled:
            return
        if key in self._entries:
            self._drop(key)
        self._entries[key] = (self._clock(), answer)
        for src in answer.sources:
            if src.state is LedgerState.READY:
                self._by_worker.setdefault(src.worker_id, set()).add(key)
        while len(self._entries) > self.max_entries:
            self._drop(next(iter(self._entries)))

    def invalidate_workers(self, worker_ids: Iterable[str]) -> int:
        """Drop every answer that gave any of these workers READY credit; returns how many."""
        dropped = 0
        for worker_id in worker_ids:
            for key in self._by_worker.pop(worker_id, ()):
                if key in self._entries:
                    self._drop(key)
                    dropped += 1
        self.stats.invalidated += dropped
        return dropped

    def clear(self) -> None:
        """Forget everything (the change feed was lost or reset)."""
        self._entries.clear()
        self._by_worker.clear()
        self.stats.resets += 1

    def _drop(self, key: CacheKey) -> None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return
        for src in entry[1].sources:
            keys = self._by_worker.get(src.worker_id)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self._by_worker[src.worker_id]

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return (
            f"HotCache(entries={len(self._entries)}/{self.max_entries},"
            f" staleness_ms={self.staleness_s * 1000:g}, hits={self.stats.hits},"
            f" misses={self.stats.misses})"
        )
