"""What the per-source tracker hands the forwarders besides its ops, which are the ledger
library's update vocabulary (:mod:`cortex.ledger.model`): ``StoreBlocks``, ``RemoveBlocks``,
``ClearBlocks`` (the engine's own ``AllBlocksCleared``: same epoch), ``SetState``, an empty
``Snapshot`` (a new epoch begins with an empty ledger in its state) and ``RemoveSource``.
The forwarders stamp them with an ``(epoch, seq)`` per index replica.
"""

from __future__ import annotations

from dataclasses import dataclass

from cortex.hashing import HashDomain
from cortex.ledger.model import LedgerState, Source

__all__ = ["SnapshotView", "SourceId"]

SourceId = Source
"""One ledger source: a worker's data-parallel rank (the ledger library's :class:`Source`)."""


@dataclass(frozen=True, slots=True)
class SnapshotView:
    """A source's whole ledger at one instant: ``(parent_keys[i], keys[i])`` parents-first."""

    domain: HashDomain
    parent_keys: list[int]
    keys: list[int]
    state: LedgerState
    reason: str
