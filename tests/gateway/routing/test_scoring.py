"""The scoring function and the degrade chain (pure)."""

from __future__ import annotations

import random

import pytest

from cortex.gateway.config.gateway import RoutingWeights
from cortex.gateway.routing.scoring import (
    Candidate,
    MatchMode,
    Reason,
    decide,
    holds_most,
    queue_ahead,
    rendezvous_weight,
)
from cortex.ledger.model import LedgerState

W = RoutingWeights(alpha=1.0, beta=64.0, gamma=128.0, delta=0.0)  # the queue term off
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


def test_a_longer_prefill_queue_than_the_hit_saves_sends_the_request_elsewhere() -> None:
    w = RoutingWeights(alpha=1.0, beta=64.0, gamma=128.0, delta=1.0)
    # the holder saves 2,048 tokens of prefill but 3,000 uncached tokens are queued ahead there
    busy = cand("holder", index_tokens=2048, prefilling=3000, inflight=1)
    idle = cand("idle", inflight=1)
    d = decide([busy, idle], w)
    assert (d.mode, d.reason, d.chosen.worker_id) == (
        MatchMode.LOAD_AWARE, Reason.LOAD_OUTWEIGHS_HIT, "idle")
    # a shorter queue than the saving keeps the affinity
    d = decide([cand("holder", index_tokens=2048, prefilling=1000, inflight=1), idle], w)
    assert (d.mode, d.chosen.worker_id, d.hit_tokens) == (MatchMode.EXACT_KV, "holder", 2048)
    # without credit anywhere the shorter prefill queue wins over equal request counts
    d = decide([cand("a", prefilling=900, inflight=2), cand("b", prefilling=100, inflight=2)], w)
    assert d.chosen.worker_id == "b"
    # delta 0: the queue is ignored
    d = decide([busy, idle], RoutingWeights(alpha=1.0, beta=64.0, gamma=128.0, delta=0.0))
    assert d.chosen.worker_id == "holder"


def test_by_default_a_cached_token_outweighs_two_queued_ones() -> None:
    # delta 0.5 (docs/gateway.md step 5): a hit saves its tokens twice, once for the
    # request's own first token and once as prefill work the cluster does not do; a token
    # queued ahead delays only the request
    w = RoutingWeights()
    assert w.delta == 0.5
    idle = cand("idle", inflight=1)
    d = decide([cand("holder", index_tokens=2048, prefilling=3000, inflight=1), idle], w)
    assert (d.mode, d.chosen.worker_id, d.hit_tokens) == (MatchMode.EXACT_KV, "holder", 2048)
    # real prompt sizes: a 2k-token shared prefix behind two 13k-token prompts is not worth it
    d = decide([cand("holder", index_tokens=2048, prefilling=27_000, inflight=2),
                cand("idle")], w)
    assert (d.mode, d.reason, d.chosen.worker_id) == (
        MatchMode.LOAD_AWARE, Reason.LOAD_OUTWEIGHS_HIT, "idle")


def test_a_worker_holding_most_of_the_prompt_keeps_it_whatever_its_prefill_queue() -> None:
    w = RoutingWeights(delta=0.5)  # the queue counts below a hit of half the prompt
    assert w.delta_hit_share == 0.5
    queued = {"prefilling": 27_000, "inflight": 2}
    # a conversation's next turn: 12k of its 13.6k tokens held, two 13.6k prompts queued
    turn = cand("holder", index_tokens=12_000, **queued)
    d = decide([turn, cand("idle", inflight=2)], w, prompt_tokens=13_600)
    assert (d.mode, d.chosen.worker_id, d.hit_tokens) == (MatchMode.EXACT_KV, "holder", 12_000)
    # a shared 2k prefix of the same prompt: the queue counts, the request goes elsewhere
    shared = cand("holder", index_tokens=2048, **queued)
    d = decide([shared, cand("idle", inflight=2)], w, prompt_tokens=13_600)
    assert d.chosen.worker_id == "idle"
    # share 1.0: no worker is exempt; the prompt's length unknown: none either
    d = decide([turn, cand("idle", inflight=2)],
               RoutingWeights(delta=0.5, delta_hit_share=1.0), prompt_tokens=13_600)
    assert d.chosen.worker_id == "idle"
    assert not holds_most(12_000, 0, 0.5) and holds_most(6_800, 13_600, 0.5)


def test_the_queue_ahead_leaves_out_the_prefix_a_request_is_credited_with_by_prediction(
        ) -> None:
    w = RoutingWeights(delta=1.0)
    # a burst's follower: the first request's 2,048 uncached tokens are queued on the holder,
    # computing the very blocks the follower would have to compute anywhere else
    follower = cand("holder", predicted_tokens=2048, prefilling=2048 + 100, inflight=1)
    assert queue_ahead(follower, 2048) == 100
    d = decide([follower, cand("idle", inflight=1)], w)
    assert (d.mode, d.chosen.worker_id) == (MatchMode.EXACT_KV, "holder")
    # blocks the ledger already holds are computed: the whole queue is someone else's work
    assert queue_ahead(cand("h", index_tokens=2048, prefilling=2148), 2048) == 2148
    assert queue_ahead(cand("h", index_tokens=1024, predicted_tokens=2048, prefilling=2148),
                       2048) == 1124
    # no credit, or a queue shorter than the prediction: never below zero
    assert queue_ahead(cand("h", predicted_tokens=2048, prefilling=500), 0) == 500
    assert queue_ahead(cand("h", predicted_tokens=2048, prefilling=500), 2048) == 0


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




def test_uncredited_load_ties_go_to_the_prefix_hash_whatever_the_order() -> None:
    workers = [cand(w) for w in ("w0", "w1", "w2", "w3")]
    for key in (1, 2**40 + 7, 2**64 - 1):
        want = max(("w0", "w1", "w2", "w3"), key=lambda w: rendezvous_weight(w, key))
        for turn in range(4):  # neither the rotation nor the candidate order matters
            d = decide(workers[turn:] + workers[:turn], W, turn=turn, prefix_key=key)
            assert (d.mode, d.reason, d.chosen.worker_id) == (
                MatchMode.LOAD_AWARE, Reason.PREFIX_HASH, want)
    picks = {decide(workers, W, prefix_key=key).chosen.worker_id for key in range(64)}
    assert picks == {"w0", "w1", "w2", "w3"}  # different prefixes spread


def test_prefix_hash_ties_only_within_the_tolerance_and_under_the_watermark() -> None:
    key = next(k for k in range(100) if rendezvous_weight("a", k) > rendezvous_weight("b", k))
    busier = [cand("a", inflight=2), cand("b", inflight=1)]
    assert decide(busier, W, prefix_key=key, tie_tolerance=1).chosen.worker_id == "a"
    d = decide(busier, W, prefix_key=key, tie_tolerance=0)  # exact ties only
    assert (d.chosen.worker_id, d.reason) == ("b", Reason.NO_HIT)
    d = decide([cand("a", inflight=3), cand("b", inflight=1)], W, prefix_key=key,
               tie_tolerance=1)
    assert (d.chosen.worker_id, d.reason) == ("b", Reason.NO_HIT)
    # an idle worker never ties with a busy one, even one that scores a little better
    d = decide([cand("a", inflight=1), cand("b")], W, prefix_key=key, tie_tolerance=1)
    assert (d.chosen.worker_id, d.reason) == ("b", Reason.NO_HIT)
    filling = [cand("a", inflight=1, kv_pressure=0.5), cand("b", kv_pressure=0.6)]
    d = decide(filling, W, prefix_key=key, tie_tolerance=1, prompt_tokens=1000)
    assert d.ranked[0].score < d.ranked[1].score and d.chosen.worker_id == "b"
    idle = [cand("a", inflight=1), cand("b"), cand("c")]
    for k in range(8):  # among idle ones, the hash as every replica computes it
        hashed = max(("b", "c"), key=lambda w: rendezvous_weight(w, k))
        assert decide(idle, W, prefix_key=k, tie_tolerance=1).chosen.worker_id == hashed
    # a worker at its watermark never wins by hash over one below it: shedding stands
    full = [cand("a", inflight=1, high_watermark=1), cand("b")]
    d = decide(full, W, prefix_key=key, tie_tolerance=5)
    assert d.chosen.worker_id == "b"
    # a hit elsewhere wins over the hash; a degradation keeps its reason
    d = decide([cand("a"), cand("b", predicted_tokens=64)], W, prefix_key=key)
    assert (d.chosen.worker_id, d.reason) == ("b", Reason.PREDICTED_HIT)
    d = decide([cand("a"), cand("b")], W, cache_off=Reason.INDEX_UNAVAILABLE, prefix_key=key)
    assert (d.chosen.worker_id, d.reason) == ("a", Reason.INDEX_UNAVAILABLE)
    # load known only in part: p2c, as the degrade chain says
    partial = [cand("a", engine_waiting=None), cand("b")]
    assert decide(partial, W, prefix_key=key, rng=random.Random(3)).mode is MatchMode.P2C


def test_adding_or_removing_a_worker_moves_only_its_share_of_prefixes() -> None:
    def owners(names: list[str]) -> list[str]:
        workers = [cand(w) for w in names]
        return [decide(workers, W, prefix_key=k).chosen.worker_id for k in range(2000)]

    names = [f"worker-{i}" for i in range(8)]
    before = owners(names)
    after_removal = owners(names[1:])
    moved = [(b, a) for b, a in zip(before, after_removal, strict=True) if b != a]
    assert all(b == "worker-0" for b, _ in moved)  # only the removed worker's prefixes
    assert 2000 / 8 * 0.7 < len(moved) < 2000 / 8 * 1.3
    after_addition = owners([*names, "worker-8"])
    moved = [(b, a) for b, a in zip(before, after_addition, strict=True) if b != a]
    assert all(a == "worker-8" for _, a in moved)  # only to the new worker
    assert 2000 / 9 * 0.7 < len(moved) < 2000 / 9 * 1.3


def test_uncredited_ties_go_to_the_shortest_prefill_queue_then_the_hash() -> None:
    # within one active request of each other, none credited: the prefill queue decides
    tied = [cand("a", inflight=1, prefilling=800), cand("b", inflight=2, prefilling=100),
            cand("c", inflight=1, prefilling=800)]
    d = decide(tied, W, prefix_key=7, tie_tolerance=1.0)
    assert (d.mode, d.reason, d.chosen.worker_id) == (
        MatchMode.LOAD_AWARE, Reason.PREFIX_HASH, "b")
    # equal queues: the rendezvous hash, as every replica would compute it
    idle = [cand(w) for w in ("a", "b", "c")]
    heaviest = max("abc", key=lambda w: rendezvous_weight(w, 7))
    assert decide(idle, W, prefix_key=7, tie_tolerance=1.0).chosen.worker_id == heaviest
    # without a prefix key, equal scores go to the shorter queue too
    short = decide([cand("a", prefilling=50), cand("b")], W)
    assert short.chosen.worker_id == "b"


def test_host_and_disk_hits_are_credited_at_their_weights() -> None:
    """A prefix evicted to host memory still beats recomputing it, by its weight: worker a
    holds 256 device + 512 host tokens (256 + 0.75 * 512 = 640 device-hit units) against
    b's 600 device tokens."""
    a = cand("a", index_tokens=256, host_tokens=512)
    b = cand("b", index_tokens=600)
    d = decide([a, b], W)
    assert (d.mode, d.reason, d.chosen.worker_id, d.hit_tokens) == (
        MatchMode.EXACT_KV, Reason.OFFLOAD_HIT, "a", 768)
    assert d.chosen.credit == 256 + 0.75 * 512
    # disk is worth less: 256 + 0.25 * 512 = 384 < 600
    d = decide([cand("a", index_tokens=256, disk_tokens=512), b], W)
    assert (d.chosen.worker_id, d.reason) == ("b", Reason.HIT)
    # GPU-only crediting (weights 0): tier tokens count for nothing, not even the hit
    gpu_only = RoutingWeights(alpha=1.0, beta=64.0, gamma=128.0, host_hit=0.0, disk_hit=0.0)
    d = decide([a, b], gpu_only)
    assert (d.chosen.worker_id, d.hit_tokens) == ("b", 600)
    assert d.ranked[1].credited_tokens == 256


def test_tier_weights_are_validated() -> None:
    from cortex.gateway.config.gateway import ConfigError
    with pytest.raises(ConfigError, match="host_hit"):
        RoutingWeights(host_hit=1.5)
    with pytest.raises(ConfigError, match="disk_hit"):
        RoutingWeights(disk_hit=-0.1)




def test_gpu_only_crediting_names_no_watermark_for_host_tokens() -> None:
    """With tier weights 0 a host-only holder has nothing creditable: no hit, and the reason
    does not blame a watermark."""
    gpu_only = RoutingWeights(host_hit=0.0, disk_hit=0.0)
    d = decide([cand("a", host_tokens=512), cand("b")], gpu_only, prefix_key=7)
    assert d.mode is MatchMode.LOAD_AWARE and d.reason is Reason.PREFIX_HASH
