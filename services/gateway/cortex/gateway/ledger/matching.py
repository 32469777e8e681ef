"""What the ledger's :class:`~cortex.ledger.match.Match` (from the replica, or the index over
gRPC) means for routing: per worker its best rank, and two matches of one prompt merged."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from cortex.ledger.match import Match, SourceMatch
from cortex.ledger.model import LedgerState, Tier

__all__ = ["WorkerMatch", "fold_sources", "merge_matches"]


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
            rank.device = src.blocks if ready else 0
        elif src.tier is Tier.HOST and ready:
            rank.host = src.blocks
        elif src.tier is Tier.DISK and ready:
            rank.disk = src.blocks
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


def merge_matches(first: Match | None, other: Match | None) -> Match | None:
    """Two answers for key sets of one prompt (plain and lookahead keys): per source, the
    longer match. Exact, because a source holds keys of one set only: under the other set it
    matches nothing."""
    if first is None or other is None:
        return first or other
    best = {(s.worker_id, s.dp_rank): s for s in first.sources}
    for src in other.sources:
        seen = best.get((src.worker_id, src.dp_rank))
        if seen is None or src.blocks > seen.blocks:
            best[(src.worker_id, src.dp_rank)] = src
    return Match(tuple(best.values()), max(first.version, other.version),
                 max(first.query_blocks, other.query_blocks), first.domain,
                 max(first.shared_blocks, other.shared_blocks))
