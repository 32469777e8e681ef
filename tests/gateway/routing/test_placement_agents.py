"""The agent terms of a decision: hint, live sessions, KV pressure, per candidate (pure)."""

from __future__ import annotations

from cortex.gateway.config.gateway import BreakerConfig, RoutingConfig, RoutingWeights
from cortex.gateway.fleet.pool import WorkerPool, WorkerState
from cortex.gateway.metrics import GatewayMetrics
from cortex.gateway.routing.placement import AgentTerms, SessionTable
from cortex.hashing import Engine
from cortex.registry import WorkerSpec


def workers(*specs: WorkerSpec) -> dict[str, WorkerState]:
    pool = WorkerPool(BreakerConfig())
    pool.sync({s.id: s for s in specs})
    return {s.id: w for s in specs if (w := pool.get(s.id)) is not None}


def spec(worker_id: str, **kw: object) -> WorkerSpec:
    return WorkerSpec(id=worker_id, url=f"http://127.0.0.1:{9000 + len(worker_id)}",
                      engine=Engine.SGLANG, model="m", **kw)  # type: ignore[arg-type]


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_sessions_next_turn_gets_its_hint_and_the_others_count_as_load() -> None:
    metrics = GatewayMetrics()
    terms = AgentTerms(RoutingConfig(), metrics, SessionTable(600, 60, 100, Clock()))
    w = workers(spec("a"), spec("b"), spec("c", kv_lookahead=1))
    first = terms.request("m", 16, "s1", [1, 2, 3], 3, None)
    assert first.hint is None
    assert first.candidate(w["a"]) == {"session": False, "session_tokens": 0, "sessions": 0,
                                       "kv_pressure": 0.0}
    first.routed("a")
    terms.request("m", 16, "s2", [1, 9], 2, None).routed("a")
    terms.request("m", 16, None, [1], 1, None).routed("b")  # no session: not remembered
    nxt = terms.request("m", 16, "s1", [1, 2, 3, 4, 5], 4, None)
    assert nxt.candidate(w["a"]) == {"session": True, "session_tokens": 48, "sessions": 1,
                                     "kv_pressure": 0.0}
    assert nxt.candidate(w["b"])["sessions"] == 0
    # the same prompt again: at most the blocks that can be hits
    again = terms.request("m", 16, "s1", [1, 2, 3], 2, None)
    assert again.candidate(w["a"])["session_tokens"] == 32
    nxt.routed("b")
    value = metrics.registry.get_sample_value
    assert value("cortex_gateway_session_hints_total", {"outcome": "new"}) == 2
    assert value("cortex_gateway_session_hints_total", {"outcome": "moved"}) == 1
    assert value("cortex_gateway_sessions", {}) == 2
    # a lookahead worker is never credited with the plain keys' blocks
    terms.request("m", 16, "s3", [7, 8], 2, None).routed("c")
    assert terms.request("m", 16, "s3", [7, 8, 9], 3, None).candidate(
        w["c"])["session_tokens"] == 0


def test_kv_pressure_from_the_ledgers_blocks_and_the_workers_capacity() -> None:
    metrics, now = GatewayMetrics(), [100.0]
    terms = AgentTerms(RoutingConfig(), metrics, clock=lambda: now[0])
    w = workers(spec("a"), spec("b"), spec("c"))
    w["a"].kv_capacity, w["b"].kv_capacity = 1000, 1000
    held = {"a": 1000, "b": 341, "c": 500}
    req = terms.request("m", 16, None, [1], 1, lambda worker: held[worker.id])
    assert [req.candidate(w[x])["kv_pressure"] for x in "abc"] == [1.0, 0.0, 0.0]

    def occupancy() -> float | None:
        return metrics.registry.get_sample_value("cortex_gateway_worker_kv_occupancy_ratio",
                                                 {"worker": "b"})

    assert occupancy() == 0.341
    # the gauge follows at most once a second; the pressure itself at every decision
    held["b"] = 1000
    assert req.candidate(w["b"])["kv_pressure"] == 1.0 and occupancy() == 0.341
    now[0] += 1.0
    assert req.candidate(w["b"])["kv_pressure"] == 1.0 and occupancy() == 1.0
    assert terms.request("m", 16, None, [1], 1, None).candidate(w["a"])["kv_pressure"] == 0.0
    off = AgentTerms(RoutingConfig(weights=RoutingWeights(kv_pressure=0.0)), metrics)
    assert off.request("m", 16, None, [1], 1, lambda _: 1000).candidate(
        w["a"])["kv_pressure"] == 0.0
