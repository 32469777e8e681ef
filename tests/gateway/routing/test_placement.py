"""A routed request's placement (pure): its credit follows the worker computing the prompt,
and the load it counted goes over to dispatch once."""

from __future__ import annotations

from collections.abc import Mapping

from cortex.gateway.config.gateway import BreakerConfig
from cortex.gateway.fleet.pool import CircuitBreaker, WorkerState
from cortex.gateway.metrics import GatewayMetrics
from cortex.gateway.routing.placement import Placement, PredictedBlocks
from cortex.hashing import Engine
from cortex.registry import WorkerSpec

KEYS = [11, 12, 13]


def keys_for(worker_id: str, keys: list[int], keysets: Mapping[int, list[int]] | None
             ) -> list[int]:
    return keys if worker_id != "lookahead" else (keysets or {}).get(2, [])


def test_the_credit_moves_with_the_worker_and_is_withdrawn_once() -> None:
    predicted, metrics = PredictedBlocks(ttl_s=60), GatewayMetrics()
    placement = Placement(predicted, keys_for, metrics, KEYS, {2: [21, 22]})
    assert placement.worker_id is None and predicted.match(KEYS) == {}
    placement.move("a")
    assert placement.worker_id == "a" and predicted.match(KEYS) == {"a": 3}
    placement.move("a")  # already there: nothing changes
    placement.move("lookahead")  # its own key set
    assert predicted.match(KEYS) == {} and predicted.match([21, 22]) == {"lookahead": 2}
    assert metrics.registry.get_sample_value("cortex_gateway_predicted_blocks") == 2
    placement.withdraw()
    placement.withdraw()
    assert placement.worker_id is None and len(predicted) == 0


def test_the_counted_load_is_handed_to_dispatch_once() -> None:
    worker = WorkerState(WorkerSpec(id="a", url="http://a:1", engine=Engine.SGLANG, model="m"),
                         CircuitBreaker(BreakerConfig()))
    placement = Placement(PredictedBlocks(ttl_s=60), keys_for, GatewayMetrics(), KEYS)
    placement.hold(worker, prefill_tokens=100)
    assert worker.pending == 1
    placement.dispatched()
    placement.dispatched()  # idempotent: also called when the request ends undispatched
    assert worker.pending == 0
