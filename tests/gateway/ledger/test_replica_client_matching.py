"""What routing makes of a ledger match (pure): per worker its best rank, two matches of one
prompt merged."""

from __future__ import annotations

from cortex.gateway.ledger.replica_client import fold_sources, merge_matches
from cortex.ledger.match import Match, SourceMatch
from cortex.ledger.model import LedgerState, Source, Tier

READY = LedgerState.READY


def test_a_match_folds_dp_ranks() -> None:
    answer = Match((
        SourceMatch(Source("a", 0), 3, READY),
        SourceMatch(Source("a", 1), 7, READY),
        SourceMatch(Source("b", 0), 9, LedgerState.STALE),
        SourceMatch(Source("b", 1), 2, READY),
    ), version=5, query_blocks=10)
    folded = fold_sources(answer.sources)
    assert (folded["a"].ready_blocks, folded["a"].dp_rank) == (7, 1)
    assert (folded["b"].ready_blocks, folded["b"].state) == (2, READY)


def test_a_match_folds_tiers_behind_a_ready_device_ledger() -> None:
    answer = Match((
        SourceMatch(Source("a", 0), 2, READY),
        SourceMatch(Source("a", 0, Tier.HOST), 3, READY),
        SourceMatch(Source("a", 0, Tier.DISK), 1, READY),
        SourceMatch(Source("a", 1), 5, READY),  # a rank with a longer device prefix but less in all
        SourceMatch(Source("b", 0), 0, LedgerState.STALE),
        SourceMatch(Source("b", 0, Tier.HOST), 9, READY),  # no credit behind a STALE device ledger
        SourceMatch(Source("c", 0, Tier.SHARED), 9, READY),  # cluster-level: nobody's affinity
    ), version=5, query_blocks=10)
    folded = fold_sources(answer.sources)
    a = folded["a"]
    assert (a.ready_blocks, a.host_blocks, a.disk_blocks, a.dp_rank) == (2, 3, 1, 0)
    assert a.held_blocks == 6
    assert (folded["b"].held_blocks, folded["b"].state) == (0, LedgerState.STALE)
    assert folded["c"].held_blocks == 0 and folded["c"].state is LedgerState.UNSPECIFIED


def test_two_matches_of_one_prompt_merge_per_source_to_the_longer() -> None:
    plain = Match.of([SourceMatch(Source("a"), 3, READY), SourceMatch(Source("b"), 0, READY)],
                     version=5, query_blocks=8)
    lookahead = Match.of([SourceMatch(Source("b"), 6, READY),
                          SourceMatch(Source("c", 0, Tier.SHARED), 2, READY)],
                         version=7, query_blocks=7)
    merged = merge_matches(plain, lookahead)
    assert merged is not None
    assert (merged.version, merged.query_blocks, merged.shared_blocks) == (7, 8, 2)
    assert {(m.worker_id, m.blocks) for m in merged.sources} == {("a", 3), ("b", 6), ("c", 2)}
    assert merge_matches(plain, None) is plain and merge_matches(None, None) is None
