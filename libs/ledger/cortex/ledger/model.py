"""Value types of the ledger: sources, ledger states and the ingest → index updates.

These are the socket-free twins of the ``cortex.index.v1`` messages;
:mod:`cortex.ledger.codec` translates at the gRPC boundary. Hash domains are
:class:`cortex.hashing.HashDomain` (model + block size + engine kind), which is hashable and
so keys the per-domain trees.
"""

from __future__ import annotations

from collections.abc import MutableSequence
from dataclasses import dataclass
from enum import IntEnum
from typing import NamedTuple

from cortex.hashing import HashDomain

__all__ = [
    "INGEST_LOST",
    "ClearBlocks",
    "KeyList",
    "LedgerState",
    "LedgerUpdate",
    "Op",
    "RemoveBlocks",
    "RemoveSource",
    "SetState",
    "Snapshot",
    "Source",
    "StoreBlocks",
    "Tier",
    "domain_label",
]


class LedgerState(IntEnum):
    """A source's ledger state; values equal ``cortex.index.v1.LedgerState``.

    Only ``READY`` sources get exact-KV credit from routers.
    """

    UNSPECIFIED = 0
    SYNCING = 1
    READY = 2
    STALE = 3
    REMOVED = 4
    MISALIGNED = 5

    @property
    def label(self) -> str:
        """Lower-case name for JSON, logs and metric labels (``unknown`` for UNSPECIFIED)."""
        return "unknown" if self is LedgerState.UNSPECIFIED else self.name.lower()


INGEST_LOST = "ingest_lost"
"""The reason a source reports ``SYNCING`` after its ingest went silent for the grace."""


class Tier(IntEnum):
    """The memory tier of a source's blocks; values equal ``cortex.index.v1.Tier``.

    Ordered by the cost of a hit: a device block is used in place, a host block is copied
    back over PCIe, a disk block is read first. ``SHARED`` is an external pool every worker
    of the cluster reads (SGLang's ``EXTERNAL``): it favours no worker.
    """

    DEVICE = 0
    HOST = 1
    DISK = 2
    SHARED = 3

    @property
    def label(self) -> str:
        """Lower-case name for JSON, logs and metric labels."""
        return self.name.lower()


class Source(NamedTuple):
    """One ledger source: a worker's data-parallel rank, in one memory tier.

    Each tier is its own source (its own holder bit, its own ``(epoch, seq)``), so a
    ``BlockRemoved`` of one medium removes from that tier only.
    """

    worker_id: str
    dp_rank: int = 0
    tier: Tier = Tier.DEVICE

    def __str__(self) -> str:
        base = f"{self.worker_id}#{self.dp_rank}"
        return base if self.tier is Tier.DEVICE else f"{base}@{self.tier.label}"

    def in_tier(self, tier: Tier) -> Source:
        """The same worker rank's source in ``tier``."""
        return Source(self.worker_id, self.dp_rank, tier)


KeyList = MutableSequence[int]
"""Block keys of an update: a ``list`` where they are made (ingest), an ``array('Q')`` where
they are decoded from the wire (the index: one copy of the packed bytes, no int object per
block; the compiled tree core reads it in place)."""


def domain_label(domain: HashDomain) -> str:
    """``model/block_size/engine``: the domain's name in logs and metric labels."""
    return f"{domain.model}/{domain.block_size}/{domain.engine.value}"


@dataclass(frozen=True, slots=True)
class StoreBlocks:
    """The source now holds ``keys``, a chain of consecutive blocks after ``parent_key``."""

    parent_key: int
    keys: KeyList


@dataclass(frozen=True, slots=True)
class RemoveBlocks:
    """The source no longer holds ``keys`` (no subtree removal implied)."""

    keys: KeyList


@dataclass(frozen=True, slots=True)
class ClearBlocks:
    """The source holds nothing any more (engine cache reset, unrepaired gap, ...)."""

    reason: str = ""


@dataclass(frozen=True, slots=True)
class SetState:
    """The source's ledger state changed at ingest (``REMOVED`` prunes it like RemoveSource)."""

    state: LedgerState
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The source's full ledger: ``(parent_keys[i], keys[i])`` pairs listed parents-first.

    Replaces whatever the index held for the source and starts (or replaces) an epoch.
    """

    parent_keys: KeyList
    keys: KeyList
    state: LedgerState = LedgerState.READY
    reason: str = ""


@dataclass(frozen=True, slots=True)
class RemoveSource:
    """The source is gone (lease lost): prune it everywhere."""

    reason: str = ""


Op = StoreBlocks | RemoveBlocks | ClearBlocks | SetState | Snapshot | RemoveSource


@dataclass(frozen=True, slots=True)
class LedgerUpdate:
    """One ordered update of one source: ``(epoch, seq)`` grows by one seq per update."""

    source: Source
    domain: HashDomain
    epoch: int
    seq: int
    op: Op
