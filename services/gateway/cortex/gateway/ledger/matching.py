"""What the ledger (the replica, or the index over gRPC) answered for one query, as plain
values the routing core can use."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from cortex.ledger.model import LedgerState, Tier

__all__ = ["LedgerState", "MatchAnswer", "SourceMatch", "Tier", "WorkerMatch", "merge_answers"]


@dataclass(frozen=True, slots=True)
class SourceMatch:
    """One source (worker, DP rank, tier) and its state: for the device (and shared) tier
    the leading blocks of the query it holds; for host and disk the blocks it adds after
    the rank's device prefix (:mod:`cortex.ledger.tiers`)."""

    worker_id: str
    dp_rank: int
    matched_blocks: int
    state: LedgerState
    tier: Tier = Tier.DEVICE


@dataclass(frozen=True, slots=True)
class WorkerMatch:
    """A worker's best READY rank: its device prefix (``ready_blocks``), the blocks its host
    and disk tiers add after it, the DP rank holding them, and the worker's overall ledger
    state (``READY`` if any rank's device ledger is)."""

    worker_id: str
    ready_blocks: int
    dp_rank: int
    state: LedgerState
    host_blocks: int = 0
    disk_blocks: int = 0

    @property
    def held_blocks(self) -> int:
        """The effective prefix: device, then host and disk."""
        return self.ready_blocks + self.host_blocks + self.disk_blocks


_STATE_RANK = {
    LedgerState.READY: 5,
    LedgerState.STALE: 4,
    LedgerState.SYNCING: 3,
    LedgerState.MISALIGNED: 2,
    LedgerState.REMOVED: 1,
    LedgerState.UNSPECIFIED: 0,
}


@dataclass(frozen=True, slots=True)
class MatchAnswer:
    """The index's answer to one Match: every source of the domain, the ledger version it
    reflects and how many full blocks the query had."""

    sources: tuple[SourceMatch, ...]
    index_version: int
    query_blocks: int

    def per_worker(self) -> dict[str, WorkerMatch]:
        """Sources folded per worker: the longest READY match across its DP ranks."""
        return fold_sources(self.sources)


class _Rank:
    __slots__ = ("device", "disk", "host", "state")

    def __init__(self) -> None:
        self.device = self.host = self.disk = 0
        self.state = LedgerState.UNSPECIFIED


def fold_sources(sources: Iterable[SourceMatch]) -> dict[str, WorkerMatch]:
    """Per worker its best rank (the longest effective READY prefix). Offload tiers count
    only behind a READY device ledger: they continue its prefix. The shared tier credits
    no worker (a cluster-level cache)."""
    ranks: dict[tuple[str, int], _Rank] = {}
    for src in sources:
        rank = ranks.get((src.worker_id, src.dp_rank))
        if rank is None:
            rank = ranks[src.worker_id, src.dp_rank] = _Rank()
        ready = src.state is LedgerState.READY
        if src.tier is Tier.DEVICE:
            rank.state = src.state
            rank.device = src.matched_blocks if ready else 0
        elif src.tier is Tier.HOST and ready:
            rank.host = src.matched_blocks
        elif src.tier is Tier.DISK and ready:
            rank.disk = src.matched_blocks
    out: dict[str, WorkerMatch] = {}
    for (worker_id, dp_rank), rank in ranks.items():
        if rank.state is LedgerState.READY:
            match = WorkerMatch(worker_id, rank.device, dp_rank, rank.state, rank.host,
                                rank.disk)
        else:
            match = WorkerMatch(worker_id, 0, dp_rank, rank.state)
        seen = out.get(worker_id)
        if seen is None:
            out[worker_id] = match
            continue
        state = seen.state if _STATE_RANK[seen.state] >= _STATE_RANK[match.state] else match.state
        best = match if match.held_blocks > seen.held_blocks else seen
        if best is not seen or state is not seen.state:
            out[worker_id] = WorkerMatch(worker_id, best.ready_blocks, best.dp_rank, state,
                                         best.host_blocks, best.disk_blocks)
    return out


def merge_answers(first: MatchAnswer | None, other: MatchAnswer | None) -> MatchAnswer | None:
    """Two answers for key sets of one prompt (plain and lookahead keys): per source, the
    longer match. Exact, because a source holds keys of one set only: under the other set it
    matches nothing."""
    if first is None or other is None:
        return first or other
    best = {(s.worker_id, s.dp_rank): s for s in first.sources}
    for src in other.sources:
        seen = best.get((src.worker_id, src.dp_rank))
        if seen is None or src.matched_blocks > seen.matched_blocks:
            best[(src.worker_id, src.dp_rank)] = src
    return MatchAnswer(tuple(best.values()), max(first.index_version, other.index_version),
                       max(first.query_blocks, other.query_blocks))
