"""The per-worker circuit breaker (pure; an injected clock)."""

from __future__ import annotations

from cortex.gateway.config.gateway import BreakerConfig
from cortex.gateway.fleet.pool import BreakerState, CircuitBreaker


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


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
