"""Predicted blocks: a short-lived side index so a burst of one new prefix co-locates.

Right after a routing decision the chosen worker is credited with the request's full blocks
for ``ttl_s`` seconds, before its ``BlockStored`` events can reach the index. Predictions
never enter the event-driven ledger; they are dropped when they expire, when the worker's
ledger is cleared, or when the worker leaves.

Each credit covers a whole chain from the first block, so a worker's predicted keys are
prefix-closed (if block *i* is predicted, so is every block before it, with an expiry at
least as late). A lookup therefore walks the query's keys from the start and stops at the
first key nobody holds.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable

__all__ = ["PredictedBlocks"]


class PredictedBlocks:
    """``key → {worker_id: expires_at}`` with expiry in insertion order (constant TTL).

    Bounded by ``max_keys`` (key, worker) credits: the oldest credits go first. Pure and
    synchronous; the clock (seconds) is injectable.
    """

    def __init__(
        self,
        ttl_s: float,
        max_keys: int = 1_000_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl_s = ttl_s
        self.max_keys = max_keys
        self._clock = clock
        self._holders: dict[int, dict[str, float]] = {}
        self._log: deque[tuple[float, str, list[int]]] = deque()
        self._credits = 0

    def credit(self, worker_id: str, keys: list[int]) -> None:
        """Credit ``worker_id`` with the chain ``keys`` (a prompt's blocks) for ``ttl_s``."""
        if self.ttl_s <= 0 or not keys:
            return
        now = self._clock()
        self._expire(now)
        expires = now + self.ttl_s
        holders = self._holders
        for key in keys:
            entry = holders.get(key)
            if entry is None:
                holders[key] = {worker_id: expires}
            else:
                entry[worker_id] = expires
        self._log.append((expires, worker_id, keys))
        self._credits += len(keys)
        while self._credits > self.max_keys and self._log:
            self._pop_oldest()

    def match(self, keys: list[int]) -> dict[str, int]:
        """Per worker, how many leading blocks of ``keys`` are predicted (absent = 0)."""
        if not self._holders:
            return {}
        now = self._clock()
        self._expire(now)
        out: dict[str, int] = {}
        holders = self._holders
        for i, key in enumerate(keys):
            entry = holders.get(key)
            if entry is None:
                break
            for worker_id in entry:
                if out.get(worker_id, 0) == i:  # consecutive from the first block only
                    out[worker_id] = i + 1
        return out

    def forget_worker(self, worker_id: str) -> None:
        """Drop every prediction for ``worker_id`` (its cache was cleared or it left)."""
        for key in [k for k, entry in self._holders.items() if worker_id in entry]:
            entry = self._holders[key]
            del entry[worker_id]
            if not entry:
                del self._holders[key]

    def forget_keys(self, worker_id: str, keys: Iterable[int]) -> None:
        """Drop predictions of these blocks for ``worker_id`` (the engine evicted them)."""
        for key in keys:
            entry = self._holders.get(key)
            if entry is not None and entry.pop(worker_id, None) is not None and not entry:
                del self._holders[key]

    def _expire(self, now: float) -> None:
        log = self._log
        while log and log[0][0] <= now:
            self._pop_oldest()

    def _pop_oldest(self) -> None:
        expires, worker_id, keys = self._log.popleft()
        self._credits -= len(keys)
        holders = self._holders
        for key in keys:
            entry = holders.get(key)
            # only if no later credit refreshed it
            if entry is not None and entry.get(worker_id) == expires:
                del entry[worker_id]
                if not entry:
                    del holders[key]

    def __len__(self) -> int:
        return len(self._holders)

    def __repr__(self) -> str:
        return (
            f"PredictedBlocks(keys={len(self._holders)}, credits={self._credits},"
            f" ttl_s={self.ttl_s})"
        )
