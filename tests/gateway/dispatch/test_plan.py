"""The attempt plans alone: pure, no event loop, no sockets. Each outcome is fed in by hand
and the plan answers where the next attempt goes, where the prompt's blocks are credited
and what the client gets when nothing worked."""

from __future__ import annotations

import pytest

from cortex.gateway.config.gateway import BreakerConfig, PDConfig, RoutingWeights
from cortex.gateway.dispatch.plan import AttemptPlan, Fallback, LegFailure, PairPlan, Side
from cortex.gateway.errors import ErrorCode, ServiceUnavailable, UpstreamError
from cortex.gateway.fleet.pool import CircuitBreaker, Health, WorkerPool
from cortex.gateway.routing.scoring import (
    Candidate,
    Decision,
    LocalPrefill,
    PairDecision,
    Reason,
    decide,
)
from cortex.gateway.upstream.client import FailureKind, UpstreamFailure
from cortex.hashing import Engine
from cortex.ledger.model import LedgerState
from cortex.registry import WorkerSpec

pytestmark = pytest.mark.timeout(10)

W = RoutingWeights()


class Credit:
    """Records where the plan credits the prompt (a Placement without predictions)."""

    def __init__(self) -> None:
        self.worker: str | None = None
        self.moves: list[str] = []

    def move(self, worker_id: str) -> None:
        self.worker = worker_id
        self.moves.append(worker_id)

    def withdraw(self) -> None:
        self.worker = None


def pool_of(*workers: str, engine: Engine = Engine.SGLANG) -> WorkerPool:
    pool = WorkerPool(BreakerConfig())
    pool.sync({w: WorkerSpec(id=w, url=f"http://127.0.0.1:{9000 + i}", engine=engine,
                             model="m") for i, w in enumerate(workers)})
    for worker in pool:
        worker.health = Health.HEALTHY
    return pool


def ranking(*workers: str, **kw: object) -> Decision:
    """``workers`` ranked in the order given (less load first)."""
    return decide([Candidate(w, inflight=i, engine_running=0, engine_waiting=0, **kw)
                   for i, w in enumerate(workers)], W,  # type: ignore[arg-type]
                  cache_off=Reason.LOAD_ONLY)


def failure(status: int | None = None, kind: FailureKind = FailureKind.STATUS,
            retry_after_s: float | None = None) -> UpstreamFailure:
    return UpstreamFailure(kind, "test", status, retry_after_s)


def test_attempts_skip_unroutable_workers_and_stop_at_the_budget() -> None:
    pool = pool_of("a", "b", "c", "d")
    down = pool.get("b")
    assert down is not None
    down.health = Health.UNHEALTHY
    credit = Credit()
    plan = AttemptPlan(ranking("a", "b", "c", "d").ranked, pool.get, 2, credit)
    step = plan.next()
    assert step is not None and step[0].id == "a" and plan.retry_reason is None
    plan.failed(failure(kind=FailureKind.CONNECT))
    assert credit.worker is None  # the failed worker computed nothing
    step = plan.next()
    assert step is not None and step[0].id == "c" and plan.retry_reason == "connect"
    assert credit.moves == ["a", "c"]
    plan.failed(failure(kind=FailureKind.TIMEOUT))
    assert plan.next() is None  # two attempts in all, "d" is never tried
    verdict = plan.verdict()
    assert isinstance(verdict, UpstreamError)
    assert (verdict.status, verdict.code) == (504, ErrorCode.UPSTREAM_TIMEOUT)


def test_a_worker_whose_breaker_is_open_is_not_attempted() -> None:
    pool = pool_of("a", "b")
    tripped = pool.get("a")
    assert tripped is not None
    tripped.breaker = CircuitBreaker(BreakerConfig(failures=1))
    tripped.breaker.on_failure()
    plan = AttemptPlan(ranking("a", "b").ranked, pool.get, 3, Credit())
    step = plan.next()
    assert step is not None and step[0].id == "b"


@pytest.mark.parametrize(("statuses", "expected"), [((429, 429), 429), ((429, 503), 503)])
def test_all_busy_is_the_busy_status_with_the_longest_retry_after(
        statuses: tuple[int, int], expected: int) -> None:
    pool = pool_of("a", "b")
    plan = AttemptPlan(ranking("a", "b").ranked, pool.get, 3, Credit())
    for status, after in zip(statuses, (3.0, None), strict=True):
        assert plan.next() is not None
        plan.failed(failure(status, retry_after_s=after))
    assert plan.next() is None
    verdict = plan.verdict()
    assert isinstance(verdict, ServiceUnavailable)
    assert (verdict.status, verdict.retry_after_s) == (expected, 3.0)


def test_a_broken_worker_among_busy_ones_is_a_502_and_nothing_tried_is_a_503() -> None:
    pool = pool_of("a", "b")
    plan = AttemptPlan(ranking("a", "b").ranked, pool.get, 3, Credit())
    plan.next()
    plan.failed(failure(429))
    plan.next()
    plan.failed(failure(500))
    verdict = plan.verdict()
    assert isinstance(verdict, UpstreamError) and verdict.status == 502
    empty = AttemptPlan(ranking("a").ranked, pool_of().get, 3, Credit())
    assert empty.next() is None and isinstance(empty.verdict(), ServiceUnavailable)


def test_a_refusal_takes_the_credit_back_an_answer_keeps_it() -> None:
    pool = pool_of("a")
    credit = Credit()
    plan = AttemptPlan(ranking("a").ranked, pool.get, 3, credit)
    plan.next()
    plan.answered(200)
    assert credit.worker == "a"
    plan.answered(400)
    assert credit.worker is None


def pd(engine: Engine, prefills: tuple[str, ...], decodes: tuple[str, ...],
       fallback: tuple[str, ...] = (), prompt: int = 4000) -> PairDecision:
    return PairDecision(engine, ranking(*prefills), ranking(*decodes),
                  ranking(*fallback) if fallback else None, prompt, 1)


def test_a_failed_prefill_moves_to_the_next_pair_a_lost_handoff_ends_the_pairs() -> None:
    pool = pool_of("p0", "p1", "d0", "d1")
    credit = Credit()
    pairs = PairPlan(pd(Engine.SGLANG, ("p0", "p1"), ("d0", "d1"), ("r",)), pool.get,
                     PDConfig(max_attempts=5), credit)
    pair, refused = pairs.next()
    assert pair is not None and (pair.prefill.worker_id, pair.decode.worker_id) == ("p0", "d0")
    assert refused == [] and credit.worker == "p0" and pair.local is None
    pairs.failed(LegFailure(Side.PREFILL, "p0", "connect"))
    assert credit.worker is None
    pair, _ = pairs.next()
    assert pair is not None and (pair.prefill.worker_id, pair.decode.worker_id) == ("p1", "d0")
    pairs.failed(LegFailure(Side.DECODE, "d0", "disconnect", prefill_ok=True))
    assert credit.worker == "p1"  # the prefill completed: its blocks are there
    assert pairs.next() == (None, [])  # the KV was handed over and lost: no second try
    assert pairs.verdict() == Fallback("decode_failed")
    assert (pairs.failed_prefill, pairs.failed_decode, pairs.attempts) == ({"p0"}, {"d0"}, 2)


def test_without_a_fallback_the_side_that_failed_last_is_the_error() -> None:
    pool = pool_of("p0", "d0")
    pairs = PairPlan(pd(Engine.VLLM, ("p0",), ("d0",)), pool.get, PDConfig(), Credit())
    assert pairs.next()[0] is not None
    pairs.failed(LegFailure(Side.DECODE, "d0", "timeout", timeout=True))
    assert pairs.next() == (None, [])  # the only decode failed
    verdict = pairs.verdict()
    assert isinstance(verdict, UpstreamError)
    assert (verdict.status, verdict.code) == (504, ErrorCode.DECODE_SERVER_ERROR)
    disabled = PairPlan(pd(Engine.VLLM, ("p0",), ("d0",), ("r",)), pool.get,
                        PDConfig(fallback_to_regular=False), Credit())
    assert disabled.next()[0] is not None
    disabled.failed(LegFailure(Side.PREFILL, "p0", "status", status=503))
    verdict = disabled.verdict()
    assert isinstance(verdict, ServiceUnavailable) and verdict.status == 503  # busy


def test_no_pair_at_all_falls_back_or_is_a_503() -> None:
    pool = pool_of("p0", "d0")
    for worker in pool:
        worker.health = Health.UNHEALTHY
    with_fallback = PairPlan(pd(Engine.SGLANG, ("p0",), ("d0",), ("r",)), pool.get,
                             PDConfig(), Credit())
    assert with_fallback.next() == (None, []) and with_fallback.attempts == 0
    assert with_fallback.verdict() == Fallback("no_pair")
    alone = PairPlan(pd(Engine.SGLANG, ("p0",), ("d0",)), pool.get, PDConfig(), Credit())
    alone.next()
    assert isinstance(alone.verdict(), ServiceUnavailable)


def test_a_local_prefill_credits_the_decode_worker() -> None:
    pool = pool_of("p0", "d0", engine=Engine.VLLM)
    credit = Credit()
    plan = PairDecision(Engine.VLLM, ranking("p0"),
                  ranking("d0", index_tokens=3000, ledger=LedgerState.READY), None, 4000, 1)
    config = PDConfig(local_prefill_max_tokens=2048, local_prefill_max_ratio=0.7)
    pair, _ = PairPlan(plan, pool.get, config, credit).next()
    assert pair is not None and pair.local is LocalPrefill.SHORT_UNCACHED
    assert credit.worker == "d0"
    computes, why = plan.computes(plan.prefill.chosen, plan.decode.chosen, config)
    assert (computes.worker_id, why) == ("d0", LocalPrefill.SHORT_UNCACHED)
    assert plan.computes(plan.prefill.chosen, plan.decode.chosen, PDConfig())[1] is None
