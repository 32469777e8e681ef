"""Where a routed request's prompt is being computed, and the load counted for it.

A recorded decision takes effect at once, before the request is dispatched: the worker
that will compute the prompt is credited with its blocks (predicted blocks) and counted as
one more active request (``WorkerState.pending``), so requests routed a moment later —
a simultaneous burst of one new prefix — follow it. Dispatch moves that credit when a
failure before the first byte sends the request elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from cortex.gateway.fleet.pool import WorkerState
from cortex.gateway.metrics import GatewayMetrics
from cortex.gateway.routing.predicted import Credit, PredictedBlocks

__all__ = ["KeysFor", "Placement"]

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
