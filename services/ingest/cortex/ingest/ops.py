"""What the per-source tracker hands the forwarders besides its ops, which are the ledger
library's update vocabulary (:mod:`cortex.ledger.model`): ``StoreBlocks``, ``RemoveBlocks``,
``ClearBlocks`` (the engine's own ``AllBlocksCleared``: same epoch), ``SetState``, an empty
``Snapshot`` (a new epoch begins with an empty ledger in its state) and ``RemoveSource``.
The forwarders stamp them with an ``(epoch, seq)`` per index replica.
"""

from __future__ import annotations

from dataclasses import dataclass

from cortex.hashing import HashDomain
from cortex.ledger.model import KeyList, LedgerState, Op, RemoveBlocks, Source, StoreBlocks

__all__ = ["SnapshotView", "SourceId", "append_remove", "append_store"]

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


def append_store(ops: list[Op], placed: StoreBlocks) -> None:
    """Append a store to ``ops``, extending the last one when the chain goes on."""
    last = ops[-1] if ops else None
    if type(last) is StoreBlocks and last.keys[-1] == placed.parent_key:
        last.keys.extend(placed.keys)  # the chain goes on: one update, not two
    else:
        ops.append(placed)


def append_remove(ops: list[Op], dead: KeyList) -> None:
    """Append a removal to ``ops``, merged into a removal just before it."""
    last = ops[-1] if ops else None
    if type(last) is RemoveBlocks:
        last.keys.extend(dead)  # vLLM sends one event per block: coalesce
    else:
        ops.append(RemoveBlocks(dead))
