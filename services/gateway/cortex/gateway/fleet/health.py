"""Worker health probes, and the leases they vouch for (architecture §2: the fleet heals).

A worker becomes ``HEALTHY`` after ``healthy_after`` passing probes in a row and
``UNHEALTHY`` after ``unhealthy_after`` failures in a row. What a probe means for the
worker's registry lease (:func:`lease_action`):

* a passing probe **re-asserts** the lease: it is extended, or written again from the
  worker's last known spec when it vanished (Redis restarted empty, a lapsed lease) —
  unless an operator removed the worker (a tombstone), which drops it here for good;
* a probe that timed out while this gateway has requests open on the worker proves nothing
  (a busy engine answers late: one long prompt must not remove it) and renews the lease;
* failed probes keep renewing it for ``remove_after_s`` after the first failure of the
  streak; then this gateway stops, and once no replica renews it the lease lapses and every
  service drops the worker;
* workers that left (remembered by the pool) are probed too: one that answers again is
  re-asserted with its last spec and comes back.

A gateway writes a registered worker's lease at most every quarter of the lease's TTL
(:meth:`HealthMonitor.lease_due`), not at every probe: probes come every second, leases
last 10 s by default, and every gateway keeps every worker's lease. A worker whose entry
vanished from the registry view is re-asserted at its next passing probe.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from enum import StrEnum

from cortex.gateway.config.gateway import HealthConfig
from cortex.gateway.fleet.engine_info import (
    fetch_engine_info,
    fetch_sglang_lookahead,
    fetch_vllm_version,
)
from cortex.gateway.fleet.pool import Health, Remembered, WorkerPool, WorkerState
from cortex.gateway.metrics import GatewayMetrics
from cortex.gateway.upstream.client import UpstreamClient
from cortex.gateway.upstream.errors import FailureKind, UpstreamFailure
from cortex.hashing import Engine
from cortex.registry import Assertion, Registry, RegistryUnavailable, WorkerSpec
from cortex.registry.spec import WorkerRole

__all__ = ["HealthMonitor", "LeaseAction", "ProbeResult", "lease_action"]

log = logging.getLogger(__name__)

INFO_RETRY_S = 30.0
"""A healthy worker that did not report its context length is asked again this often (s)."""


class ProbeResult(StrEnum):
    OK = "ok"
    ERROR = "error"
    BUSY = "busy"  # timed out while this gateway has requests open on the worker


class LeaseAction(StrEnum):
    REASSERT = "reassert"  # renew, or write the spec again when the entry vanished
    RENEW = "renew"  # extend an existing lease only
    NONE = "none"  # let it lapse


def lease_action(worker: WorkerState, result: ProbeResult, now: float,
                 remove_after_s: float) -> LeaseAction:
    """What a probe ``result`` (already applied to ``worker``) does to its lease."""
    if result is ProbeResult.OK:
        return LeaseAction.REASSERT
    if result is ProbeResult.BUSY:
        return LeaseAction.RENEW
    since = worker.failing_since
    if since is not None and now - since < remove_after_s:
        return LeaseAction.RENEW
    return LeaseAction.NONE


class HealthMonitor:
    """Probes ``GET <url>/health`` of every worker in the pool, and of the remembered ones,
    each ``interval_s``. ``on_round``: called after each round (the owner reconciles the
    pool); ``on_return``: a lease was written again (the owner polls the registry now)."""

    def __init__(
        self,
        pool: WorkerPool,
        upstream: UpstreamClient,
        registry: Registry,
        config: HealthConfig,
        lease_ttl_s: float,
        metrics: GatewayMetrics,
        on_round: Callable[[], object] = lambda: None,
        on_return: Callable[[], object] = lambda: None,
        auth: Callable[[WorkerSpec], Mapping[str, str]] = lambda spec: {},
    ) -> None:
        self.pool = pool
        self.upstream = upstream
        self._auth = auth  # a worker's credential headers
        self.registry = registry
        self.config = config
        self.lease_ttl_s = lease_ttl_s
        self.metrics = metrics
        self._on_round = on_round
        self._on_return = on_return

    async def run(self) -> None:
        """A round every ``interval_s`` (a round of slow probes delays the next one only
        by what it took beyond the interval)."""
        while True:
            started = time.monotonic()
            await self.probe_round()
            await asyncio.sleep(max(0.0, self.config.interval_s - (time.monotonic() - started)))

    async def probe_round(self) -> None:
        """Probe every worker of the pool and every remembered one, once."""
        await asyncio.gather(*(self.probe(w) for w in self.pool),
                             *(self.probe_return(r) for r in self.pool.remembered.values()))
        self.publish()
        self._on_round()

    async def probe_all(self, workers: Iterable[WorkerState]) -> None:
        await asyncio.gather(*(self.probe(w) for w in workers))
        self.publish()

    async def probe(self, worker: WorkerState) -> bool:
        """Probe once, update the worker's health, act on its lease; ``True`` if it passed."""
        result, error = await self._check(worker.spec, busy=worker.inflight > 0)
        now = time.monotonic()
        self.metrics.probes.labels(result=result.value).inc()
        if result is ProbeResult.OK:
            worker.failures = 0
            worker.successes += 1
            worker.failing_since = None
            worker.last_probe_error = None
            if worker.health is not Health.HEALTHY and (
                    worker.successes >= self.config.healthy_after):
                log.info("worker healthy worker=%s", worker.id, extra={"worker": worker.id})
                worker.health = Health.HEALTHY
                worker.info_checked = None  # it may have restarted with other limits
        elif result is ProbeResult.ERROR:
            worker.successes = 0
            worker.failures += 1
            worker.failing_since = worker.failing_since or now
            worker.last_probe_error = error
            if worker.health is not Health.UNHEALTHY and (
                worker.failures >= self.config.unhealthy_after or worker.health is Health.UNKNOWN
            ):
                log.warning("worker unhealthy worker=%s: %s", worker.id, error,
                            extra={"worker": worker.id})
                worker.health = Health.UNHEALTHY
                worker.engine = None
        else:
            worker.last_probe_error = error  # busy: no verdict either way
        action = lease_action(worker, result, now, self.config.remove_after_s)
        if action is not LeaseAction.NONE and self.lease_due(worker, now):
            kept = (await self._reassert(worker.spec, returning=not worker.registered)
                    if action is LeaseAction.REASSERT else await self._renew(worker))
            worker.lease_kept_at = now if kept else None
        if result is ProbeResult.OK:
            await self._learn_limits(worker, now)
        return result is ProbeResult.OK

    async def probe_return(self, gone: Remembered) -> bool:
        """Probe a worker that left; if it answers, bring it back with its last spec."""
        spec = gone.spec
        result, _ = await self._check(spec, busy=False)
        if result is not ProbeResult.OK:
            return False
        if any(w.spec.url == spec.url for w in self.pool):
            # its address now belongs to another registered worker: never resurrect a twin
            log.info("forgetting worker=%s: its URL is now another worker's", spec.id,
                     extra={"worker": spec.id})
            self.pool.forget(spec.id)
            return False
        return await self._reassert(spec, returning=True)

    async def _check(self, spec: WorkerSpec, *, busy: bool) -> tuple[ProbeResult, str | None]:
        url = spec.url.rstrip("/") + "/health"
        try:
            async with asyncio.timeout(self.config.timeout_s):
                status, _ = await self.upstream.get(url, self._auth(spec))
        except TimeoutError:
            return (ProbeResult.BUSY if busy else ProbeResult.ERROR), "timeout"
        except UpstreamFailure as exc:
            if exc.kind is FailureKind.TIMEOUT:  # connecting timed out
                return (ProbeResult.BUSY if busy else ProbeResult.ERROR), "timeout"
            return ProbeResult.ERROR, str(exc)  # e.g. "connect: ConnectionRefusedError"
        if status == 200:
            return ProbeResult.OK, None
        return ProbeResult.ERROR, f"status {status}"

    async def _reassert(self, spec: WorkerSpec, *, returning: bool) -> bool:
        """Renew ``spec``'s lease or write it again; ``True`` unless it is tombstoned or the
        registry is unreachable."""
        try:
            outcome = await self.registry.reassert(spec, self.lease_ttl_s)
        except RegistryUnavailable:
            self.metrics.lease_renewals.labels(result="unavailable").inc()
            return False
        self.metrics.lease_renewals.labels(result=outcome.value).inc()
        if outcome is Assertion.TOMBSTONED:
            log.info("worker=%s was removed by an operator: dropped", spec.id,
                     extra={"worker": spec.id})
            self.pool.mark_tombstoned(spec.id)
            self._on_round()
            return False
        if outcome is Assertion.CREATED or returning:
            log.info("worker=%s answers: lease %s", spec.id, outcome.value,
                     extra={"worker": spec.id})
            self._on_return()
        return True

    def lease_due(self, worker: WorkerState, now: float) -> bool:
        """Whether a probe of ``worker`` should write its lease: a quarter of the TTL has
        passed since this gateway last kept it, or its entry is not in the registry view
        (or the lease never expires: then every probe, as before leases had TTLs)."""
        kept = worker.lease_kept_at
        return (kept is None or not worker.registered or self.lease_ttl_s <= 0
                or now - kept >= self.lease_ttl_s / 4)

    async def _renew(self, worker: WorkerState) -> bool:
        """Extend ``worker``'s lease; ``True`` when it was."""
        try:
            renewed = await self.registry.renew(worker.id, self.lease_ttl_s)
        except RegistryUnavailable:
            self.metrics.lease_renewals.labels(result="unavailable").inc()
            return False
        self.metrics.lease_renewals.labels(result="renewed" if renewed else "gone").inc()
        return renewed

    async def _learn_limits(self, worker: WorkerState, now: float) -> None:
        """The engine's context length (until known) and LoRA adapters (every
        ``INFO_RETRY_S``: engines load and unload adapters at run time)."""
        checked = worker.info_checked
        spec = worker.spec
        wants_version = (spec.engine is Engine.VLLM and spec.role is not WorkerRole.REGULAR
                         and worker.engine_version is None)
        wants_lookahead = (spec.engine is Engine.SGLANG and spec.kv_lookahead is None
                           and worker.learned_lookahead is None)
        if checked is not None and now - checked < INFO_RETRY_S:
            return
        worker.info_checked = now
        info = await fetch_engine_info(self.upstream.session, spec, self.config.timeout_s,
                                       self._auth(spec))
        found = info.context_length
        if worker.context_length is None or found is not None:
            if found != worker.context_length:
                log.info("worker=%s context length %s tokens", worker.id, found,
                         extra={"worker": worker.id})
            worker.context_length = found
        if info.adapters is not None and info.adapters != worker.adapters:
            log.info("worker=%s serves LoRA adapters %s", worker.id, sorted(info.adapters),
                     extra={"worker": worker.id})
            worker.adapters = info.adapters
        if wants_lookahead:
            found_lookahead = await fetch_sglang_lookahead(self.upstream.session, spec,
                                                           self.config.timeout_s,
                                                           self._auth(spec))
            if found_lookahead:
                log.info("worker=%s runs EAGLE (kv lookahead %d, from /server_info)", worker.id,
                         found_lookahead, extra={"worker": worker.id})
            worker.learned_lookahead = found_lookahead
        if wants_version:
            worker.engine_version = await fetch_vllm_version(self.upstream.session, spec,
                                                             self.config.timeout_s,
                                                             self._auth(spec))

    def publish(self) -> None:
        counts = dict.fromkeys(Health, 0)
        m = self.metrics
        for w in self.pool:
            counts[w.health] += 1
            m.worker(m.worker_healthy, w.id).set(w.health is Health.HEALTHY)
            m.worker(m.worker_breaker_open, w.id).set(not w.breaker.allows())
        for health, count in counts.items():
            m.workers.labels(health=health.value).set(count)
        m.remembered_workers.set(len(self.pool.remembered))

    def __repr__(self) -> str:
        return f"HealthMonitor(workers={len(self.pool)}, interval_s={self.config.interval_s})"
