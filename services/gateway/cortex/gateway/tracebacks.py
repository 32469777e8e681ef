"""Rate-limited traceback logging: a burst of identical failures must not flood the log.

Internal errors log their traceback at most ``burst`` times per ``window_s`` seconds; the
rest log one line without it, and the next traceback says how many were suppressed.
Client errors never log tracebacks (they are 4xx values, not exceptions that escaped).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

__all__ = ["TracebackLimiter"]


class TracebackLimiter:
    """Pure admission of tracebacks over a sliding window (clock in seconds)."""

    def __init__(self, burst: int = 10, window_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.burst = burst
        self.window_s = window_s
        self._clock = clock
        self._recent: deque[float] = deque()
        self.suppressed = 0  # since the last traceback logged

    def allow(self) -> bool:
        """Whether the next failure may log its traceback."""
        now = self._clock()
        recent = self._recent
        while recent and now - recent[0] > self.window_s:
            recent.popleft()
        if len(recent) >= self.burst:
            self.suppressed += 1
            return False
        recent.append(now)
        return True

    def log(self, logger: logging.Logger, message: str, *args: Any, **extra: Any) -> None:
        """Log ``message`` as an error, with the current exception's traceback if allowed."""
        if self.allow():
            if self.suppressed:
                message += f" ({self.suppressed} tracebacks suppressed before)"
                self.suppressed = 0
            logger.error(message, *args, exc_info=True, extra=extra)
        else:
            logger.error(message + " (traceback suppressed: rate limit)", *args, extra=extra)

    def __repr__(self) -> str:
        return (f"TracebackLimiter(burst={self.burst}, window_s={self.window_s}, "
                f"suppressed={self.suppressed})")
