"""Admission: at most ``max_running`` requests in service, the rest wait FIFO.

A request is admitted when a running slot is free *and* the cache can pin its prefix and
reserve its blocks (evicting LRU leaves if needed). The head of the queue blocks the
ones behind it, as in the engines' FCFS schedulers. Waiting is cancellation-safe.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cortex.hashing import MediaSpan
from cortex.sim.cache import Lease, PrefixCache

__all__ = ["AdmissionQueue"]


@dataclass(eq=False, slots=True)
class _Waiter:
    prompt: Sequence[int]
    total_tokens: int
    future: asyncio.Future[Lease]
    lora: str | None = None
    media: Sequence[MediaSpan] = ()


class AdmissionQueue:
    """FIFO admission over a :class:`PrefixCache`; ``on_change`` runs after cache changes."""

    def __init__(self, cache: PrefixCache, max_running: int,
                 on_change: Callable[[], None]) -> None:
        self._cache = cache
        self._max_running = max_running
        self._on_change = on_change
        self._waiters: collections.deque[_Waiter] = collections.deque()
        self.running = 0
        self.waiting_tokens = 0

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def acquire(self, prompt: Sequence[int], total_tokens: int,
                      lora: str | None = None,
                      media: Sequence[MediaSpan] = ()) -> Lease:
        """Wait for a running slot and a cache lease (FIFO) in ``lora``'s namespace. Pair
        with :meth:`release_slot` and ``cache.release(lease)``."""
        future: asyncio.Future[Lease] = asyncio.get_running_loop().create_future()
        waiter = _Waiter(prompt, total_tokens, future, lora, media)
        self._waiters.append(waiter)
        self.waiting_tokens += len(prompt)
        self._pump()
        try:
            return await future
        except asyncio.CancelledError:
            if waiter in self._waiters:
                self._waiters.remove(waiter)
                self.waiting_tokens -= len(prompt)
            elif future.done() and not future.cancelled():
                # Granted just as we were cancelled: hand everything back.
                self._cache.release(future.result())
                self.release_slot()
            self._pump()
            raise

    def release_slot(self) -> None:
        """A request left service (its lease may live on, e.g. held for a vLLM decode)."""
        self.running -= 1
        self._pump()

    def pump(self) -> None:
        """Retry the head of the queue (call after freeing cache memory)."""
        self._pump()

    def limit(self, max_running: int) -> None:
        """From now on at most ``max_running`` requests in service (those running above it
        finish; none is admitted until they did)."""
        self._max_running = max_running
        self._pump()

    def _pump(self) -> None:
        changed = False
        while self._waiters and self.running < self._max_running:
            head = self._waiters[0]
            if head.future.done():  # cancelled; its task removes it, skip meanwhile
                self._waiters.popleft()
                self.waiting_tokens -= len(head.prompt)
                continue
            lease = self._cache.admit(head.prompt, head.total_tokens, head.lora, head.media)
            changed = True
            if lease is None:
                break
            self._waiters.popleft()
            self.waiting_tokens -= len(head.prompt)
            self.running += 1
            head.future.set_result(lease)
        if changed:
            self._on_change()

    def __repr__(self) -> str:
        return (f"AdmissionQueue(running={self.running}/{self._max_running}, "
                f"waiting={len(self._waiters)})")
