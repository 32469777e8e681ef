"""``SourceQueues``: what one forwarder still has to send, a FIFO per source, served
round-robin (pure, no I/O).

Order matters only within a source (its ``(epoch, seq)`` chain), so each source has its own
queue and :meth:`SourceQueues.pop` takes turns: a source hands out items until it used
``quantum_bytes`` (at least one item), then the next source with work goes. A source with a
long backlog or a large snapshot shares every batch with the others instead of going first.

Each item carries its size in bytes. *Bounded* bytes (live ops) are what the forwarder's
limits apply to; unbounded ones (snapshot parts, removals) are the recovery from a limit
hit, bounded by the ledgers themselves, and are only counted in :attr:`bytes`.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from itertools import repeat
from typing import Generic, TypeVar

from cortex.ingest.ops import SourceId

__all__ = ["SourceQueues"]

T = TypeVar("T")


class _Queue(Generic[T]):
    __slots__ = ("bounded", "items")

    def __init__(self) -> None:
        self.items: deque[tuple[T, int, bool, float]] = deque()  # item, size, bounded, at
        self.bounded = 0  # bytes of bounded items


class SourceQueues(Generic[T]):
    """Per-source FIFOs with byte accounting; ``now`` arguments are monotonic seconds."""

    def __init__(self, quantum_bytes: int) -> None:
        if quantum_bytes < 1:
            raise ValueError(f"quantum_bytes must be >= 1, got {quantum_bytes}")
        self.quantum_bytes = quantum_bytes
        self._ring: OrderedDict[SourceId, _Queue[T]] = OrderedDict()  # sources with items
        self._turn = 0  # bytes the ring's first source used in its current turn
        self.items = 0
        self.bytes = 0  # every queued item
        self.bounded_bytes = 0  # bounded items only
        self.bounded_items = 0

    def __repr__(self) -> str:
        return (
            f"SourceQueues(sources={len(self._ring)}, items={self.items}, bytes={self.bytes},"
            f" bounded={self.bounded_bytes})"
        )

    def __len__(self) -> int:
        return self.items

    def __bool__(self) -> bool:
        return self.items > 0

    def bounded_bytes_of(self, source: SourceId) -> int:
        queue = self._ring.get(source)
        return 0 if queue is None else queue.bounded

    def push(self, source: SourceId, item: T, size: int, now: float, *,
             bounded: bool = True) -> None:
        """Queue ``item`` (``size`` bytes) behind the source's other items."""
        queue = self._ring.get(source)
        if queue is None:
            queue = self._ring[source] = _Queue()
        queue.items.append((item, size, bounded, now))
        self._count(queue, size, bounded, 1)

    def extend(self, source: SourceId, items: Sequence[T], sizes: Sequence[int],
               now: float) -> None:
        """Queue bounded ``items`` (``sizes`` bytes each) behind the source's others."""
        queue = self._ring.get(source)
        if queue is None:
            queue = self._ring[source] = _Queue()
        queue.items.extend(zip(items, sizes, repeat(True), repeat(now)))
        self._count(queue, sum(sizes), True, len(items))

    def pop(self) -> tuple[SourceId, T] | None:
        """The next item in round-robin order, ``None`` when nothing is queued."""
        if not self._ring:
            return None
        source, queue = next(iter(self._ring.items()))
        item, size, bounded, _ = queue.items.popleft()
        self.items -= 1
        self.bytes -= size
        if bounded:
            queue.bounded -= size
            self.bounded_bytes -= size
            self.bounded_items -= 1
        self._turn += size
        if not queue.items:
            del self._ring[source]
            self._turn = 0
        elif self._turn >= self.quantum_bytes:
            self._ring.move_to_end(source)
            self._turn = 0
        return source, item

    def drop(self, source: SourceId) -> int:
        """Forget every item of ``source``; returns how many there were."""
        in_turn = next(iter(self._ring), None) == source
        queue = self._ring.pop(source, None)
        if queue is None:
            return 0
        if in_turn:
            self._turn = 0  # the next source starts its turn afresh
        for _, size, bounded, _ in queue.items:
            self._count(queue, -size, bounded, -1)
        return len(queue.items)

    def largest(self) -> SourceId | None:
        """The source with the most bounded bytes queued (``None``: none has any)."""
        best, most = None, 0
        for source, queue in self._ring.items():
            if queue.bounded > most:
                best, most = source, queue.bounded
        return best

    def oldest(self) -> float | None:
        """When the longest-waiting item was queued (``None`` when empty)."""
        return min((q.items[0][3] for q in self._ring.values()), default=None)

    def clear(self) -> None:
        self._ring.clear()
        self._turn = 0
        self.items = self.bytes = self.bounded_bytes = self.bounded_items = 0

    def _count(self, queue: _Queue[T], size: int, bounded: bool, items: int) -> None:
        self.items += items
        self.bytes += size
        if bounded:
            queue.bounded += size
            self.bounded_bytes += size
            self.bounded_items += items
