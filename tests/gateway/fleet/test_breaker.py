"""Pure pieces: circuit breaker, config loading, request validation, engine load parsers."""

from __future__ import annotations
import json
from pathlib import Path
import pytest
from cortex.gateway.config.gateway import BreakerConfig, GatewayConfig, load_config
from cortex.gateway.errors import ClientError, ConfigError, ErrorCode
from cortex.gateway.fleet.breaker import BreakerState, CircuitBreaker
from cortex.gateway.fleet.load import (
    LoadFormatError,
    parse_sglang_get_load,
    parse_sglang_loads,
    parse_vllm_metrics,
)
from cortex.gateway.request.payload import InferencePath, PromptKind, parse_body, parse_request
from cortex.hashing import Engine

class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


CONFIG = GatewayConfig.from_mapping({"models": [{"name": "m"}, {"name": "n"}]})


def parse(endpoint: InferencePath, body: object) -> object:
    return parse_request(endpoint, parse_body(json.dumps(body).encode()), CONFIG)


def test_breaker_opens_half_opens_and_closes() -> None:
    clock = Clock()
    breaker = CircuitBreaker(BreakerConfig(failures=3, window_s=10, open_s=5,
                                           half_open_successes=2), clock)
    for _ in range(3):
        assert breaker.allows()
        breaker.on_failure()
    assert breaker.state is BreakerState.OPEN and not breaker.allows()
    clock.now = 5.0
    state: BreakerState = breaker.state
    assert state is BreakerState.HALF_OPEN and breaker.allows()
    breaker.on_attempt()
    assert not breaker.allows()  # one trial at a time
    breaker.on_success()
    breaker.on_attempt()
    breaker.on_failure()
    assert breaker.state is BreakerState.OPEN
    clock.now = 10.0
    for _ in range(2):
        breaker.on_attempt()
        breaker.on_success()
    final: BreakerState = breaker.state
    assert final is BreakerState.CLOSED


def test_breaker_forgets_old_failures() -> None:
    clock = Clock()
    breaker = CircuitBreaker(BreakerConfig(failures=2, window_s=1, open_s=5), clock)
    breaker.on_failure()
    clock.now = 2.0
    breaker.on_failure()
    assert breaker.state is BreakerState.CLOSED
