"""``EpochClock``: the strictly increasing epochs a forwarder gives its sources on one replica."""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["MAX_EPOCH", "EpochClock"]

MAX_EPOCH = 2**64 - 1


class EpochClock:
    """Epochs for one replica: strictly increasing, wall-clock microseconds when the wall
    clock is ahead, and never at or below a floor learned from the replica (what it holds
    from an earlier ingest process: a wall clock that stepped back must not make the
    replica reject our epochs as stale). ``wall_us`` is injectable for tests."""

    def __init__(self, wall_us: Callable[[], int] | None = None) -> None:
        self._wall_us = wall_us or (lambda: time.time_ns() // 1000)
        self._last = 0

    def __repr__(self) -> str:
        return f"EpochClock(last={self._last})"

    @property
    def last(self) -> int:
        return self._last

    def raise_floor(self, epoch: int) -> None:
        """Every later epoch is above ``epoch``."""
        self._last = max(self._last, min(epoch, MAX_EPOCH - 1))

    def next(self) -> int:
        self._last = min(max(self._last + 1, self._wall_us()), MAX_EPOCH)
        return self._last
