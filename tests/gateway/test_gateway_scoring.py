"""The scoring function and the degrade chain (pure)."""

from __future__ import annotations

import random

import pytest

from cortex.gateway.config import RoutingWeights
from cortex.gateway.matching import LedgerState, MatchAnswer, SourceMatch
from cortex.gateway.scoring import Candidate, MatchMode, Reason, decide

W = RoutingWeights(alpha=1.0, beta=64.0, gamma=128.0)
READY = LedgerState.READY


def cand(worker: str, **kw: object) -> Candidate:
    base: dict[str, object] = {"engine_running": 0, "engine_waiting": 0, "ledger": READY}
    base.update(kw)
    return Candidate(worker, **base)  # type: ignore[arg-type]


def test_longest_ready_prefix_wins_with_exact_kv() -> None:
    d = decide([cand("a", index_tokens=64), cand("b", index_tokens=512), cand("c")], W)
    assert (d.mode, d.reason, d.chosen.worker_id, d.hit_tokens) == (
        MatchMode.EXACT_KV, Reason.HIT, "b", 512)
    assert [s.worker_id for s in d.ranked] == ["b", "a", "c"]


def test_only_ready_ledgers_get_credit() -> None:
    d = decide([cand("a", index_tokens=512, ledger=LedgerState.STALE), cand("b")], W)
    assert d.mode is MatchMode.LOAD_AWARE
    assert d.ranked[[s.worker_id for s in d.ranked].index("a")].note == "ledger_stale"
    d = decide([cand("a", index_tokens=512, ledger=LedgerState.SYNCING)], W)
    assert (d.mode, d.reason, d.hit_tokens) == (MatchMode.LOAD_AWARE, Reason.NO_READY_LEDGER, 0)


def test_over_watermark_worker_loses_credit_only_for_itself() -> None:
    hot = cand("hot", index_tokens=4096, inflight=8, high_watermark=8)
    warm = cand("warm", index_tokens=1024, inflight=1)
    cold = cand("cold")
    d = decide([hot, warm, cold], W)
    assert (d.mode, d.chosen.worker_id, d.hit_tokens) == (MatchMode.EXACT_KV, "warm", 1024)
    d = decide([hot, cold], W)
    assert (d.mode, d.reason, d.chosen.worker_id) == (
        MatchMode.LOAD_AWARE, Reason.OVER_WATERMARK, "cold")


def test_load_can_outweigh_a_small_hit() -> None:
    d = decide([cand("a", index_tokens=32, inflight=3), cand("b")], W)
    assert (d.mode, d.reason, d.chosen.worker_id) == (
        MatchMode.LOAD_AWARE, Reason.LOAD_OUTWEIGHS_HIT, "b")


def test_predicted_blocks_count_as_a_hit() -> None:
    d = decide([cand("a", predicted_tokens=256), cand("b", index_tokens=128)], W)
    assert (d.mode, d.reason, d.chosen.worker_id) == (
        MatchMode.EXACT_KV, Reason.PREDICTED_HIT, "a")


def test_index_down_degrades_by_load_completeness() -> None:
    off = Reason.INDEX_UNAVAILABLE
    full = [cand("a", index_tokens=999, engine_running=5), cand("b", engine_running=1)]
    d = decide(full, W, cache_off=off)
    assert (d.mode, d.reason, d.chosen.worker_id, d.hit_tokens) == (
        MatchMode.LOAD_AWARE, off, "b", 0)
    partial = [cand("a", engine_waiting=None), cand("b")]
    d = decide(partial, W, cache_off=off, rng=random.Random(1))
    assert (d.mode, d.reason) == (MatchMode.P2C, off)
    unknown = [cand(w, engine_running=None, engine_waiting=None) for w in "abc"]
    picks = {decide(unknown, W, cache_off=off, turn=t).chosen.worker_id for t in range(3)}
    assert picks == {"a", "b", "c"}
    assert decide(unknown, W, cache_off=off).mode is MatchMode.ROUND_ROBIN


def test_p2c_prefers_the_lighter_of_two() -> None:
    workers = [cand("busy", inflight=10, engine_waiting=None), cand("idle")]
    for seed in range(10):
        d = decide(workers, W, cache_off=Reason.INDEX_UNAVAILABLE, rng=random.Random(seed))
        assert d.chosen.worker_id == "idle"


def test_round_robin_skips_workers_over_watermark() -> None:
    unknown = [cand("a", engine_waiting=None, inflight=4, high_watermark=4),
               cand("b", engine_waiting=None)]
    for turn in range(4):
        d = decide(unknown, W, cache_off=Reason.SHORT_PROMPT, turn=turn)
        assert d.chosen.worker_id == "b"


def test_ties_rotate_with_turn() -> None:
    workers = [cand(w) for w in "abc"]
    assert {decide(workers, W, turn=t).chosen.worker_id for t in range(3)} == {"a", "b", "c"}


def test_blocked_credit_is_reported() -> None:
    d = decide([cand("a", index_tokens=64, credit_blocked="block_size_mismatch")], W)
    assert d.hit_tokens == 0 and d.chosen.note == "block_size_mismatch"


def test_no_candidates_is_a_programming_error() -> None:
    with pytest.raises(ValueError):
        decide([], W)


def test_match_answer_folds_dp_ranks() -> None:
    answer = MatchAnswer((
        SourceMatch("a", 0, 3, READY),
        SourceMatch("a", 1, 7, READY),
        SourceMatch("b", 0, 9, LedgerState.STALE),
        SourceMatch("b", 1, 2, READY),
    ), index_version=5, query_blocks=10)
    folded = answer.per_worker()
    assert (folded["a"].ready_blocks, folded["a"].dp_rank) == (7, 1)
    assert (folded["b"].ready_blocks, folded["b"].state) == (2, READY)
