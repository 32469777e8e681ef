"""The change log behind the ``Changes`` feed: a bounded ring of recent optimistic-making
changes, read by subscribers with their own cursor.

Only changes that can make a cached Match answer too optimistic are logged: blocks a source
lost (removed or evicted) and sources that were cleared, removed or left READY. Stores are not
(a stale cache then under-estimates, which routing tolerates). The ring is the only buffer: a
subscriber that falls behind its oldest entry gets a reset instead of unbounded queueing.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from cortex.hashing import HashDomain
from cortex.ledger.model import Source

__all__ = ["Change", "ChangeLog", "ChangeSet"]


@dataclass(frozen=True, slots=True)
class Change:
    """At ``version``, ``source`` lost ``keys`` (``keys is None``: lost everything / READY)."""

    version: int
    domain: HashDomain
    source: Source
    keys: npt.NDArray[np.uint64] | None = None

    @property
    def size(self) -> int:
        """Weight in the ring: removed keys, or 1 for a cleared source."""
        return 1 if self.keys is None else max(1, len(self.keys))


@dataclass(slots=True)
class ChangeSet:
    """One feed message: what changed in ``(from_version, to_version]`` for one domain.

    ``removed`` holds at most one source (its keys), so "these keys were removed from the
    listed source" is exact; ``cleared`` lists sources that were cleared, removed or left
    READY. ``reset``: the subscriber lost track and must drop every cached answer.
    """

    from_version: int
    to_version: int
    domain: HashDomain | None = None
    removed_source: Source | None = None
    removed_keys: list[npt.NDArray[np.uint64]] = field(default_factory=list)
    cleared: list[Source] = field(default_factory=list)
    reset: bool = False

    @property
    def removed_count(self) -> int:
        return sum(len(k) for k in self.removed_keys)

    def keys(self) -> npt.NDArray[np.uint64]:
        """The removed keys as one array."""
        if not self.removed_keys:
            return np.zeros(0, np.uint64)
        return np.concatenate(self.removed_keys)


class ChangeLog:
    """Bounded ring of :class:`Change` records, ordered by version.

    ``floor`` is the highest version whose changes may be missing from the ring (the start
    version, or the version of the last record dropped for space): a reader whose cursor is
    below it must reset. Bounds: ``max_keys`` removed keys and ``max_records`` records.
    """

    def __init__(self, start_version: int, *, max_keys: int = 1 << 20,
                 max_records: int = 1 << 16) -> None:
        if max_keys < 1 or max_records < 1:
            raise ValueError("max_keys and max_records must be >= 1")
        self.max_keys = max_keys
        self.max_records = max_records
        self.floor = start_version
        self._ring: deque[Change] = deque()
        self._weight = 0
        self.dropped = 0
        """Records dropped for space since start."""
        self.appended = 0
        """Records added since start (replica flushes compare it: a loss goes out at once)."""

    def __len__(self) -> int:
        return len(self._ring)

    def __repr__(self) -> str:
        last = self._ring[-1].version if self._ring else self.floor
        return (
            f"ChangeLog(records={len(self._ring)}, weight={self._weight}, floor={self.floor}, "
            f"last={last}, dropped={self.dropped})"
        )

    @property
    def weight(self) -> int:
        return self._weight

    def append(self, change: Change) -> None:
        """Add a record (versions must not decrease); drop the oldest beyond the bounds."""
        self._ring.append(change)
        self._weight += change.size
        self.appended += 1
        while len(self._ring) > 1 and (
            self._weight > self.max_keys or len(self._ring) > self.max_records
        ):
            old = self._ring.popleft()
            self._weight -= old.size
            self.floor = max(self.floor, old.version)
            self.dropped += 1

    def extend(self, changes: Iterable[Change]) -> None:
        for change in changes:
            self.append(change)

    def covers(self, version: int, current: int) -> bool:
        """Whether a reader at ``version`` can catch up to ``current`` without a reset."""
        return self.floor <= version <= current

    def since(
        self, version: int, current: int, *, model: str = "", max_batch_keys: int = 4096
    ) -> list[ChangeSet]:
        """Feed messages covering ``(version, current]`` (empty when nothing to announce).

        A reader outside ``[floor, current]`` gets one reset message up to ``current``.
        Consecutive messages chain: each ``from_version`` is the previous ``to_version``;
        the last one ends at ``current``. ``model`` filters (empty = all).
        """
        if not self.covers(version, current):
            return [ChangeSet(version, current, reset=True)]
        fresh: list[Change] = []
        for change in reversed(self._ring):
            if change.version <= version:
                break
            if not model or change.domain.model == model:
                fresh.append(change)
        if not fresh:
            return []
        fresh.reverse()
        fresh = [piece for change in fresh for piece in _split(change, max_batch_keys)]
        out: list[ChangeSet] = []
        cursor = version
        batch: ChangeSet | None = None
        for change in fresh:
            if batch is not None and not _fits(batch, change, max_batch_keys):
                out.append(batch)
                cursor = batch.to_version
                batch = None
            if batch is None:
                batch = ChangeSet(cursor, change.version, change.domain)
            batch.to_version = change.version
            if change.keys is None:
                if change.source not in batch.cleared:
                    batch.cleared.append(change.source)
            else:
                batch.removed_source = change.source
                batch.removed_keys.append(change.keys)
        assert batch is not None
        batch.to_version = current
        out.append(batch)
        return out


def _fits(batch: ChangeSet, change: Change, max_batch_keys: int) -> bool:
    if change.domain != batch.domain:
        return False
    if change.keys is None:
        return len(batch.cleared) < max_batch_keys
    if batch.removed_source is not None and batch.removed_source != change.source:
        return False
    return batch.removed_count + len(change.keys) <= max_batch_keys or not batch.removed_keys


def _split(change: Change, max_keys: int) -> list[Change]:
    """``change`` in pieces of at most ``max_keys`` keys (one feed message must stay small)."""
    keys = change.keys
    if keys is None or len(keys) <= max_keys:
        return [change]
    return [
        Change(change.version, change.domain, change.source, keys[i : i + max_keys])
        for i in range(0, len(keys), max_keys)
    ]
