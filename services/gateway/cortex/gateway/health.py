"""Worker health probes; each passing probe renews the worker's registry lease.

A worker becomes ``HEALTHY`` after ``healthy_after`` passing probes in a row and
``UNHEALTHY`` after ``unhealthy_after`` failures in a row. The lease is renewed by whichever
gateway replica can reach the worker: when none can, the lease expires and every service
drops the worker (architecture §2).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

import aiohttp

from cortex.gateway.config import HealthConfig
from cortex.gateway.metrics import GatewayMetrics
from cortex.gateway.pool import Health, WorkerPool, WorkerState
from cortex.registry import Registry, RegistryUnavailable

__all__ = ["HealthMonitor"]

log = logging.getLogger(__name__)


class HealthMonitor:
    """Probes ``GET <url>/health`` of every worker in the pool each ``interval_s``."""

    def __init__(
        self,
        pool: WorkerPool,
        session: aiohttp.ClientSession,
        registry: Registry,
        config: HealthConfig,
        lease_ttl_s: float,
        metrics: GatewayMetrics,
    ) -> None:
        self.pool = pool
        self.session = session
        self.registry = registry
        self.config = config
        self.lease_ttl_s = lease_ttl_s
        self.metrics = metrics

    async def run(self) -> None:
        while True:
            await self.probe_all(list(self.pool))
            await asyncio.sleep(self.config.interval_s)

    async def probe_all(self, workers: Iterable[WorkerState]) -> None:
        await asyncio.gather(*(self.probe(w) for w in workers))
        self.publish()

    async def probe(self, worker: WorkerState) -> bool:
        """Probe once, update the worker's health, renew its lease on success."""
        error = await self._check(worker)
        if error is None:
            self.metrics.probes.labels(result="ok").inc()
            worker.failures = 0
            worker.successes += 1
            worker.last_probe_error = None
            healthy = worker.successes >= self.config.healthy_after
            if worker.health is not Health.HEALTHY and healthy:
                log.info("worker healthy worker=%s", worker.id, extra={"worker": worker.id})
                worker.health = Health.HEALTHY
            await self._renew(worker)
            return True
        self.metrics.probes.labels(result="error").inc()
        worker.successes = 0
        worker.failures += 1
        worker.last_probe_error = error
        if worker.health is not Health.UNHEALTHY and (
            worker.failures >= self.config.unhealthy_after or worker.health is Health.UNKNOWN
        ):
            log.warning("worker unhealthy worker=%s: %s", worker.id, error,
                        extra={"worker": worker.id})
            worker.health = Health.UNHEALTHY
            worker.engine = None
        return False

    async def _check(self, worker: WorkerState) -> str | None:
        url = worker.spec.url.rstrip("/") + "/health"
        try:
            async with asyncio.timeout(self.config.timeout_s):
                async with self.session.get(url) as resp:
                    await resp.read()
                    return None if resp.status == 200 else f"status {resp.status}"
        except TimeoutError:
            return "timeout"
        except aiohttp.ClientError as exc:
            return type(exc).__name__

    async def _renew(self, worker: WorkerState) -> None:
        try:
            renewed = await self.registry.renew(worker.id, self.lease_ttl_s)
        except RegistryUnavailable:
            self.metrics.lease_renewals.labels(result="unavailable").inc()
            return
        # gone: removed by an operator or expired; the watcher drops it, we do not resurrect
        self.metrics.lease_renewals.labels(result="ok" if renewed else "gone").inc()

    def publish(self) -> None:
        counts = dict.fromkeys(Health, 0)
        for w in self.pool:
            counts[w.health] += 1
            self.metrics.worker_healthy.labels(worker=w.id).set(w.health is Health.HEALTHY)
            self.metrics.worker_breaker_open.labels(worker=w.id).set(not w.breaker.allows())
        for health, count in counts.items():
            self.metrics.workers.labels(health=health.value).set(count)

    def __repr__(self) -> str:
        return f"HealthMonitor(workers={len(self.pool)}, interval_s={self.config.interval_s})"
