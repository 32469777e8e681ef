"""The index's side of ledger replicas: subscribers, their bounded queues, and the fan-out of
the core's journal.

The core journals every change of its :class:`~cortex.ledger.view.LedgerView` while a
replica is subscribed. :meth:`ReplicaHub.flush` takes the journal, encodes it once per
distinct model filter and queues the bytes on every subscriber; each stream then prefixes
its own ``seq`` header (protobuf merges concatenated messages) and sends. Batches that queued
up while a stream was sending go out as one message (up to ``merge_bytes``): merged, their ops
follow each other in order and the last one's ``version`` and ``applied_unix_s`` stand, so a
replica applies what it would have applied batch by batch, with one write and one wake-up
instead of several. A subscriber whose
queue would pass ``max_bytes`` is cut off (``overflowed``): its stream ends and the replica
resyncs from a snapshot, so a slow gateway costs bounded memory and never slows the others.

A new subscriber is added with :meth:`ReplicaHub.subscribe`, which flushes first: changes
applied before the subscription reach it through its snapshot only, later ones through its
queue, never both.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Iterator

from cortex.index.prefix_index import PrefixIndex
from cortex.ledger.codec import pb
from cortex.ledger.replica import journal_bytes, snapshot_batches
from cortex.ledger.view import Journaled

__all__ = ["ReplicaHub", "Subscriber"]


class Subscriber:
    """One replica stream's queue of encoded batches (bytes), bounded by ``max_bytes``."""

    def __init__(self, models: frozenset[str], replica_id: str, max_bytes: int,
                 merge_bytes: int = 1 << 20) -> None:
        self.models = models
        self.replica_id = replica_id
        self.max_bytes = max_bytes
        self.merge_bytes = merge_bytes
        self.merged = 0  # batches sent inside another's message
        self.queued_bytes = 0
        self.overflowed = False
        self.sent = 0
        self._items: deque[bytes] = deque()
        self._ready = asyncio.Event()

    def __repr__(self) -> str:
        return (f"Subscriber(replica_id={self.replica_id!r}, models={sorted(self.models)}, "
                f"queued={len(self._items)}/{self.queued_bytes}B, overflowed={self.overflowed})")

    def put(self, data: bytes) -> None:
        if self.overflowed:
            return
        if self.queued_bytes + len(data) > self.max_bytes:
            self.overflowed = True
            self._items.clear()
            self.queued_bytes = 0
        else:
            self._items.append(data)
            self.queued_bytes += len(data)
        self._ready.set()

    async def get(self, timeout: float) -> bytes | None:
        """The queued batches as one (merged up to ``merge_bytes``; a larger one alone), or
        None after ``timeout`` seconds (or on overflow)."""
        if not self._items and not self.overflowed:
            self._ready.clear()
            try:
                async with asyncio.timeout(timeout):
                    await self._ready.wait()
            except TimeoutError:
                return None
        if not self._items:
            return None
        items = self._items
        data = items.popleft()
        size = len(data)
        if items and size + len(items[0]) <= self.merge_bytes:
            parts = [data]
            while items and size + len(items[0]) <= self.merge_bytes:
                parts.append(items.popleft())
                size += len(parts[-1])
            self.merged += len(parts) - 1
            data = b"".join(parts)
        self.queued_bytes -= size
        return data


class ReplicaHub:
    """Subscribers of one index process and the fan-out of its core's journal."""

    def __init__(self, core: PrefixIndex, index_id: str, *, queue_bytes: int,
                 chunk_bytes: int, wall_clock: Callable[[], float] = time.time) -> None:
        self.core = core
        self.index_id = index_id
        self.queue_bytes = queue_bytes
        self.chunk_bytes = chunk_bytes
        self.subscribers: set[Subscriber] = set()
        self.flushed_ops = 0
        self.flushed_bytes = 0
        self._wall = wall_clock

    def __repr__(self) -> str:
        return f"ReplicaHub(subscribers={len(self.subscribers)}, ops={self.flushed_ops})"

    def subscribe(self, models: frozenset[str], replica_id: str
                  ) -> tuple[Subscriber, Iterator[pb.ReplicaBatch]]:
        """A new subscriber and its snapshot (copied now; numbered by the caller)."""
        self.flush()
        sub = Subscriber(models, replica_id, self.queue_bytes, self.chunk_bytes)
        self.subscribers.add(sub)
        self.core.start_journal()
        batches = snapshot_batches(self.core.view, models, self.index_id, self.core.version,
                                   self.chunk_bytes)
        first = next(batches)  # the columns are copied on the first batch: do it now

        def snapshot() -> Iterator[pb.ReplicaBatch]:
            yield first
            yield from batches

        return sub, snapshot()

    def unsubscribe(self, sub: Subscriber) -> None:
        self.subscribers.discard(sub)
        if not self.subscribers:
            self.core.stop_journal()

    def flush(self) -> int:
        """Queue the journal on every subscriber; returns the records flushed (a run of ops
        the compiled core encoded, :class:`~cortex.ledger.view.WireOps`, counts as one)."""
        journal = self.core.take_journal()
        if not journal or not self.subscribers:
            return 0
        version, now = self.core.version, self._wall()
        encoded: dict[frozenset[str], bytes | None] = {}
        for sub in self.subscribers:
            key = sub.models
            if key not in encoded:
                encoded[key] = _encode(journal, key, self.index_id, version, now)
            data = encoded[key]
            if data is not None:
                sub.put(data)
                self.flushed_bytes += len(data)
        self.flushed_ops += len(journal)
        return len(journal)

    def heartbeat(self) -> bytes:
        """An empty live batch: the stream is alive at the current version."""
        return pb.ReplicaBatch(index_id=self.index_id, version=self.core.version,
                               applied_unix_s=self._wall()).SerializeToString()


def _encode(journal: list[Journaled], models: frozenset[str], index_id: str, version: int,
            now: float) -> bytes | None:
    ops = [op for model, op in journal if not models or model in models]
    if not ops:
        return None
    return journal_bytes(ops, index_id, version, now)


def numbered(seq: int, data: bytes) -> bytes:
    """``data`` (an encoded ReplicaBatch) with its stream ``seq``: protobuf merges
    concatenated messages, so the shared bytes need not be re-encoded per stream."""
    return pb.ReplicaBatch(seq=seq).SerializeToString() + data
