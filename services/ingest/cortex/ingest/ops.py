"""Ledger operations the per-source tracker emits, before they get an (epoch, seq) and a wire
encoding per index replica.

``Reset`` starts a new epoch (an empty snapshot with a state); ``Clear`` empties the ledger
inside the current epoch (the engine's own ``AllBlocksCleared``: the event stream stays
continuous, so no epoch change is needed).
"""

from __future__ import annotations

from dataclasses import dataclass

from cortex.hashing import HashDomain
from cortex.ledger.model import LedgerState, Source

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


SourceId = Source
"""One ledger source: a worker's data-parallel rank (the ledger library's :class:`Source`)."""


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
