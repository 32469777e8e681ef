"""Pool membership and lease decisions (pure): who stays, who is remembered, who is gone."""

from __future__ import annotations

import pytest

from cortex.gateway.config.gateway import BreakerConfig, ModelConfig
from cortex.gateway.fleet.health import LeaseAction, ProbeResult, lease_action
from cortex.gateway.fleet.pool import Eligible, Health, WorkerPool
from cortex.hashing import Engine
from cortex.registry import WorkerSpec
from cortex.registry.spec import WorkerRole


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def spec(worker_id: str, port: int = 9000) -> WorkerSpec:
    return WorkerSpec(id=worker_id, url=f"http://127.0.0.1:{port}", engine=Engine.SGLANG,
                      model="m")


def test_a_vanished_healthy_worker_stays_and_an_unhealthy_one_is_remembered() -> None:
    clock = Clock()
    pool = WorkerPool(BreakerConfig(), clock, forget_after_s=60)
    assert pool.sync({"a": spec("a"), "b": spec("b", 9001)}) == (["a", "b"], [])
    a, b = pool.get("a"), pool.get("b")
    assert a is not None and b is not None
    a.health, b.health = Health.HEALTHY, Health.UNHEALTHY
    # Redis restarted empty: the view is empty
    assert pool.sync({}) == ([], ["b"])
    assert pool.get("a") is a and not a.registered  # kept, its lease to be re-asserted
    assert set(pool.remembered) == {"b"} and pool.remembered["b"].spec == spec("b", 9001)
    assert pool.candidates("m") == [a]
    # a's lease is back in the registry; b answers again and is re-registered
    assert pool.sync({"a": spec("a"), "b": spec("b", 9001)}) == (["b"], [])
    assert a.registered and not pool.remembered
    # a kept worker that turns unhealthy leaves at the next reconciliation
    a.health = Health.UNHEALTHY
    assert pool.sync({"b": spec("b", 9001)}) == ([], ["a"])
    clock.now += 61
    pool.sync({"b": spec("b", 9001)})
    assert not pool.remembered  # forgotten after forget_after_s


def test_a_tombstone_drops_a_worker_and_its_memory_until_registered_again() -> None:
    clock = Clock()
    pool = WorkerPool(BreakerConfig(), clock)
    pool.sync({"a": spec("a"), "b": spec("b", 9001)})
    for worker in pool:
        worker.health = Health.HEALTHY
    assert pool.sync({"b": spec("b", 9001)}, tombstones={"a"}) == ([], ["a"])
    assert "a" not in pool.remembered
    # learned from a re-assertion, with a view still holding the worker (taken earlier)
    pool.mark_tombstoned("b")
    assert pool.sync({"b": spec("b", 9001)}, taken_at=clock.now - 1) == ([], ["b"])
    assert len(pool) == 0 and not pool.remembered
    # a view requested after the removal that holds it again: an operator re-added it
    clock.now += 5
    assert pool.sync({"b": spec("b", 9001)}, taken_at=clock.now - 1) == (["b"], [])
    pool.forget("b")  # forgetting a member is a no-op
    assert pool.get("b") is not None


@pytest.mark.parametrize(
    ("result", "failing_for", "expected"),
    [
        (ProbeResult.OK, None, LeaseAction.REASSERT),
        (ProbeResult.BUSY, 500.0, LeaseAction.RENEW),  # busy: never evidence of death
        (ProbeResult.ERROR, 5.0, LeaseAction.RENEW),  # briefly unreachable
        (ProbeResult.ERROR, 30.0, LeaseAction.NONE),  # sustained: let the lease lapse
    ],
)
def test_lease_action(result: ProbeResult, failing_for: float | None,
                      expected: LeaseAction) -> None:
    pool = WorkerPool(BreakerConfig())
    pool.sync({"a": spec("a")})
    worker = pool.get("a")
    assert worker is not None
    worker.failing_since = None if failing_for is None else 1000.0 - failing_for
    assert lease_action(worker, result, 1000.0, remove_after_s=30.0) is expected


def test_engine_load_is_discounted_by_our_requests_that_finished_since_the_poll() -> None:
    pool = WorkerPool(BreakerConfig())
    pool.sync({"w": spec("w")})
    worker = pool.get("w")
    assert worker is not None
    before = worker.open_request()  # open while the poll is taken: the engine counts it
    poll = worker.load_poll_begun()
    after = worker.open_request()  # opened after the poll was sent: maybe not counted
    worker.load_polled(poll, running=5, waiting=2, at=100.0)
    assert worker.fresh_engine_load(100.5, 2.0).running == 5  # type: ignore[union-attr]
    worker.close_request(after)
    assert worker.fresh_engine_load(100.5, 2.0).running == 5  # type: ignore[union-attr]
    worker.close_request(before)
    load = worker.fresh_engine_load(100.5, 2.0)
    assert load is not None and (load.running, load.waiting) == (4, 2)
    assert worker.inflight == 0
    # opened after the stored poll, closed while the next is in flight: counts against
    # the next one only
    again = worker.open_request()
    poll = worker.load_poll_begun()
    worker.close_request(again)
    assert worker.fresh_engine_load(100.6, 2.0).running == 4  # type: ignore[union-attr]
    worker.load_polled(poll, running=1, waiting=0, at=101.0)
    assert worker.fresh_engine_load(101.1, 2.0).running == 0  # type: ignore[union-attr]
    # an overtaken poll's late answer is dropped
    old, new = worker.load_poll_begun(), worker.load_poll_begun()
    worker.load_polled(old, running=9, waiting=9, at=102.0)
    assert worker.fresh_engine_load(102.1, 2.0).running == 0  # type: ignore[union-attr]
    worker.load_polled(new, running=2, waiting=0, at=102.0)
    assert worker.fresh_engine_load(102.1, 2.0).running == 2  # type: ignore[union-attr]
    assert worker.fresh_engine_load(105.0, 2.0) is None  # stale


def test_eligible_filters_by_model_adapter_subset_and_pairs_only_when_both_roles_exist() -> None:
    def worker(worker_id: str, role: WorkerRole = WorkerRole.REGULAR, model: str = "m",
               engine: Engine = Engine.SGLANG) -> WorkerSpec:
        return WorkerSpec(id=worker_id, url=f"http://{worker_id}:1", engine=engine,
                          model=model, role=role)

    pool = WorkerPool(BreakerConfig())
    pool.sync({"a": worker("a"), "b": worker("b"), "other": worker("other", model="n"),
               "p": worker("p", WorkerRole.PREFILL),
               "pv": worker("pv", WorkerRole.PREFILL, engine=Engine.VLLM)})
    for w in pool:
        w.health = Health.HEALTHY
    a, b = pool.get("a"), pool.get("b")
    assert a is not None and b is not None
    a.adapters = frozenset({"sql"})
    model = ModelConfig(name="m", engine=Engine.SGLANG, adapters=("poem",))
    ids = [w.id for w in pool.eligible(model).regular]
    assert ids == ["a", "b"]
    assert [w.id for w in pool.eligible(model, "sql").regular] == ["a"]  # listed by a only
    assert [w.id for w in pool.eligible(model, "poem").regular] == ["a", "b"]  # configured
    assert [w.id for w in pool.eligible(model, allowed={"b"}).regular] == ["b"]
    # a prefill worker but no decode one: not served disaggregated, with or without pd
    assert pool.eligible(model, pd=True).pairs is None
    pool.sync({**{w.id: w.spec for w in pool}, "d": worker("d", WorkerRole.DECODE)})
    decode = pool.get("d")
    assert decode is not None
    decode.health = Health.HEALTHY
    eligible = pool.eligible(model, pd=True)
    assert eligible.pairs is not None
    assert ([w.id for w in eligible.pairs[0]], [w.id for w in eligible.pairs[1]]) == (
        ["p"], ["d"])  # the vLLM prefill speaks another handoff
    assert [w.id for w in eligible.everyone()] == ["a", "b", "p", "d"]
    assert pool.eligible(model).pairs is None  # pd off
    assert pool.eligible(model, pd=True, allowed={"a", "p"}) == Eligible([a], None)
