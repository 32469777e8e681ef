"""A ledger match: what a view, a replica and the index answer for one query (pure).

One type from the tree to the router: :meth:`LedgerView.match` gives the
:class:`SourceMatch` of each source, :meth:`LedgerReplica.match` and the index's Match handler
wrap them in a :class:`Match`, :mod:`cortex.ledger.codec` carries a :class:`Match` over gRPC
(``match_to_pb`` / ``match_from_pb``) and the gateway's router reads it unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

from cortex.hashing import HashDomain
from cortex.ledger.model import LedgerState, Source, Tier

__all__ = ["Match", "SourceMatch"]


class SourceMatch(NamedTuple):
    """One source and its state, with the query's blocks it holds: for the device (and
    shared) tier its own leading blocks; for host and disk the blocks it adds after its
    rank's device prefix (:mod:`cortex.ledger.tiers`; 0 when the source is not READY)."""

    source: Source
    blocks: int
    state: LedgerState

    @property
    def worker_id(self) -> str:
        return self.source.worker_id

    @property
    def dp_rank(self) -> int:
        return self.source.dp_rank

    @property
    def tier(self) -> Tier:
        return self.source.tier


def _shared(sources: Iterable[SourceMatch]) -> int:
    # a plain loop over tuple indexes: this runs on every match, per source (~4x a genexpr)
    shared, ready, best = Tier.SHARED, LedgerState.READY, 0
    for source, blocks, state in sources:
        if source[2] is shared and state is ready and blocks > best:
            best = blocks
    return best


@dataclass(frozen=True, slots=True)
class Match:
    """A ledger's answer to one query: every source of the domain (after any candidate
    filter), the ledger version it reflects, how many full blocks the query had, the
    domain that answered (``None``: no domain of the model) and ``shared_blocks``, the
    leading blocks the cluster's shared tier holds (they favour no worker)."""

    sources: tuple[SourceMatch, ...]
    version: int
    query_blocks: int
    domain: HashDomain | None = None
    shared_blocks: int = 0

    @classmethod
    def of(cls, sources: Iterable[SourceMatch], version: int, query_blocks: int,
           domain: HashDomain | None = None, *, shared_tier: bool = True) -> Match:
        """The match of ``sources``, its shared-tier prefix taken from them (``shared_tier``
        False: the caller knows none of them is of the shared tier, so it is 0)."""
        held = tuple(sources)
        return cls(held, version, query_blocks, domain, _shared(held) if shared_tier else 0)

    def blocks_of(self, worker_id: str, dp_rank: int = 0, tier: Tier = Tier.DEVICE) -> int:
        """Matched blocks of one source (0 when absent)."""
        wanted = Source(worker_id, dp_rank, tier)
        return next((m.blocks for m in self.sources if m.source == wanted), 0)

    @property
    def deepest(self) -> int:
        """The most blocks any source holds."""
        return max((m.blocks for m in self.sources), default=0)
