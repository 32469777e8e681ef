"""The Cortex ledger: who holds which KV block, as index and gateways share it.

- :mod:`cortex.ledger.model`: sources, ledger states and the ingest → index update vocabulary;
- :mod:`cortex.ledger.tree`: the compact radix hash tree of one hash domain;
- :mod:`cortex.ledger.view`: what routers see (trees per domain, source states, Match) and
  the journal of its changes;
- :mod:`cortex.ledger.codec`: the one protobuf translation (``cortex.index.v1`` messages);
- :mod:`cortex.ledger.replica`: the replica stream, sent by the index and applied by gateways.
"""

from cortex.ledger.errors import InvalidArgument
from cortex.ledger.match import Match, SourceMatch
from cortex.ledger.model import (
    INGEST_LOST,
    ClearBlocks,
    LedgerState,
    LedgerUpdate,
    Op,
    RemoveBlocks,
    RemoveSource,
    SetState,
    Snapshot,
    Source,
    StoreBlocks,
    Tier,
    domain_label,
)
from cortex.ledger.replica import LedgerReplica, OutOfSync, ReplicaChanges, ReplicaState
from cortex.ledger.tree import RadixHashTree, node_bytes
from cortex.ledger.view import LedgerView, Place, ViewOp

__all__ = [
    "INGEST_LOST",
    "ClearBlocks",
    "InvalidArgument",
    "LedgerReplica",
    "LedgerState",
    "LedgerUpdate",
    "LedgerView",
    "Match",
    "Op",
    "OutOfSync",
    "Place",
    "RadixHashTree",
    "RemoveBlocks",
    "RemoveSource",
    "ReplicaChanges",
    "ReplicaState",
    "SetState",
    "Snapshot",
    "Source",
    "SourceMatch",
    "StoreBlocks",
    "Tier",
    "ViewOp",
    "domain_label",
    "node_bytes",
]
