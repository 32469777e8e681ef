"""The routing observer: what one recorded decision adds to the metrics."""

from __future__ import annotations

from cortex.gateway.config.gateway import ModelConfig, RoutingWeights
from cortex.gateway.metrics import GatewayMetrics
from cortex.gateway.routing.placement import Placement, PredictedBlocks
from cortex.gateway.routing.router import Routed, RoutingMetrics, StageTimings
from cortex.gateway.routing.scoring import Candidate, decide
from cortex.ledger.model import LedgerState


def test_a_decision_records_its_stages_mode_reason_and_prompt_size() -> None:
    metrics = GatewayMetrics()
    decision = decide([Candidate("a", ledger=LedgerState.READY)], RoutingWeights(),
                      cache_off=None, turn=1)
    placement = Placement(PredictedBlocks(ttl_s=60), lambda w, k, s: k, metrics, [])
    routed = Routed(decision, ModelConfig(name="m"), 40, [], 2, "replica", 1,
                    StageTimings(0.001, 0.002, 0.003, 0.004), placement)
    RoutingMetrics(metrics)(routed)
    sample = metrics.registry.get_sample_value
    assert sample("cortex_gateway_routing_seconds_sum", {"stage": "total"}) == 0.01
    assert sample("cortex_gateway_decisions_total", {
        "mode": decision.mode.value, "reason": decision.reason.value}) == 1
    assert sample("cortex_gateway_prompt_tokens_sum") == 40
