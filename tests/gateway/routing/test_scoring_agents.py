"""Scoring with session hints, paced-agent load and KV occupancy (pure)."""

from __future__ import annotations

import pytest

from cortex.gateway.config.gateway import RoutingWeights
from cortex.gateway.routing.scoring import (
    Candidate,
    MatchMode,
    Reason,
    busy,
    decide,
    kv_pressure,
)
from cortex.ledger.model import LedgerState

W = RoutingWeights(alpha=1.0, beta=64.0, gamma=128.0)
READY = LedgerState.READY


def cand(worker: str, **kw: object) -> Candidate:
    base: dict[str, object] = {"engine_running": 0, "engine_waiting": 0, "ledger": READY}
    base.update(kw)
    return Candidate(worker, **base)  # type: ignore[arg-type]


# ---- the hint rule ----


def test_the_ledgers_longer_exact_hit_wins_over_the_session_hint() -> None:
    d = decide([cand("home", session=True, session_tokens=1024, index_tokens=1024),
                cand("other", index_tokens=2048)], W)
    assert (d.mode, d.reason, d.chosen.worker_id, d.hit_tokens) == (
        MatchMode.EXACT_KV, Reason.HIT, "other", 2048)


def test_the_hint_breaks_a_tie_between_equal_hits() -> None:
    for order in (["a", "b"], ["b", "a"]):
        cands = {"a": cand("a", index_tokens=512, session=True), "b": cand("b", index_tokens=512)}
        d = decide([cands[w] for w in order], W, turn=1)
        assert (d.chosen.worker_id, d.reason) == ("a", Reason.HIT)


def test_the_hint_breaks_a_load_tie_without_credit_before_the_prefix_hash() -> None:
    for key in range(20):
        d = decide([cand("a"), cand("b", session=True), cand("c")], W, prefix_key=key,
                   tie_tolerance=1.0)
        assert (d.mode, d.reason, d.chosen.worker_id) == (
            MatchMode.LOAD_AWARE, Reason.SESSION_HINT, "b")


def test_the_session_credit_keeps_the_next_turn_home_before_the_ledger_sees_it() -> None:
    # the ledger saw only the shared system prompt everywhere; the session's last turn
    # (3,072 tokens) went to "home" and its blocks are not in the ledger yet
    home = cand("home", index_tokens=1024, session=True, session_tokens=3072, inflight=1)
    other = cand("other", index_tokens=1024)
    d = decide([other, home], W)
    assert (d.mode, d.reason, d.chosen.worker_id, d.hit_tokens) == (
        MatchMode.EXACT_KV, Reason.SESSION_HIT, "home", 3072)


def test_the_session_credit_is_bounded_by_load_like_every_credit() -> None:
    home = cand("home", session=True, session_tokens=3072, inflight=8, high_watermark=8)
    d = decide([home, cand("idle")], W)
    assert d.chosen.worker_id == "idle"
    assert d.ranked[1].note == Reason.OVER_WATERMARK.value
    # and weighed against load: 3,072 tokens do not outweigh 60 running requests
    d = decide([cand("home", session=True, session_tokens=3072, inflight=60), cand("idle")], W)
    assert (d.chosen.worker_id, d.reason) == ("idle", Reason.LOAD_OUTWEIGHS_HIT)


def test_a_session_credit_is_no_credit_on_a_ledger_that_is_not_ready() -> None:
    home = cand("home", session=True, session_tokens=3072, ledger=LedgerState.STALE)
    d = decide([home, cand("other")], W, prefix_key=7, tie_tolerance=1.0)
    assert d.hit_tokens == 0 and d.mode is MatchMode.LOAD_AWARE


# ---- paced agents ----


def test_live_sessions_keep_a_worker_from_reading_idle_between_turns() -> None:
    # both hold the shared system prompt; "a" is home to 6 live sessions that run nothing now
    a = cand("a", index_tokens=256, sessions=6)
    b = cand("b", index_tokens=256)
    d = decide([a, b], W)
    assert d.chosen.worker_id == "b"
    assert busy(a, W) == 6.0 and busy(cand("x", inflight=9, sessions=6), W) == 9.0
    off = RoutingWeights(alpha=1.0, beta=64.0, gamma=128.0, session=0.0)
    assert decide([a, b], off).chosen.worker_id == "a"  # ties go to the first: the old reading


def test_live_sessions_do_not_count_toward_the_high_watermark() -> None:
    # the watermark sheds running requests; a worker home to many idle sessions keeps the
    # credit of its own session's next turn
    home = cand("home", session=True, session_tokens=4096, sessions=10, high_watermark=8)
    d = decide([home, cand("idle")], W)
    assert (d.chosen.worker_id, d.reason) == ("home", Reason.SESSION_HIT)


def test_a_new_prefix_spreads_when_the_shared_prompts_holder_is_home_to_many_sessions() -> None:
    # 256 tokens of shared system prompt are worth 4 running requests at beta 64
    holder = cand("holder", index_tokens=256, sessions=5)
    d = decide([holder, cand("empty")], W, prefix_key=3, tie_tolerance=1.0)
    assert d.chosen.worker_id == "empty"
    holder = cand("holder", index_tokens=256, sessions=3)
    assert decide([holder, cand("empty")], W).chosen.worker_id == "holder"


# ---- KV occupancy ----


@pytest.mark.parametrize(("blocks", "capacity", "knee", "expected"), [
    (0, 1024, 0.9, 0.0), (921, 1024, 0.9, 0.0), (1024, 1024, 0.9, 1.0),
    (2000, 1024, 0.9, 1.0), (972, 1024, 0.9, pytest.approx(0.4921875)),
    (500, None, 0.9, 0.0), (500, 0, 0.9, 0.0), (1023, 1024, 1.0, 0.0), (1024, 1024, 1.0, 1.0),
])
def test_kv_pressure(blocks: int, capacity: int | None, knee: float, expected: float) -> None:
    assert kv_pressure(blocks, capacity, knee) == expected


def test_a_full_evicting_pool_is_a_worse_home_for_a_new_prefix_than_free_blocks() -> None:
    # sequential traffic, nothing cached anywhere: the hash would pick one; the full one loses
    full = cand("full", kv_pressure=1.0)
    free = cand("free")
    for key in range(20):
        d = decide([full, free], W, prefix_key=key, tie_tolerance=1.0, prompt_tokens=2048)
        assert d.chosen.worker_id == "free"
    # without the prompt's length (or with the weight off) the term is off
    chosen = {decide([full, free], W, prefix_key=k, tie_tolerance=1.0).chosen.worker_id
              for k in range(20)}
    assert chosen == {"full", "free"}


def test_a_full_pool_keeps_a_prompt_it_mostly_holds() -> None:
    # it holds 3,584 of 4,096 tokens: only 512 would be stored (and evict)
    full = cand("full", kv_pressure=1.0, index_tokens=3584)
    free = cand("free", index_tokens=1024)
    d = decide([full, free], W, prompt_tokens=4096)
    assert (d.chosen.worker_id, d.hit_tokens) == ("full", 3584)
    # but a shared system prompt is not worth evicting for a long new conversation
    full = cand("full", kv_pressure=1.0, index_tokens=1024)
    d = decide([full, cand("free")], W, prompt_tokens=4096)
    assert (d.chosen.worker_id, d.reason) == ("free", Reason.LOAD_OUTWEIGHS_HIT)


def test_a_new_session_weighs_the_sessions_living_on_a_worker_as_its_home() -> None:
    # a 1,250-token agent prompt is held by "a", home to 3 live sessions; "b" holds nothing
    a, b = cand("a", index_tokens=1250, sessions=3), cand("b")
    assert decide([a, b], W).chosen.worker_id == "a"  # a turn without a new session
    d = decide([a, b], W, prefix_key=5, tie_tolerance=1.0, new_session=True)
    assert d.chosen.worker_id == "b"  # 3 x 8 x 64 = 1,536 > 1,250
    assert busy(a, W, new_session=True) == 24.0


def test_a_little_kv_pressure_is_not_undone_by_the_tie_band() -> None:
    # 0.1 x 300 uncached tokens = 30 < one active request (64): yet never a tie
    a, b = cand("a", kv_pressure=0.1), cand("b")
    for key in range(20):
        d = decide([a, b], W, prefix_key=key, tie_tolerance=1.0, prompt_tokens=300)
        assert d.chosen.worker_id == "b"
