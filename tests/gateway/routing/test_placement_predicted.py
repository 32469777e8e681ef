"""Hot cache (staleness, invalidation) and predicted blocks (TTL side index)."""

from __future__ import annotations

import random

from cortex.gateway.ledger.replica_client import walk_depth
from cortex.gateway.routing.placement import PredictedBlocks, WalkedPredictions
from cortex.hashing import Engine, HashDomain
from cortex.ledger.match import Match, SourceMatch
from cortex.ledger.model import LedgerState, Source
from cortex.ledger.replica import LedgerReplica

DOMAIN = HashDomain("m", 16, Engine.SGLANG)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def answer(*holders: tuple[str, int]) -> Match:
    return Match(tuple(SourceMatch(Source(w, 0), b, LedgerState.READY) for w, b in holders), 1, 4)


def test_predicted_blocks_credit_leading_chain_until_ttl() -> None:
    clock = Clock()
    pred = PredictedBlocks(ttl_s=2.0, clock=clock)
    pred.credit("a", [10, 11, 12, 13])
    assert pred.match([10, 11, 99]) == {"a": 2}
    assert pred.match([99, 10]) == {}
    pred.credit("b", [10, 11])
    assert pred.match([10, 11, 12]) == {"a": 3, "b": 2}
    clock.now += 2.5
    assert pred.match([10, 11]) == {}
    assert len(pred) == 0


def test_predicted_refresh_outlives_the_older_credit() -> None:
    clock = Clock()
    pred = PredictedBlocks(ttl_s=2.0, clock=clock)
    pred.credit("a", [1, 2, 3])
    clock.now += 1.5
    pred.credit("a", [1, 2])
    clock.now += 1.0  # first credit expired, second still valid
    assert pred.match([1, 2, 3]) == {"a": 2}


def test_predicted_forget_worker_and_keys_and_bound() -> None:
    pred = PredictedBlocks(ttl_s=10.0, max_keys=5, clock=Clock())
    pred.credit("a", [1, 2, 3])
    pred.credit("b", [1, 2, 3])
    pred.forget_worker("a")
    assert pred.match([1, 2, 3]) == {"b": 3}
    pred.forget_keys("b", [2])
    assert pred.match([1, 2, 3]) == {"b": 1}  # consecutive from the first block only
    pred.credit("c", [7, 8, 9])  # over the bound: the oldest credit goes
    assert pred.match([1]) == {}
    assert pred.match([7, 8, 9]) == {"c": 3}


def test_predicted_credit_handles_are_withdrawn_alone() -> None:
    pred = PredictedBlocks(ttl_s=2.0, clock=Clock())
    first = pred.credit("a", [1, 2, 3])
    second = pred.credit("a", [1, 2, 7, 8])
    moved = pred.credit("b", [1, 2, 7, 8])
    assert first is not None and second is not None and moved is not None
    pred.withdraw(second)  # that request moved to b: a keeps what another request credits
    assert pred.match([1, 2, 3]) == {"a": 3, "b": 2}
    assert pred.match([1, 2, 7, 8]) == {"a": 2, "b": 4}
    pred.withdraw(second)  # idempotent
    pred.withdraw(first)
    assert pred.match([1, 2, 7, 8]) == {"b": 4}
    assert len(pred) == 4 and "credits=4" in repr(pred)


def test_predicted_withdrawal_restores_the_newest_older_credit_until_it_expires() -> None:
    clock = Clock()
    pred = PredictedBlocks(ttl_s=2.0, clock=clock)
    pred.credit("a", [1, 2])
    clock.now += 1.0
    older = pred.credit("a", [1, 2, 3])
    clock.now += 0.5
    newest = pred.credit("a", [1, 2, 3, 4])
    assert older is not None and newest is not None
    pred.withdraw(newest)
    assert pred.match([1, 2, 3, 4]) == {"a": 3}
    clock.now += 0.6  # the first credit expired, the restored one still holds [1, 2, 3]
    assert pred.match([1, 2, 3, 4]) == {"a": 3}
    clock.now += 1.0
    assert pred.match([1, 2, 3, 4]) == {} and len(pred) == 0


def test_predicted_withdrawal_never_resurrects_evicted_or_forgotten_blocks() -> None:
    pred = PredictedBlocks(ttl_s=2.0, clock=Clock())
    pred.credit("a", [1, 2, 3])
    pred.forget_keys("a", [3])  # the engine evicted block 3 ...
    again = pred.credit("a", [1, 2, 3])  # ... a new request would compute it again ...
    assert again is not None and pred.match([1, 2, 3]) == {"a": 3}
    pred.withdraw(again)  # ... but failed: the older credit must not bring block 3 back
    assert pred.match([1, 2, 3]) == {}  # under-predicts: never over
    gone = pred.credit("b", [1, 2])
    pred.forget_worker("b")
    assert gone is not None and not gone.live
    pred.withdraw(gone)
    assert pred.match([1, 2]) == {}


def test_predicted_match_is_each_workers_leading_run_of_held_blocks() -> None:
    """Differential: after random credits, withdrawals, evictions and expiries, ``match``
    equals, per worker, the count of leading keys whose holders name that worker."""
    rng = random.Random(7)
    clock = Clock()
    pred = PredictedBlocks(ttl_s=5.0, max_keys=400, clock=clock)
    workers = ["a", "b", "c", "d", "e"]
    live = []
    for _ in range(3000):
        op = rng.random()
        start = rng.randrange(3)
        chain = list(range(start, start + rng.randint(1, 30)))
        if op < 0.55:
            credit = pred.credit(rng.choice(workers), chain)
            if credit is not None:
                live.append(credit)
        elif op < 0.65 and live:
            pred.withdraw(live.pop(rng.randrange(len(live))))
        elif op < 0.72:
            pred.forget_keys(rng.choice(workers), rng.sample(range(35), 3))
        elif op < 0.74:
            pred.forget_worker(rng.choice(workers))
        else:
            clock.now += rng.random() * 0.3
        query = list(range(rng.choice([0, 0, 1]), 36))
        assert pred.match(query) == leading_runs(pred, workers, query)


def leading_runs(pred: PredictedBlocks, workers: list[str], keys: list[int]
                 ) -> dict[str, int]:
    """Per worker, the count of leading ``keys`` whose holders name it, key by key."""
    out = {}
    for worker in workers:
        run = 0
        for key in keys:
            if worker not in pred._holders.get(key, {}):
                break
            run += 1
        if run:
            out[worker] = run
    return out


def test_predicted_match_over_chains_skips_what_a_credit_holds_and_no_more() -> None:
    """Differential over real key chains (a block's key hashes its parent's, so two prompts
    that share a key share every key before it): prompts from a small tree of
    conversations, credited, withdrawn, evicted and expired at random; ``match`` from any
    start equals each worker's leading run counted key by key, including where an eviction
    took keys out of the middle of a credit that later credits cover again."""
    rng = random.Random(23)
    clock = Clock()
    pred = PredictedBlocks(ttl_s=5.0, max_keys=1500, clock=clock)  # the bound pops some
    workers = ["a", "b", "c", "d"]
    tree: dict[tuple[int, int], int] = {}  # (parent key, branch) → key

    def prompt() -> list[int]:
        keys, parent = [], 0
        for _ in range(rng.randint(1, 120)):
            parent = tree.setdefault((parent, rng.choice([0, 0, 0, 0, 1, 2])),
                                     rng.getrandbits(63))
            keys.append(parent)
        return keys

    live = []
    for _ in range(2500):
        op = rng.random()
        if op < 0.5:
            credit = pred.credit(rng.choice(workers), prompt())
            if credit is not None:
                live.append(credit)
        elif op < 0.6 and live:
            pred.withdraw(live.pop(rng.randrange(len(live))))
        elif op < 0.7 and tree:
            pred.forget_keys(rng.choice(workers), rng.sample(sorted(tree.values()), 3))
        elif op < 0.72:
            pred.forget_worker(rng.choice(workers))
        else:
            clock.now += rng.random() * 0.5
        query = prompt()
        start = rng.choice([0, 0, rng.randrange(len(query))])
        assert pred.match(query, start) == leading_runs(pred, workers, query[start:])


def test_a_walks_predictions_answer_as_a_fresh_match_would() -> None:
    """Differential: a walk asks about a growing chain (``walk_depth``), then the decision
    asks about a query of that chain, shorter or longer; between them, sometimes, the
    predictions change (a credit, a withdrawal, an eviction, an expiry). The answer always
    equals ``PredictedBlocks.match`` of the query at that moment, and while nothing changed
    it comes from the walk's runs: no key of the chain is matched twice."""
    rng = random.Random(11)
    clock = Clock()
    pred = PredictedBlocks(ttl_s=5.0, max_keys=400, clock=clock)
    fresh = pred.match
    matched = 0

    def counted(keys: list[int], start: int = 0) -> dict[str, int]:
        nonlocal matched
        matched += len(keys) - start
        return fresh(keys, start)

    pred.match = counted  # type: ignore[method-assign]
    workers = ["a", "b", "c", "d"]
    reused = 0
    for _ in range(1500):
        start = rng.randrange(2)
        credit = pred.credit(rng.choice(workers), list(range(start, start + rng.randint(1, 30))))
        if rng.random() < 0.1:
            clock.now += rng.random()
        walked, matched = WalkedPredictions(pred), 0
        deepest = walk_depth(LedgerReplica(), DOMAIN, pred.match, walked.runs)
        keys = list(range(rng.randint(0, 36)))
        for end in sorted(rng.sample(range(1, 37), rng.randint(0, 3))):
            deepest(keys[:end])
        change = rng.random()
        if change < 0.1 and credit is not None:
            pred.withdraw(credit)
        elif change < 0.2:
            pred.forget_keys(rng.choice(workers), rng.sample(range(36), 3))
        elif change < 0.3:
            clock.now += rng.random() * 2
        query = keys[:rng.randint(0, len(keys))] if rng.random() < 0.5 else keys
        before = pred.version
        got = walked.match(query)
        if change >= 0.3 and pred.version == before:
            reused += 1
            assert matched <= len(keys)  # the walk's keys and the query's new ones, once
        assert got == fresh(query)
    assert reused > 500
