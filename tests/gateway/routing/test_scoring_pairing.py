"""Prefill/decode pairing (pure): conditional disaggregation, the decode pool ranked by load, the
pool serving a model by pairs."""

from __future__ import annotations

from typing import Any

from cortex.gateway.config.gateway import (
    BreakerConfig,
    PDConfig,
    RoutingWeights,
)
from cortex.gateway.fleet.pool import CircuitBreaker, Health, WorkerPool
from cortex.gateway.routing.scoring import (
    Candidate,
    LocalPrefill,
    MatchMode,
    PairDecision,
    Reason,
    decide,
)
from cortex.hashing import Engine
from cortex.ledger.model import LedgerState
from cortex.registry import WorkerSpec
from cortex.registry.spec import WorkerRole

W = RoutingWeights()


def scored(worker: str, **kw: Any) -> Any:
    base: dict[str, Any] = {"engine_running": 0, "engine_waiting": 0,
                            "ledger": LedgerState.READY}
    base.update(kw)
    return decide([Candidate(worker, **base)], W, cache_off=Reason.LOAD_ONLY).chosen


def plan(engine: Engine, prompt: int, sequences: int = 1) -> PairDecision:
    d = decide([Candidate("p")], W)
    return PairDecision(engine, d, d, None, prompt, sequences)


def spec(worker: str, role: str, model: str = "m") -> WorkerSpec:
    return WorkerSpec(id=worker, url=f"http://{worker}:1", engine=Engine.SGLANG, model=model,
                      role=role)  # type: ignore[arg-type]


def test_conditional_disaggregation() -> None:
    off = PDConfig()
    on = PDConfig(local_prefill_max_tokens=2048, local_prefill_max_ratio=0.7)
    vllm = plan(Engine.VLLM, 4000)
    cold, warm = scored("d"), scored("d", index_tokens=3000)
    assert vllm.local_prefill(warm, off) is None  # off by default
    assert vllm.local_prefill(cold, on) is None  # 4000 uncached: disaggregate
    assert vllm.local_prefill(warm, on) is LocalPrefill.SHORT_UNCACHED  # 1000 < 2048, 0.25
    short = plan(Engine.VLLM, 100)
    assert short.local_prefill(cold, on) is None  # 100% uncached > 0.7
    assert short.local_prefill(cold, PDConfig(local_prefill_max_tokens=2048)) is not None
    stale = scored("d", index_tokens=3000, ledger=LedgerState.STALE)
    assert vllm.local_prefill(stale, on) is None  # only a READY ledger counts
    assert plan(Engine.VLLM, 10, sequences=2).local_prefill(cold, off) is (
        LocalPrefill.MULTI_SEQUENCE)
    assert plan(Engine.SGLANG, 4000).local_prefill(warm, on) is None  # decode cannot


def test_decode_pool_is_ranked_by_load_only() -> None:
    hot = Candidate("hot", engine_running=4, engine_waiting=0, index_tokens=4096,
                    ledger=LedgerState.READY)
    idle = Candidate("idle", engine_running=0, engine_waiting=0)
    d = decide([hot, idle], W, cache_off=Reason.LOAD_ONLY)
    assert (d.mode, d.reason, d.chosen.worker_id, d.hit_tokens) == (
        MatchMode.LOAD_AWARE, Reason.LOAD_ONLY, "idle", 0)


def test_pool_serves_a_model_with_a_prefill_and_a_decode_worker() -> None:
    pool = WorkerPool(BreakerConfig())
    pool.sync({"p": spec("p", "prefill"), "d": spec("d", "decode"),
               "x": spec("x", "prefill", "only-prefill")})
    assert pool.models() == ["m"] and not pool.servable()
    for w in pool:
        w.health = Health.HEALTHY
    assert pool.servable()
    assert [w.id for w in pool.candidates("m")] == []
    assert [w.id for w in pool.candidates("m", WorkerRole.DECODE)] == ["d"]
    decode = pool.get("d")
    assert decode is not None
    decode.breaker = CircuitBreaker(BreakerConfig(failures=1))
    decode.breaker.on_failure()
    assert not pool.servable()
