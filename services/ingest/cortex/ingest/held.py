"""Event payloads an ingest process holds before applying them, bounded by bytes (pure).

A source holds live batches while a replay repairs a gap (they must follow the replayed
ones) and while it waits for its next turn (see :class:`~cortex.ingest.source.SourceRunner`):
:class:`HeldBatches` is that FIFO, with its payload bytes and the arrival time of each batch.
:class:`HeldBytes` is the process-wide total every source's buffer adds to, with its limit;
who gives up what when a bound is hit is the tracker's and the service's policy.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

__all__ = ["HeldBatch", "HeldBatches", "HeldBytes"]

HeldBatch = tuple[int, bytes, int, float]
"""``(seq, payload, payload digest, arrival time in s)``."""


class HeldBytes:
    """Payload bytes held by all sources of one process, and the limit (``None``: none)."""

    __slots__ = ("limit", "total")

    def __init__(self, limit: int | None = None) -> None:
        if limit is not None and limit < 1:
            raise ValueError(f"limit must be >= 1 byte, got {limit}")
        self.limit = limit
        self.total = 0

    def __repr__(self) -> str:
        return f"HeldBytes(total={self.total}, limit={self.limit})"

    @property
    def over(self) -> bool:
        return self.limit is not None and self.total > self.limit


class HeldBatches:
    """One source's held batches in arrival order; ``bytes`` counts their payloads (and is
    added to ``shared`` as well)."""

    __slots__ = ("_items", "bytes", "shared")

    def __init__(self, shared: HeldBytes | None = None) -> None:
        self._items: deque[HeldBatch] = deque()
        self.bytes = 0
        self.shared = shared

    def __repr__(self) -> str:
        return f"HeldBatches({len(self._items)} batches, {self.bytes} bytes)"

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)

    def __iter__(self) -> Iterator[HeldBatch]:
        return iter(self._items)

    @property
    def last_seq(self) -> int | None:
        return self._items[-1][0] if self._items else None

    @property
    def oldest_arrival(self) -> float | None:
        """Arrival time (s) of the batch held longest, ``None`` when empty."""
        return self._items[0][3] if self._items else None

    def holds(self, seq: int, digest: int) -> bool:
        """Whether this very batch (same seq and payload digest) is held."""
        return any(s == seq and d == digest for s, _, d, _ in self._items)

    def append(self, item: HeldBatch) -> None:
        self._items.append(item)
        self._count(len(item[1]))

    def appendleft(self, item: HeldBatch) -> None:
        self._items.appendleft(item)
        self._count(len(item[1]))

    def popleft(self) -> HeldBatch:
        item = self._items.popleft()
        self._count(-len(item[1]))
        return item

    def clear(self) -> int:
        """Forget every held batch; returns how many there were."""
        dropped = len(self._items)
        self._items.clear()
        self._count(-self.bytes)
        return dropped

    def _count(self, delta: int) -> None:
        self.bytes += delta
        if self.shared is not None:
            self.shared.total += delta
