"""The live worker pool: every registered worker with its health, breaker, load and ledger.

Pure state (no I/O): the registry watcher feeds specs in, probes and pollers write health
and engine load, the index client writes ledger states, routing reads candidates.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from enum import StrEnum

from cortex.gateway.breaker import CircuitBreaker
from cortex.gateway.config import BreakerConfig
from cortex.gateway.matching import LedgerState
from cortex.registry.spec import WorkerRole, WorkerSpec

__all__ = ["EngineLoad", "Health", "WorkerPool", "WorkerState"]

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
        self.inflight = 0  # requests open on it (a slot per attempt or PD leg)
        self.pending = 0  # routed here, not dispatched yet (see router.Placement)
        # uncached prompt tokens of this gateway's requests routed or sent here whose first
        # byte has not come back: the prefill work queued ahead of the next request
        self.prefilling = 0
        self.engine: EngineLoad | None = None
        self.ledger = LedgerState.UNSPECIFIED

    @property
    def id(self) -> str:
        return self.spec.id

    def routable(self) -> bool:
        """May a request go here now: healthy and its breaker admits it. Any role: routing
        picks regular workers, or a prefill and a decode worker for a PD pair."""
        return self.health is Health.HEALTHY and self.breaker.allows()

    def fresh_engine_load(self, now: float, stale_after_s: float) -> EngineLoad | None:
        load = self.engine
        return load if load is not None and now - load.at <= stale_after_s else None

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


def _servable(roles: set[WorkerRole]) -> bool:
    return WorkerRole.REGULAR in roles or {WorkerRole.PREFILL, WorkerRole.DECODE} <= roles


class WorkerPool:
    """Worker id → :class:`WorkerState`, reconciled against the registry's view."""

    def __init__(self, breaker: BreakerConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self._breaker = breaker
        self._clock = clock
        self._workers: dict[str, WorkerState] = {}
        self._roles: dict[str, set[WorkerRole]] = {}  # model -> roles registered
        self.version = 0

    def sync(self, specs: Mapping[str, WorkerSpec]) -> tuple[list[str], list[str]]:
        """Make the pool match ``specs``; returns (added ids, removed ids). A changed spec
        keeps the worker's health and counters unless its URL changed."""
        added = [wid for wid in specs if wid not in self._workers]
        removed = [wid for wid in self._workers if wid not in specs]
        for wid in removed:
            del self._workers[wid]
        for wid, spec in specs.items():
            state = self._workers.get(wid)
            if state is None or state.spec.url != spec.url:
                self._workers[wid] = WorkerState(spec, CircuitBreaker(self._breaker, self._clock))
            elif state.spec != spec:
                state.spec = spec
        if added or removed:
            self.version += 1
        roles: dict[str, set[WorkerRole]] = {}
        for state in self._workers.values():
            roles.setdefault(state.spec.model, set()).add(state.spec.role)
        self._roles = roles
        return added, removed

    def has_role(self, model: str, role: WorkerRole) -> bool:
        """Whether a worker of ``role`` serving ``model`` is registered (routable or not)."""
        return role in self._roles.get(model, ())

    def get(self, worker_id: str) -> WorkerState | None:
        return self._workers.get(worker_id)

    def __iter__(self) -> Iterator[WorkerState]:
        return iter(list(self._workers.values()))

    def __len__(self) -> int:
        return len(self._workers)

    def candidates(self, model: str, role: WorkerRole = WorkerRole.REGULAR
                   ) -> list[WorkerState]:
        """Routable workers of ``role`` serving ``model``."""
        return [w for w in self._workers.values()
                if w.spec.model == model and w.spec.role is role and w.routable()]

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
        return f"WorkerPool(workers={len(self._workers)}, healthy={healthy})"
