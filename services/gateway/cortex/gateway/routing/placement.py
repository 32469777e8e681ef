"""Where a routed request's prompt is being computed, and the load counted for it.

A recorded decision takes effect at once, before the request is dispatched: the worker
that will compute the prompt is credited with its blocks (predicted blocks) and counted as
one more active request (``WorkerState.pending``), so requests routed a moment later —
a simultaneous burst of one new prefix — follow it. Dispatch moves that credit when a
failure before the first byte sends the request elsewhere.

Predicted blocks: a short-lived side index so a burst of one new prefix co-locates.
At the routing decision the chosen worker is credited with the request's full blocks for
``ttl_s`` seconds, before its ``BlockStored`` events can reach the index — so requests
routed a moment later already see the credit. Predictions never enter the event-driven
ledger; they are dropped when they expire, when the worker's ledger is cleared, when the
worker leaves, or when the request is withdrawn from the worker (it failed before
computing the prompt there).

Each credit covers a whole chain from the first block, so a worker's predicted keys are
prefix-closed (if block *i* is predicted, so is every block before it, by a credit at least
as late). A lookup therefore walks the query's keys from the start and stops at the first
key nobody holds.

Memory tiers: a prediction stands for device blocks. When the worker's device ledger drops
a predicted key (evicted, maybe to its host tier), the prediction goes with it; a host copy
is then credited through the ledger's host tier, at its weight (the engine reports blocks
loaded back as cached, so the hit stays predicted, and never above what some tier holds).
"""

from __future__ import annotations

import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Mapping

from cortex.gateway.fleet.pool import WorkerState
from cortex.gateway.metrics import GatewayMetrics

__all__ = ["Credit", "KeysFor", "Placement", "PredictedBlocks"]


# ---- predicted ----


class Credit:
    """One decision's prediction: ``keys`` credited to ``worker_id`` until ``expires``
    (monotonic seconds), while ``live``. The handle :meth:`PredictedBlocks.withdraw` takes."""

    __slots__ = ("evictions", "expires", "keys", "live", "worker_id")

    def __init__(self, worker_id: str, keys: list[int], expires: float, evictions: int) -> None:
        self.worker_id = worker_id
        self.keys = keys
        self.expires = expires
        self.evictions = evictions  # the worker's eviction count when credited
        self.live = True

    def __repr__(self) -> str:
        return (f"Credit({self.worker_id}, blocks={len(self.keys)}, expires={self.expires:.3f},"
                f" live={self.live})")


class PredictedBlocks:
    """``key → {worker_id: latest live Credit}`` with expiry in insertion order (constant
    TTL).

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
        self._holders: dict[int, dict[str, Credit]] = {}
        self._log: deque[Credit] = deque()
        self._credits = 0
        self._evictions: defaultdict[str, int] = defaultdict(int)

    def credit(self, worker_id: str, keys: list[int]) -> Credit | None:
        """Credit ``worker_id`` with the chain ``keys`` (a prompt's blocks) for ``ttl_s``;
        ``None`` when predictions are off or there is no block."""
        if self.ttl_s <= 0 or not keys:
            return None
        now = self._clock()
        self._expire(now)
        credit = Credit(worker_id, keys, now + self.ttl_s, self._evictions[worker_id])
        holders = self._holders
        for key in keys:
            entry = holders.get(key)
            if entry is None:
                holders[key] = {worker_id: credit}
            else:
                entry[worker_id] = credit
        self._log.append(credit)
        self._credits += len(keys)
        while self._credits > self.max_keys and self._log:
            self._pop_oldest()
        return credit

    def withdraw(self, credit: Credit) -> None:
        """Take ``credit`` back (its request will not compute the prompt on that worker).

        Keys it was the latest credit for fall back to the worker's newest older live
        credit covering them (another request with the same prefix still running there),
        unless the engine evicted blocks of that worker since: then they are dropped, which
        can only under-predict."""
        if not credit.live:
            return
        orphaned = self._retire(credit)
        worker_id = credit.worker_id
        holders = self._holders
        evictions = self._evictions[worker_id]
        for older in reversed(self._log):
            if not orphaned:
                break
            if older.worker_id != worker_id or not older.live or older.evictions != evictions:
                continue
            for key in older.keys:
                if key in orphaned:
                    orphaned.discard(key)
                    holders.setdefault(key, {})[worker_id] = older

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
        self._evictions[worker_id] += 1
        holders = self._holders
        for credit in self._log:
            if credit.worker_id != worker_id or not credit.live:
                continue
            credit.live = False
            self._credits -= len(credit.keys)
            for key in credit.keys:
                entry = holders.get(key)
                if entry is not None and entry.pop(worker_id, None) is not None and not entry:
                    del holders[key]

    def forget_keys(self, worker_id: str, keys: Iterable[int]) -> None:
        """Drop predictions of these blocks for ``worker_id`` (the engine evicted them)."""
        holders = self._holders
        dropped = False
        for key in keys:
            entry = holders.get(key)
            if entry is not None and entry.pop(worker_id, None) is not None:
                dropped = True
                if not entry:
                    del holders[key]
        if dropped:  # older credits of these keys must not come back on a withdrawal
            self._evictions[worker_id] += 1

    def _expire(self, now: float) -> None:
        log = self._log
        while log and log[0].expires <= now:
            self._pop_oldest()

    def _pop_oldest(self) -> None:
        credit = self._log.popleft()
        if credit.live:  # else withdrawn or forgotten: already accounted for
            self._retire(credit)

    def _retire(self, credit: Credit) -> set[int]:
        """End a live ``credit``: the keys it is still the latest credit for (no later credit
        refreshed them) lose it; returns those keys."""
        credit.live = False
        self._credits -= len(credit.keys)
        worker_id = credit.worker_id
        holders = self._holders
        dropped: set[int] = set()
        for key in credit.keys:
            entry = holders.get(key)
            if entry is not None and entry.get(worker_id) is credit:
                del entry[worker_id]
                if not entry:
                    del holders[key]
                dropped.add(key)
        return dropped

    def __len__(self) -> int:
        return len(self._holders)

    def __repr__(self) -> str:
        return (
            f"PredictedBlocks(keys={len(self._holders)}, credits={self._credits},"
            f" ttl_s={self.ttl_s})"
        )


# ---- placement ----


KeysFor = Callable[[str, list[int], Mapping[int, list[int]] | None], list[int]]
"""``(worker_id, keys, keysets)`` → the prompt's keys in that worker's key set."""


class Placement:
    """The worker credited with a routed request's blocks (predicted blocks), and the load
    the decision counted before dispatch.

    :meth:`move` re-credits another worker (a retry), :meth:`withdraw` takes the credit
    back (the worker failed or refused before computing the prompt), :meth:`dispatched`
    hands the counted load over to the in-flight slots of the attempts (idempotent; also
    called when the request ends without a dispatch). A placement of an unrecorded decision
    (explain) starts empty.
    """

    __slots__ = ("_credit", "_keys_for", "_metrics", "_pending", "_predicted", "keys",
                 "keysets")

    def __init__(self, predicted: PredictedBlocks, keys_for: KeysFor, metrics: GatewayMetrics,
                 keys: list[int], keysets: Mapping[int, list[int]] | None = None) -> None:
        self._predicted = predicted
        self._keys_for = keys_for
        self._metrics = metrics
        self.keys = keys
        self.keysets = keysets
        self._credit: Credit | None = None
        self._pending: list[tuple[WorkerState, int]] = []

    @property
    def worker_id(self) -> str | None:
        """The worker credited now, if any."""
        credit = self._credit
        return credit.worker_id if credit is not None and credit.live else None

    def move(self, worker_id: str) -> None:
        """The prompt will be computed on ``worker_id`` (a no-op if it is credited)."""
        if self.worker_id == worker_id:
            return
        self.withdraw()
        keys = self._keys_for(worker_id, self.keys, self.keysets)
        self._credit = self._predicted.credit(worker_id, keys)
        self._metrics.predicted_keys.set(len(self._predicted))

    def complete(self, keys: list[int]) -> None:
        """The prompt's whole ``keys`` are known now (a lazy walk was finished): the worker
        credited now, if any, is credited with all of them."""
        self.keys = keys
        worker_id = self.worker_id
        if worker_id is not None:
            self.withdraw()
            self.move(worker_id)

    def withdraw(self) -> None:
        credit, self._credit = self._credit, None
        if credit is not None:
            self._predicted.withdraw(credit)
            self._metrics.predicted_keys.set(len(self._predicted))

    def hold(self, worker: WorkerState, prefill_tokens: int = 0) -> None:
        """Count the request, and the ``prefill_tokens`` it will compute, on ``worker``
        until :meth:`dispatched` (from there dispatch counts them per attempt)."""
        worker.hold(prefill_tokens)
        self._pending.append((worker, prefill_tokens))

    def dispatched(self) -> None:
        pending, self._pending = self._pending, []
        for worker, prefill_tokens in pending:
            worker.unhold(prefill_tokens)

    def __repr__(self) -> str:
        return f"Placement(worker={self.worker_id}, pending={len(self._pending)})"
