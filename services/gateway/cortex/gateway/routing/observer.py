"""What a recorded routing decision adds to the metrics: the observer the router calls
once per decision it records (explain records nothing)."""

from __future__ import annotations

from cortex.gateway.metrics import GatewayMetrics
from cortex.gateway.routing.routed import Routed

__all__ = ["RoutingMetrics"]


class RoutingMetrics:
    """Stage timings (seconds), the decision's mode and reason, the prompt's size (tokens)."""

    __slots__ = ("_metrics",)

    def __init__(self, metrics: GatewayMetrics) -> None:
        self._metrics = metrics

    def __call__(self, routed: Routed) -> None:
        m, timings, decision = self._metrics, routed.timings, routed.decision
        stage = m.routing_seconds
        m.child(stage, "tokenize").observe(timings.tokenize)
        m.child(stage, "hash").observe(timings.hash)
        m.child(stage, "match").observe(timings.match)
        m.child(stage, "score").observe(timings.score)
        m.child(stage, "total").observe(timings.total)
        m.child(m.decisions, decision.mode.value, decision.reason.value).inc()
        m.prompt_tokens.observe(routed.prompt_tokens)
