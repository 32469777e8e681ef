"""The attempt plans of dispatch: pure, synchronous, socket-free.

A plan says where each attempt of a request goes and what the request's failures add up to;
the dispatcher (:mod:`cortex.gateway.dispatch.dispatcher`,
:mod:`cortex.gateway.dispatch.pd.dispatcher`) does the I/O in between and reports each outcome
back. A plan also moves the request's
:class:`~cortex.gateway.routing.router.Placement` (its predicted blocks) with the attempts.

* :class:`AttemptPlan` (a regular request): the decision's ranking in order, skipping
  workers not routable, at most ``max_attempts`` tries; the verdict when none answered is
  503 (nothing was routable), the busy status with ``Retry-After`` (every attempt answered
  429 / 503), 504 (the last one timed out) or 502.
* :class:`PairPlan` (a disaggregated request): the best prefill not failed yet (cache
  affinity) with the least loaded decode not failed yet whose KV connectors can talk; a
  decode that fails after its prefill succeeded (the KV was handed over and lost) ends the
  pairs; the verdict then is the cold fallback on a regular worker when there is one, else
  the error of the side that failed last.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol

from cortex.gateway.config.gateway import PDConfig
from cortex.gateway.errors import ErrorCode, GatewayError, ServiceUnavailable, UpstreamError
from cortex.gateway.fleet.pool import WorkerState
from cortex.gateway.routing.scoring import LocalPrefill, PairDecision, Scored, compatible_pair
from cortex.gateway.upstream.client import FailureKind, UpstreamFailure

__all__ = ["BUSY_STATUSES", "AttemptPlan", "Fallback", "LegFailure", "Pair", "PairPlan", "Side",
           "Workers", "all_busy"]

BUSY_STATUSES = (429, 503)
"""A worker answering these is busy, not broken: when every attempt got one, so does the
client (with ``Retry-After``)."""

Workers = Callable[[str], WorkerState | None]
"""A worker by id (``WorkerPool.get``)."""


class Credit(Protocol):
    """Where the request's predicted blocks are
    (:class:`~cortex.gateway.routing.router.Placement`)."""

    def move(self, worker_id: str) -> None: ...

    def withdraw(self) -> None: ...


def all_busy(answers: list[tuple[int | None, float | None]]) -> ServiceUnavailable:
    """Every attempt was answered 429 / 503 (``(status, retry_after_s)`` each): the client
    gets the same, with the longest ``Retry-After`` a worker asked for (1 s when none did)."""
    status = 429 if all(code == 429 for code, _ in answers) else 503
    retry = max((after for _, after in answers if after is not None), default=1.0)
    code = ErrorCode.RATE_LIMITED if status == 429 else ErrorCode.OVERLOADED
    return ServiceUnavailable("every worker is busy; retry later", code=code, status=status,
                              retry_after_s=retry)


class AttemptPlan:
    """A regular request's attempts over ``ranked``: :meth:`next` gives the next worker
    (and moves the placement there), :meth:`answered` / :meth:`failed` take its outcome,
    :meth:`verdict` is the error once :meth:`next` gave ``None``."""

    __slots__ = ("_index", "_workers", "attempts", "busy", "last", "max_attempts",
                 "placement", "ranked")

    def __init__(self, ranked: Sequence[Scored], workers: Workers, max_attempts: int,
                 placement: Credit) -> None:
        self.ranked = ranked
        self._workers = workers
        self.max_attempts = max_attempts
        self.placement = placement
        self._index = 0
        self.attempts = 0
        self.last: UpstreamFailure | None = None
        self.busy: list[UpstreamFailure] = []  # attempts answered 429 / 503

    def next(self) -> tuple[WorkerState, Scored] | None:
        """The next routable worker of the ranking, or ``None`` (ranking or budget spent)."""
        if self.attempts >= self.max_attempts:
            return None
        ranked = self.ranked
        while self._index < len(ranked):
            scored = ranked[self._index]
            self._index += 1
            worker = self._workers(scored.worker_id)
            if worker is None or not worker.routable():
                continue
            self.attempts += 1
            self.placement.move(worker.id)
            return worker, scored
        return None

    @property
    def retry_reason(self) -> str | None:
        """Why the attempt :meth:`next` gave is a retry (the previous failure's kind), or
        ``None`` for the first one."""
        if self.attempts <= 1:
            return None
        return self.last.kind.value if self.last is not None else "unknown"

    def answered(self, status: int) -> None:
        """The worker answered ``status``; anything but 200 refused the request: the prompt
        is not computed there."""
        if status != 200:
            self.placement.withdraw()

    def failed(self, failure: UpstreamFailure) -> None:
        self.placement.withdraw()
        self.last = failure
        if failure.status in BUSY_STATUSES:
            self.busy.append(failure)

    def verdict(self) -> GatewayError:
        last = self.last
        if last is None:
            return ServiceUnavailable("no available worker for this request")
        if len(self.busy) == self.attempts:
            return all_busy([(f.status, f.retry_after_s) for f in self.busy])
        if last.kind is FailureKind.TIMEOUT:
            return UpstreamError("the worker did not answer in time",
                                 code=ErrorCode.UPSTREAM_TIMEOUT, status=504)
        return UpstreamError("the worker failed to answer")

    def __repr__(self) -> str:
        return f"AttemptPlan(attempts={self.attempts}/{self.max_attempts}, last={self.last})"


class Side(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True, slots=True)
class LegFailure:
    """A failed attempt: which side failed, how (a :class:`FailureKind` value or
    ``error_event``), and whether the prefill had already succeeded (KV handed over);
    ``status`` / ``retry_after_s``: what a worker that refused it answered."""

    side: Side
    worker: str
    kind: str
    timeout: bool = False
    prefill_ok: bool = False
    detail: str = ""
    status: int | None = None
    retry_after_s: float | None = None


@dataclass(frozen=True, slots=True)
class Fallback:
    """The pairs are spent: run the request cold on a regular worker (``reason``:
    ``prefill_failed`` | ``decode_failed`` | ``no_pair``)."""

    reason: str


@dataclass(frozen=True, slots=True)
class Pair:
    """An attempt's pair; ``local``: why the decode worker prefills itself (no prefill
    leg), ``None`` when the prefill worker does."""

    prefill: Scored
    decode: Scored
    local: LocalPrefill | None


@dataclass(eq=False)
class PairPlan:
    """A disaggregated request's attempts: :meth:`next` gives a pair (and the refusals of
    incompatible pairs met on the way), :meth:`answered` / :meth:`failed` take its outcome,
    :meth:`verdict` decides between the fallback and an error."""

    plan: PairDecision
    workers: Workers
    config: PDConfig
    placement: Credit
    attempts: int = 0
    failed_prefill: set[str] = field(default_factory=set)
    failed_decode: set[str] = field(default_factory=set)
    failures: list[LegFailure] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    _done: bool = False  # the KV was lost after a handoff: no further pair

    def next(self) -> tuple[Pair | None, list[tuple[str, str, str]]]:
        """The next pair (``None``: none left, or the budget is spent) and the pairs refused
        on the way as ``(prefill id, decode id, why)``."""
        if self._done or self.attempts >= self.config.max_attempts:
            return None, []
        plan = self.plan
        found, refusals = compatible_pair(self._usable(plan.prefill.ranked, self.failed_prefill),
                                          self._usable(plan.decode.ranked, self.failed_decode))
        self.refused += [why for _, _, why in refusals]
        if found is None:
            return None, refusals
        prefill, decode = found
        computes, local = plan.computes(prefill, decode, self.config)
        self.attempts += 1
        self.placement.move(computes.worker_id)
        return Pair(prefill, decode, local), refusals

    def _usable(self, ranked: Sequence[Scored], failed: set[str]
                ) -> list[tuple[Scored, WorkerState]]:
        workers = ((scored, self.workers(scored.worker_id)) for scored in ranked
                   if scored.worker_id not in failed)
        return [(scored, w) for scored, w in workers if w is not None and w.routable()]

    @property
    def last(self) -> LegFailure | None:
        return self.failures[-1] if self.failures else None

    def answered(self, status: int) -> None:
        """A leg's answer went to the client; a refusal (not 200): the prompt is not
        computed where it is credited."""
        if status != 200:
            self.placement.withdraw()

    def failed(self, failure: LegFailure) -> None:
        if not failure.prefill_ok:  # the prompt was not computed where it is credited
            self.placement.withdraw()
        self.failures.append(failure)
        (self.failed_prefill if failure.side is Side.PREFILL else self.failed_decode).add(
            failure.worker)
        if failure.side is Side.DECODE and failure.prefill_ok:
            self._done = True  # the KV was handed over and lost: no second pair

    def verdict(self) -> Fallback | GatewayError:
        """The fallback when the model has regular workers and it is allowed, else the
        client's error."""
        last = self.last
        if self.plan.fallback is not None and self.config.fallback_to_regular:
            return Fallback(f"{last.side.value}_failed" if last is not None else "no_pair")
        if last is None:
            if self.refused:
                return ServiceUnavailable("no prefill/decode pair with compatible KV"
                                          f" connectors: {self.refused[-1]}")
            return ServiceUnavailable("no available prefill/decode pair for this request")
        if all(f.status in BUSY_STATUSES for f in self.failures):
            return all_busy([(f.status, f.retry_after_s) for f in self.failures])
        if last.side is Side.PREFILL:
            code, message = ErrorCode.PREFILL_SERVER_ERROR, "the prefill worker failed"
        else:
            code, message = ErrorCode.DECODE_SERVER_ERROR, "the decode worker failed"
        if last.timeout:
            message += " to answer in time"
        return UpstreamError(message, code=code, status=504 if last.timeout else 502)
