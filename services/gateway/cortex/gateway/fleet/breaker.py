"""Per-worker circuit breaker (pure; the clock in seconds is injectable).

``CLOSED`` → ``OPEN`` after ``failures`` failures within ``window_s``; after ``open_s`` it is
``HALF_OPEN`` and admits one trial request at a time; ``half_open_successes`` successes in a
row close it, any failure re-opens it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from enum import StrEnum

from cortex.gateway.config.gateway import BreakerConfig

__all__ = ["BreakerState", "CircuitBreaker"]


class BreakerState(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    """Counts a worker's request failures; :meth:`allows` says whether to route to it."""

    def __init__(self, config: BreakerConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self._failures: deque[float] = deque()
        self._state = BreakerState.CLOSED
        self._opened_at = 0.0
        self._successes = 0
        self._trial_out = False

    @property
    def state(self) -> BreakerState:
        opened_for = self._clock() - self._opened_at
        if self._state is BreakerState.OPEN and opened_for >= self.config.open_s:
            self._state = BreakerState.HALF_OPEN
            self._successes = 0
            self._trial_out = False
        return self._state

    def allows(self) -> bool:
        """May a request be routed here now (without claiming the half-open trial)?"""
        state = self.state
        return state is BreakerState.CLOSED or (
            state is BreakerState.HALF_OPEN and not self._trial_out
        )

    def on_attempt(self) -> None:
        """A request was sent: in half-open it is the trial, others wait for its outcome."""
        if self.state is BreakerState.HALF_OPEN:
            self._trial_out = True

    def on_success(self) -> None:
        state = self.state
        if state is BreakerState.HALF_OPEN:
            self._trial_out = False
            self._successes += 1
            if self._successes >= self.config.half_open_successes:
                self._state = BreakerState.CLOSED
                self._failures.clear()

    def on_abandon(self) -> None:
        """The request ended without a verdict (client went away): free the trial slot."""
        self._trial_out = False

    def on_failure(self) -> None:
        now = self._clock()
        state = self.state
        if state is BreakerState.HALF_OPEN:
            self._open(now)
            return
        if state is BreakerState.OPEN:
            return
        failures = self._failures
        failures.append(now)
        while failures and now - failures[0] > self.config.window_s:
            failures.popleft()
        if len(failures) >= self.config.failures:
            self._open(now)

    def _open(self, now: float) -> None:
        self._state = BreakerState.OPEN
        self._opened_at = now
        self._trial_out = False
        self._failures.clear()

    def __repr__(self) -> str:
        return f"CircuitBreaker({self.state.value}, recent_failures={len(self._failures)})"
