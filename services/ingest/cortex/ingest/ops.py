"""Ledger operations the per-source tracker emits, before they get an (epoch, seq) and a wire
encoding per index replica.

``Reset`` starts a new epoch (an empty snapshot with a state); ``Clear`` empties the ledger
inside the current epoch (the engine's own ``AllBlocksCleared``: the event stream stays
continuous, so no epoch change is needed).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import NamedTuple

from cortex.hashing import HashDomain

__all__ = [
    "Clear",
    "Drop",
    "LedgerState",
    "Op",
    "Remove",
    "Reset",
    "SetState",
    "SnapshotView",
    "SourceId",
    "Store",
]


class LedgerState(IntEnum):
    """A source's ledger state; values equal ``cortex.index.v1.LedgerState``.

    Only ``READY`` sources get exact-KV credit from routers.
    """

    UNSPECIFIED = 0
    SYNCING = 1  # connected, history not confirmed yet
    READY = 2  # every event applied in order
    STALE = 3  # a gap is being repaired
    REMOVED = 4  # lease lost; blocks pruned
    MISALIGNED = 5  # block size disagrees with the domain config: no exact routing


class SourceId(NamedTuple):
    """One ledger source: a worker's data-parallel rank."""

    worker_id: str
    dp_rank: int = 0

    def __str__(self) -> str:
        return f"{self.worker_id}#{self.dp_rank}"


@dataclass(frozen=True, slots=True)
class Store:
    """The source now holds ``keys``: consecutive blocks chained after ``parent_key``."""

    parent_key: int
    keys: list[int]


@dataclass(frozen=True, slots=True)
class Remove:
    """The source no longer holds ``keys``."""

    keys: list[int]


@dataclass(frozen=True, slots=True)
class Clear:
    """The ledger is empty now (same epoch)."""

    reason: str


@dataclass(frozen=True, slots=True)
class SetState:
    state: LedgerState
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Reset:
    """A new epoch begins with an empty ledger in ``state``."""

    state: LedgerState
    reason: str


@dataclass(frozen=True, slots=True)
class Drop:
    """The source is gone (lease lost, worker removed): prune it."""

    reason: str


Op = Store | Remove | Clear | SetState | Reset | Drop


@dataclass(frozen=True, slots=True)
class SnapshotView:
    """A source's whole ledger at one instant: ``(parent_keys[i], keys[i])`` parents-first."""

    domain: HashDomain
    parent_keys: list[int]
    keys: list[int]
    state: LedgerState
    reason: str
