"""Which ingest owns each source, and whether that ingest is still heard from (pure).

An ingest (named by ``UpdateBatch.ingest_id``) *owns* the sources whose updates it last got
applied. It is *heard* whenever a batch of it arrives (an idle ingest sends empty heartbeat
batches) and when one of its Sync streams ends. An ingest not heard for ``grace_s`` seconds
is *lost*: nobody keeps its sources' ledgers true any more, so the index stops giving them
exact-KV credit (:meth:`PrefixIndex.expire_ingests`) until a snapshot re-establishes each.
A restart or reconnect within the grace changes nothing.

Times are monotonic seconds supplied by the caller.
"""

from __future__ import annotations

from collections.abc import Iterator

from cortex.ledger.model import Source

__all__ = ["SourceOwners"]


class SourceOwners:
    """Owner of every claimed source and the last time each ingest was heard.

    ``grace_s`` 0 disables expiry (ownership is still tracked). An ingest is listed by
    :meth:`expire` once per loss; hearing from it again (:meth:`heard`) returns the sources
    it lost, so they can be asked for snapshots.
    """

    def __init__(self, grace_s: float) -> None:
        if grace_s < 0:
            raise ValueError(f"grace_s must be >= 0, got {grace_s}")
        self.grace_s = grace_s
        self._owner: dict[Source, str] = {}
        self._owned: dict[str, set[Source]] = {}
        self._heard: dict[str, float] = {}
        self._lost: set[str] = set()
        self.lost_ingests = 0
        """Ingests found silent for longer than the grace, since start."""
        self.lost_sources = 0
        """Sources whose owner was lost, since start."""

    def __repr__(self) -> str:
        return (
            f"SourceOwners(grace_s={self.grace_s}, ingests={len(self._heard)}, "
            f"lost={sorted(self._lost)}, sources={len(self._owner)})"
        )

    def __iter__(self) -> Iterator[tuple[str, bool, int]]:
        """``(ingest_id, lost, owned sources)`` of every known ingest."""
        for ingest_id in self._heard:
            yield ingest_id, ingest_id in self._lost, len(self._owned.get(ingest_id, ()))

    def owner(self, source: Source) -> str | None:
        return self._owner.get(source)

    def is_lost(self, ingest_id: str) -> bool:
        return ingest_id in self._lost

    def heard(self, ingest_id: str, now_s: float) -> set[Source]:
        """``ingest_id`` is alive at ``now_s``; returns the sources it had lost (empty unless
        it was lost)."""
        self._heard[ingest_id] = now_s
        if ingest_id not in self._lost:
            return set()
        self._lost.discard(ingest_id)
        return set(self._owned.get(ingest_id, ()))

    def claim(self, source: Source, ingest_id: str) -> None:
        """An update of ``source`` from ``ingest_id`` was applied."""
        previous = self._owner.get(source)
        if previous == ingest_id:
            return
        if previous is not None:
            self._disown(source, previous)
        self._owner[source] = ingest_id
        self._owned.setdefault(ingest_id, set()).add(source)

    def release(self, source: Source) -> None:
        """``source`` was removed: nobody owns it."""
        previous = self._owner.pop(source, None)
        if previous is not None:
            self._disown(source, previous)

    def _disown(self, source: Source, ingest_id: str) -> None:
        owned = self._owned.get(ingest_id)
        if owned is not None:
            owned.discard(source)
            if not owned:
                del self._owned[ingest_id]

    def next_deadline(self) -> float | None:
        """When the next live ingest owning sources would be lost (None: never)."""
        if not self.grace_s:
            return None
        deadlines = [
            self._heard[i] + self.grace_s
            for i in self._owned
            if i not in self._lost and i in self._heard
        ]
        return min(deadlines, default=None)

    def expire(self, now_s: float) -> list[tuple[str, list[Source]]]:
        """Ingests owning sources and silent for more than the grace at ``now_s``, newly
        lost, each with its sources. Silent ingests that own nothing are forgotten."""
        if not self.grace_s:
            return []
        out: list[tuple[str, list[Source]]] = []
        for ingest_id, heard in list(self._heard.items()):
            if now_s - heard <= self.grace_s or ingest_id in self._lost:
                continue
            owned = self._owned.get(ingest_id)
            if not owned:
                del self._heard[ingest_id]
                continue
            self._lost.add(ingest_id)
            self.lost_ingests += 1
            self.lost_sources += len(owned)
            out.append((ingest_id, sorted(owned)))
        for ingest_id in [i for i in self._lost if i not in self._owned]:
            self._lost.discard(ingest_id)  # its sources were claimed or removed since
            self._heard.pop(ingest_id, None)
        return out
