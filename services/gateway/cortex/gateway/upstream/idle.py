"""``IdleGuard``: closes a worker's answer that went silent (``upstream.stream_idle_timeout_s``)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

__all__ = ["IdleGuard"]


class IdleGuard:
    """Closes a response whose read has waited ``idle_s`` seconds for bytes.

    Only time spent waiting on the worker counts (not time the consumer spends sending to a
    slow client), and it costs one timer per idle period, not one per chunk."""

    __slots__ = ("_handle", "_loop", "_on_idle", "fired", "idle_s", "since")

    def __init__(self, idle_s: float, on_idle: Callable[[], None]) -> None:
        self._loop = asyncio.get_running_loop()
        self.idle_s = idle_s
        self._on_idle = on_idle
        self._handle: asyncio.TimerHandle | None = None
        self.since: float | None = None  # loop time the pending read started
        self.fired = False

    def reading(self) -> None:
        self.since = self._loop.time()
        if self._handle is None:
            self._handle = self._loop.call_at(self.since + self.idle_s, self._check)

    def got(self) -> None:
        self.since = None

    def _check(self) -> None:
        self._handle = None
        since = self.since
        if since is None:
            return  # not reading: re-armed by the next read
        if self._loop.time() - since >= self.idle_s:
            self.fired = True
            self._on_idle()
        else:
            self._handle = self._loop.call_at(since + self.idle_s, self._check)

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
