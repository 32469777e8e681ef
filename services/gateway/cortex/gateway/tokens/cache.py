"""The segment cache: prompt pieces already encoded, bounded by tokens and by bytes.

One per served model, shared by every path that tokenizes for it (routing, answer feeding,
``/tokenize``) and by the threads that encode off the event loop. Ids are kept as packed
``uint32`` arrays (4 bytes per token instead of a list's 36).
"""

from __future__ import annotations

import sys
import threading
from array import array
from collections import OrderedDict
from dataclasses import dataclass

__all__ = ["CacheStats", "SegmentCache", "SegmentKey"]

SegmentKey = tuple[str, bool]
"""A piece of prompt text and whether it starts the text (offset 0 can encode differently)."""

_ENTRY_BYTES = 200
"""Bookkeeping per entry beyond its text and ids (dict slot, key tuple, array header)."""


@dataclass(slots=True)
class CacheStats:
    """Lifetime counters: pieces and tokens served from the cache (hits) or encoded
    (misses), entries evicted."""

    hits: int = 0
    misses: int = 0
    hit_tokens: int = 0
    miss_tokens: int = 0
    evictions: int = 0

    @property
    def token_hit_rate(self) -> float:
        """Share of looked-up tokens served from the cache (0 before any lookup)."""
        total = self.hit_tokens + self.miss_tokens
        return self.hit_tokens / total if total else 0.0


class SegmentCache:
    """LRU of :data:`SegmentKey` → token ids, holding at most ``max_tokens`` tokens and
    about ``max_bytes`` bytes (text, packed ids and bookkeeping). Thread-safe."""

    def __init__(self, max_tokens: int, max_bytes: int = 1 << 62) -> None:
        self.max_tokens = max_tokens
        self.max_bytes = max_bytes
        self.tokens = 0
        self.bytes = 0
        self.stats = CacheStats()
        self._entries: OrderedDict[SegmentKey, array[int]] = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def cost(key: SegmentKey, tokens: int) -> int:
        """Bytes an entry of ``tokens`` ids for ``key`` is charged."""
        return sys.getsizeof(key[0]) + 4 * tokens + _ENTRY_BYTES

    def lookup(self, keys: list[SegmentKey]) -> list[array[int] | None]:
        """The cached ids of each key (``None``: not cached), refreshing the hits."""
        out: list[array[int] | None] = []
        with self._lock:
            entries = self._entries
            get = entries.get
            refresh = entries.move_to_end
            stats = self.stats
            for key in keys:
                ids = get(key)
                if ids is None:
                    stats.misses += 1
                else:
                    refresh(key)
                    stats.hits += 1
                    stats.hit_tokens += len(ids)
                out.append(ids)
        return out

    def get(self, key: SegmentKey) -> array[int] | None:
        return self.lookup([key])[0]

    def put_many(self, items: list[tuple[SegmentKey, list[int]]]) -> None:
        """Store freshly encoded pieces (counted as missed tokens), evicting the least
        recently used entries beyond the bounds."""
        with self._lock:
            entries = self._entries
            stats = self.stats
            for key, ids in items:
                stats.miss_tokens += len(ids)
                cost = self.cost(key, len(ids))
                if len(ids) > self.max_tokens or cost > self.max_bytes or key in entries:
                    continue
                entries[key] = array("I", ids)
                self.tokens += len(ids)
                self.bytes += cost
            while self.tokens > self.max_tokens or self.bytes > self.max_bytes:
                old_key, old = entries.popitem(last=False)
                self.tokens -= len(old)
                self.bytes -= self.cost(old_key, len(old))
                stats.evictions += 1

    def put(self, key: SegmentKey, ids: list[int]) -> None:
        self.put_many([(key, ids)])

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return (f"SegmentCache(segments={len(self._entries)}, tokens={self.tokens}/"
                f"{self.max_tokens}, bytes={self.bytes}/{self.max_bytes}, "
                f"hits={self.stats.hits}, misses={self.stats.misses})")
