"""What the ledger (the replica, or the index over gRPC) answered for one query, as plain
values the routing core can use."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from cortex.ledger.model import LedgerState

__all__ = ["LedgerState", "MatchAnswer", "SourceMatch", "WorkerMatch", "merge_answers"]


@dataclass(frozen=True, slots=True)
class SourceMatch:
    """One source (worker, DP rank): leading blocks of the query it holds, and its state."""

    worker_id: str
    dp_rank: int
    matched_blocks: int
    state: LedgerState


@dataclass(frozen=True, slots=True)
class WorkerMatch:
    """A worker's best READY source: blocks held (``ready_blocks``), the DP rank holding them,
    and the worker's overall ledger state (``READY`` if any rank is)."""

    worker_id: str
    ready_blocks: int
    dp_rank: int
    state: LedgerState


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


def fold_sources(sources: Iterable[SourceMatch]) -> dict[str, WorkerMatch]:
    out: dict[str, WorkerMatch] = {}
    for src in sources:
        blocks = src.matched_blocks if src.state is LedgerState.READY else 0
        seen = out.get(src.worker_id)
        if seen is None:
            out[src.worker_id] = WorkerMatch(src.worker_id, blocks, src.dp_rank, src.state)
            continue
        state = seen.state if _STATE_RANK[seen.state] >= _STATE_RANK[src.state] else src.state
        if blocks > seen.ready_blocks:
            out[src.worker_id] = WorkerMatch(src.worker_id, blocks, src.dp_rank, state)
        elif state is not seen.state:
            out[src.worker_id] = WorkerMatch(src.worker_id, seen.ready_blocks, seen.dp_rank, state)
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
