"""The live worker pool: every registered worker with its health, breaker, load and ledger.

Pure state (no I/O): the registry watcher feeds specs in, probes and pollers write health
and engine load, the index client writes ledger states, routing reads candidates.

Membership follows the registry with one exception that makes the fleet heal itself
(architecture §2): a worker whose entry vanished (Redis restarted empty, a lease nobody
renewed) stays while it is healthy here — the health monitor re-asserts its lease at the
next passing probe. A worker that leaves is *remembered* (its last spec) for
``forget_after_s`` so that it comes back when it answers again; a tombstone (an operator's
removal) drops it and its memory at once.

Per-worker circuit breaker (pure; the clock in seconds is injectable).
``CLOSED`` → ``OPEN`` after ``failures`` failures within ``window_s``; after ``open_s`` it is
``HALF_OPEN`` and admits one trial request at a time; ``half_open_successes`` successes in a
row close it, any failure re-opens it.

Wedged-worker detection (:mod:`cortex.gateway.dispatch.attempt`) reads
:attr:`WorkerState.worked_at` and :attr:`WorkerState.polled_at`, which the load poller keeps.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType

from cortex.gateway.config.gateway import BreakerConfig, ModelConfig
from cortex.ledger.model import LedgerState
from cortex.registry.engines import WorkMark
from cortex.registry.spec import WorkerRole, WorkerSpec

__all__ = ["BreakerState", "CircuitBreaker", "Eligible", "EngineLoad", "Health", "Remembered",
           "WorkerPool", "WorkerState"]


# ---- breaker ----


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


# ---- pool ----


WATERMARK_LABEL = "cortex/high-watermark"


class Health(StrEnum):
    UNKNOWN = "unknown"  # not probed yet
    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """What the engine reported (summed over DP ranks) and when (monotonic seconds)."""

    running: int
    waiting: int
    at: float


class WorkerState:
    """One worker as this gateway sees it."""

    def __init__(self, spec: WorkerSpec, breaker: CircuitBreaker) -> None:
        self.spec = spec
        self.breaker = breaker
        self.health = Health.UNKNOWN
        self.failures = 0  # consecutive failed probes
        self.successes = 0  # consecutive good probes
        self.last_probe_error: str | None = None
        self.failing_since: float | None = None  # monotonic s of the streak's first failure
        self.registered = True  # False: its registry entry vanished, its lease is re-asserted
        self.lease_kept_at: float | None = None  # monotonic s this gateway last kept its lease
        self.context_length: int | None = None  # tokens, as the engine reports it
        self.info_checked: float | None = None  # monotonic s of the last engine-info fetch
        self.adapters: frozenset[str] = frozenset()  # LoRA adapters its /v1/models lists
        self.engine_version: str | None = None  # vLLM /server_info (PD pairing)
        self.learned_lookahead: int | None = None  # SGLang /server_info (speculative decoding)
        # device KV blocks over its DP ranks (vLLM cache_config_info num_gpu_blocks, SGLang
        # /server_info max_total_num_tokens / page_size), read by the load poller
        self.kv_capacity: int | None = None
        # the load counters below are written only by this class's methods
        self.inflight = 0  # requests open on it (a slot per attempt or PD leg)
        self.pending = 0  # routed here, not dispatched yet (see router.Placement)
        # uncached prompt tokens of this gateway's requests routed or sent here whose first
        # byte has not come back: the prefill work queued ahead of the next request
        self.prefilling = 0
        self.engine: EngineLoad | None = None
        # the engine's work mark at its last answered load poll, and since when (monotonic
        # s) it is what it is: when that poll's mark differed from the one before
        self.work: WorkMark | None = None
        self.worked_at: float | None = None
        self.polled_at: float | None = None  # when the latest poll that ended was sent
        self.ledger = LedgerState.UNSPECIFIED
        # reconciling the engine's polled counts with what this gateway saw finish since:
        # requests are stamped with the number of load polls begun when they opened
        self._polls_begun = 0
        self._stored_poll = 0  # the poll ``engine`` came from
        self._done_since_stored = 0  # our requests open at that poll's start, finished since
        self._done_since_begun = 0  # the same for the poll in flight

    @property
    def id(self) -> str:
        return self.spec.id

    @property
    def kv_lookahead(self) -> int:
        """Tokens after a block its reuse needs: the spec's ``kv_lookahead``, else what the
        engine reported (0: none, or unknown)."""
        configured = self.spec.kv_lookahead
        if configured is not None:
            return configured
        return self.learned_lookahead or 0

    def routable(self) -> bool:
        """May a request go here now: healthy and its breaker admits it. Any role: routing
        picks regular workers, or a prefill and a decode worker for a PD pair."""
        return self.health is Health.HEALTHY and self.breaker.allows()

    def open_request(self) -> int:
        """One more request of ours open here; returns its stamp for :meth:`close_request`."""
        self.inflight += 1
        return self._polls_begun

    def hold(self, prefill_tokens: int = 0) -> None:
        """A request routed here and not dispatched yet, with the ``prefill_tokens`` it will
        compute (undone by :meth:`unhold`)."""
        self.pending += 1
        self.prefilling += prefill_tokens

    def unhold(self, prefill_tokens: int = 0) -> None:
        """The request :meth:`hold` counted was dispatched (or ended without a dispatch)."""
        self.pending -= 1
        self.prefilling -= prefill_tokens

    def queue_prefill(self, tokens: int) -> None:
        """``tokens`` of a prompt sent here wait to be computed until its first byte."""
        self.prefilling += tokens

    def prefill_started(self, tokens: int) -> None:
        """The prompt :meth:`queue_prefill` counted got its first byte (or failed)."""
        self.prefilling -= tokens

    def close_request(self, stamp: int) -> None:
        """A request opened with ``stamp`` ended (its response was read to the end, or
        dropped): the engine no longer runs it, whatever its last report said."""
        self.inflight -= 1
        if stamp < self._stored_poll:
            self._done_since_stored += 1
        if stamp < self._polls_begun:
            self._done_since_begun += 1

    def load_poll_begun(self) -> int:
        """A load poll is being sent; returns its number for :meth:`load_polled`."""
        self._polls_begun += 1
        self._done_since_begun = 0
        return self._polls_begun

    def load_polled(self, poll: int, running: int, waiting: int, at: float,
                    work: WorkMark | None = None) -> None:
        """Poll ``poll`` (sent at monotonic ``at``) answered, with the engine's ``work`` mark
        (``None``: not reported); a late answer of an older poll overtaken by a newer one is
        dropped."""
        if poll != self._polls_begun:
            return
        self.polled_at = at
        if work is not None:
            if self.work is not None and work != self.work:
                self.worked_at = at  # it computed something since the poll before
            self.work = work
        self.engine = EngineLoad(running, waiting, at)
        self._stored_poll = poll
        self._done_since_stored = self._done_since_begun

    def load_poll_failed(self, poll: int, at: float) -> None:
        """Poll ``poll`` (sent at monotonic ``at``) failed: it is still a look at the worker
        (the wedge watch's evidence of silence), though it says nothing of its load."""
        if poll == self._polls_begun:
            self.polled_at = at

    def fresh_engine_load(self, now: float, stale_after_s: float) -> EngineLoad | None:
        """The engine's last report unless stale, its running count less the requests of
        ours it was running that finished since the poll was sent (so a sequential
        client's next request does not see its previous one as still running)."""
        load = self.engine
        if load is None or now - load.at > stale_after_s:
            return None
        if self._done_since_stored:
            return EngineLoad(max(0, load.running - self._done_since_stored), load.waiting,
                              load.at)
        return load

    def watermark(self, default: int, overrides: Mapping[str, int]) -> int:
        if self.id in overrides:
            return overrides[self.id]
        label = self.spec.labels.get(WATERMARK_LABEL)
        if label is not None and label.isdigit() and int(label) > 0:
            return int(label)
        return default

    def __repr__(self) -> str:
        return (
            f"WorkerState({self.id}, {self.spec.engine.value}, {self.spec.role.value},"
            f" health={self.health.value}, breaker={self.breaker.state.value},"
            f" inflight={self.inflight}, prefilling={self.prefilling}, ledger={self.ledger.label})"
        )


@dataclass(frozen=True, slots=True)
class Remembered:
    """A worker that left the pool without a tombstone: its last spec, and since when
    (monotonic seconds) it is gone."""

    spec: WorkerSpec
    since: float


def _servable(roles: set[WorkerRole]) -> bool:
    return WorkerRole.REGULAR in roles or {WorkerRole.PREFILL, WorkerRole.DECODE} <= roles


@dataclass(frozen=True, slots=True)
class Eligible:
    """The workers one request may go to: ``regular`` ones, and ``pairs`` (prefill, decode)
    when its model is served disaggregated now (``None`` otherwise)."""

    regular: list[WorkerState]
    pairs: tuple[list[WorkerState], list[WorkerState]] | None

    def everyone(self) -> list[WorkerState]:
        if self.pairs is None:
            return self.regular
        return [*self.regular, *self.pairs[0], *self.pairs[1]]


class WorkerPool:
    """Worker id → :class:`WorkerState`, reconciled against the registry's view."""

    def __init__(self, breaker: BreakerConfig, clock: Callable[[], float] = time.monotonic, *,
                 forget_after_s: float = 3600.0) -> None:
        self._breaker = breaker
        self._clock = clock
        self.forget_after_s = forget_after_s
        self._workers: dict[str, WorkerState] = {}
        self._roles: dict[str, set[WorkerRole]] = {}  # model -> roles registered
        self._remembered: dict[str, Remembered] = {}
        # learned from re-assertions (id -> monotonic s), until a later view registers it
        self._tombstoned: dict[str, float] = {}
        self.version = 0

    def sync(self, specs: Mapping[str, WorkerSpec], tombstones: Collection[str] = (),
             taken_at: float | None = None) -> tuple[list[str], list[str]]:
        """Follow the registry view ``specs`` (with its ``tombstones``, requested at
        monotonic ``taken_at``, default now); returns (added ids, removed ids). A changed
        spec keeps the worker's health and counters unless its URL changed. A worker
        missing from ``specs`` stays while it is healthy and not tombstoned (see the module
        docstring); one that leaves is remembered."""
        now = self._clock()
        taken = now if taken_at is None else taken_at
        for wid in [w for w, at in self._tombstoned.items() if w in specs and taken > at]:
            del self._tombstoned[wid]  # registered again after its removal
        gone = set(tombstones) | self._tombstoned.keys()
        specs = {wid: spec for wid, spec in specs.items() if wid not in gone}
        added = [wid for wid in specs if wid not in self._workers]
        removed: list[str] = []
        for wid, member in list(self._workers.items()):
            if wid in specs:
                continue
            if wid not in gone and member.health is Health.HEALTHY:
                member.registered = False  # kept: the health monitor re-asserts the lease
                continue
            removed.append(wid)
            del self._workers[wid]
            if wid not in gone and self.forget_after_s > 0:
                self._remembered.setdefault(wid, Remembered(member.spec, now))
        for wid, spec in specs.items():
            self._remembered.pop(wid, None)
            state = self._workers.get(wid)
            if state is None or state.spec.url != spec.url:
                self._workers[wid] = WorkerState(spec, CircuitBreaker(self._breaker, self._clock))
            else:
                state.registered = True
                if state.spec != spec:
                    state.spec = spec
        for wid in [wid for wid, r in self._remembered.items()
                    if wid in gone or now - r.since > self.forget_after_s]:
            del self._remembered[wid]
        if added or removed:
            self.version += 1
        roles: dict[str, set[WorkerRole]] = {}
        for state in self._workers.values():
            roles.setdefault(state.spec.model, set()).add(state.spec.role)
        self._roles = roles
        return added, removed

    def mark_tombstoned(self, worker_id: str) -> None:
        """An operator removed ``worker_id`` (a re-assertion found its tombstone): the next
        :meth:`sync` drops it for good, until it is registered again."""
        self._tombstoned[worker_id] = self._clock()
        self._remembered.pop(worker_id, None)

    def forget(self, worker_id: str) -> None:
        """Stop probing a remembered worker for its return."""
        self._remembered.pop(worker_id, None)

    @property
    def remembered(self) -> Mapping[str, Remembered]:
        """Workers that left without a tombstone, probed for their return (read-only)."""
        return MappingProxyType(self._remembered)

    def has_role(self, model: str, role: WorkerRole) -> bool:
        """Whether a worker of ``role`` serving ``model`` is registered (routable or not)."""
        return role in self._roles.get(model, ())

    def get(self, worker_id: str) -> WorkerState | None:
        return self._workers.get(worker_id)

    def __iter__(self) -> Iterator[WorkerState]:
        return iter(list(self._workers.values()))

    def __len__(self) -> int:
        return len(self._workers)

    def eligible(self, model: ModelConfig, adapter: str | None = None,
                 allowed: Collection[str] | None = None, *, pd: bool = False) -> Eligible:
        """The routable workers of ``model`` a request may go to, in one pass: those serving
        ``adapter`` (configured for the model, or listed by the worker; any without one),
        among ``allowed`` (``None``: all). With ``pd``, when the model has prefill and
        decode workers registered (routable or not), its prefill and decode workers of the
        model's engine form :attr:`Eligible.pairs` if neither side is empty."""
        any_adapter = adapter is None or adapter in model.adapters
        by_role: dict[WorkerRole, list[WorkerState]] = {role: [] for role in WorkerRole}
        for w in self._workers.values():
            if (w.spec.model == model.name and w.routable()
                    and (allowed is None or w.id in allowed)
                    and (any_adapter or adapter in w.adapters)):
                by_role[w.spec.role].append(w)
        pairs = None
        registered = self._roles.get(model.name, ())
        if pd and WorkerRole.PREFILL in registered and WorkerRole.DECODE in registered:
            prefill = [w for w in by_role[WorkerRole.PREFILL] if w.spec.engine is model.engine]
            decode = [w for w in by_role[WorkerRole.DECODE] if w.spec.engine is model.engine]
            pairs = (prefill, decode) if prefill and decode else None
        return Eligible(by_role[WorkerRole.REGULAR], pairs)

    def candidates(self, model: str, role: WorkerRole = WorkerRole.REGULAR
                   ) -> list[WorkerState]:
        """Routable workers of ``role`` serving ``model``."""
        return [w for w in self._workers.values()
                if w.spec.model == model and w.spec.role is role and w.routable()]

    def context_length(self, model: str) -> int | None:
        """The smallest context length (tokens) the engines of ``model``'s workers reported,
        ``None`` when none did."""
        known = [w.context_length for w in self._workers.values()
                 if w.spec.model == model and w.context_length is not None]
        return min(known) if known else None

    def adapter_base(self, name: str) -> str | None:
        """The base model of a LoRA adapter some worker lists (``None``: nobody does)."""
        return next((w.spec.model for w in self._workers.values() if name in w.adapters),
                    None)

    def models(self) -> list[str]:
        """Models with a registered regular worker, or a prefill and a decode worker, sorted."""
        roles: dict[str, set[WorkerRole]] = {}
        for w in self._workers.values():
            roles.setdefault(w.spec.model, set()).add(w.spec.role)
        return sorted(model for model, have in roles.items() if _servable(have))

    def servable(self) -> bool:
        """Can some model be served now: a routable regular worker, or a routable prefill and
        decode worker of one model."""
        roles: dict[str, set[WorkerRole]] = {}
        for w in self._workers.values():
            if w.routable():
                roles.setdefault(w.spec.model, set()).add(w.spec.role)
        return any(_servable(have) for have in roles.values())

    def __repr__(self) -> str:
        healthy = sum(1 for w in self._workers.values() if w.health is Health.HEALTHY)
        return (f"WorkerPool(workers={len(self._workers)}, healthy={healthy}, "
                f"remembered={len(self._remembered)})")
