"""``PodDiscovery``: keep the registry's leases equal to the Ready pods (the async shell).

Two loops. The watch loop lists the pods, then follows a watch from the list's
``resourceVersion`` (resumed from the last event or bookmark when the server ends it),
lists again on ``410 Gone`` and backs off on errors, keeping what it knew. The reconcile
loop, woken by every change and every third of a lease, lists the registry and applies
:func:`~cortex.registry.kubernetes.reconcile.plan`. Routing never learns where a worker came
from: the gateways and ingest watch the registry as for any other worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from types import TracebackType
from typing import Any

from cortex.edge.tasks import stop_tasks
from cortex.registry.base import Registry
from cortex.registry.engine_probe import discover
from cortex.registry.errors import RegistryUnavailable
from cortex.registry.kubernetes.api import PodApi
from cortex.registry.kubernetes.config import DiscoveryConfig
from cortex.registry.kubernetes.errors import KubernetesUnavailable, ResourceVersionGone
from cortex.registry.kubernetes.metrics import DiscoveryMetrics
from cortex.registry.kubernetes.pods import NotWorker, PodTable, pod_url, ready_reason
from cortex.registry.kubernetes.reconcile import REMOVAL_REASON, Plan, plan

__all__ = ["PodDiscovery"]

log = logging.getLogger(__name__)


class PodDiscovery:
    """Use as ``async with PodDiscovery(api, registry, config) as discovery:``."""

    def __init__(self, api: PodApi, registry: Registry, config: DiscoveryConfig,
                 metrics: DiscoveryMetrics | None = None) -> None:
        self.api = api
        self.registry = registry
        self.config = config
        self.metrics = metrics or DiscoveryMetrics()
        self.table = PodTable(config.discovered_by)
        self.listed = False  # a list has succeeded since start
        self.reconciled = False  # the last reconciliation reached the registry
        self.reconciliations = 0
        self.last_plan = Plan()
        self._previous: set[str] = set()
        # pod name -> ((uid, url) asked, the fields its engine reported)
        self._learned: dict[str, tuple[tuple[str, str], Mapping[str, Any]]] = {}
        self._invalid_logged: dict[str, str] = {}
        self._wake = asyncio.Event()
        self._done = asyncio.Condition()
        self._tasks: list[asyncio.Task[None]] = []

    def __repr__(self) -> str:
        return (f"PodDiscovery(namespace={self.config.namespace!r}, "
                f"selector={self.config.selector!r}, {self.table!r}, "
                f"reconciliations={self.reconciliations}, ready={self.ready})")

    @property
    def ready(self) -> bool:
        return self.listed and self.reconciled

    async def __aenter__(self) -> PodDiscovery:
        self._tasks = [asyncio.create_task(self._watch_loop(), name="discovery-watch"),
                       asyncio.create_task(self._reconcile_loop(), name="discovery-reconcile")]
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        tasks, self._tasks = self._tasks, []
        await stop_tasks(tasks)

    async def wait_reconciled(self, count: int, timeout_s: float | None = None) -> int:
        """Wait until more than ``count`` reconciliations have finished; return the count."""
        async with self._done:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout_s):
                    await self._done.wait_for(lambda: self.reconciliations > count)
            return self.reconciliations

    # ---- the watch ----

    async def _watch_loop(self) -> None:
        backoff = 0.5
        need_list, reason = True, "start"
        while True:
            try:
                if need_list:
                    pods, version = await self.api.list()
                    self.metrics.lists.labels(reason).inc()
                    self.table.reset(pods, version)
                    self.listed, need_list = True, False
                    self._wake.set()
                async for event in self.api.watch(self.table.resource_version):
                    self.metrics.events.labels(event.kind).inc()
                    if self.table.apply(event.kind, event.obj):
                        self._wake.set()
                backoff = 0.5  # the server ended the watch: resume from the last version
            except ResourceVersionGone:
                log.info("pod watch: resourceVersion %s expired; listing again",
                         self.table.resource_version)
                need_list, reason = True, "gone"
            except KubernetesUnavailable as exc:
                self.metrics.api_errors.inc()
                log.warning("kubernetes API: %s; retrying in %.1f s (keeping %d pods)",
                            exc, backoff, len(self.table))
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.config.backoff_max_s)

    # ---- the registry ----

    async def _reconcile_loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.config.lease_ttl_s / 3):
                    await self._wake.wait()
            self._wake.clear()
            if not self.listed:
                continue
            try:
                await self.reconcile()
            except Exception:  # a bug must not stop the leases: log, retry next period
                log.exception("reconciliation failed")

    async def learn(self) -> dict[str, Mapping[str, Any]]:
        """With ``learn_from_engines``: ask each Ready pod's engine about itself, once per
        pod and address (a failed ask is repeated next time); what was learned, by pod."""
        if not self.config.learn_from_engines:
            return {}
        pods = self.table.pods()
        for gone in [name for name in self._learned if name not in pods]:
            del self._learned[gone]
        todo: list[tuple[str, tuple[str, str]]] = []
        for name, pod in pods.items():
            url = pod_url(pod)
            if ready_reason(pod) is not None or url is None:
                continue
            key = (str((pod.get("metadata") or {}).get("uid") or ""), url)
            if name not in self._learned or self._learned[name][0] != key:
                todo.append((name, key))
        found = await asyncio.gather(*(discover(key[1], timeout_s=self.config.learn_timeout_s)
                                       for _, key in todo))
        for (name, key), discovery in zip(todo, found, strict=True):
            if discovery.learned:
                self._learned[name] = (key, dict(discovery.learned))
                self.metrics.engine_queries.labels("learned").inc()
                log.info("pod %s: learned %s from its engine", name,
                         ", ".join(sorted(discovery.learned)))
            else:
                self.metrics.engine_queries.labels("failed").inc()
                log.warning("pod %s: its engine said nothing about itself: %s", name,
                            "; ".join(discovery.problems))
        return {name: fields for name, (_, fields) in self._learned.items()}

    async def reconcile(self) -> Plan:
        """List the registry, apply the plan; the plan (empty when unreachable)."""
        outcomes = self.table.outcomes(await self.learn())
        self._count(list(outcomes.values()))
        desired = {o.id: o for o in outcomes.values() if not isinstance(o, NotWorker)}
        c = self.config
        try:
            listing = await self.registry.list()
            todo = plan(desired, listing, c.discovered_by, self._previous)
            for spec in todo.register:
                await self.registry.register(spec, c.lease_ttl_s)
                log.info("worker=%s registered from pod %s (%s)", spec.id,
                         spec.labels.get("k8s.pod"), spec.url, extra={"worker": spec.id})
            for spec in todo.renew:
                await self.registry.reassert(spec, c.lease_ttl_s)
            for worker_id in todo.remove:
                await self.registry.remove(worker_id, tombstone_ttl_s=c.tombstone_ttl_s,
                                           reason=REMOVAL_REASON)
                log.info("worker=%s removed: its pod is gone or not ready", worker_id,
                         extra={"worker": worker_id})
        except RegistryUnavailable as exc:
            self.metrics.registry_errors.inc()
            self.reconciled = False
            log.warning("registry unreachable, reconciling later: %s", exc)
            todo = Plan()
        else:
            self.reconciled = True
            self._previous = set(desired)
            self.metrics.writes.labels("register").inc(len(todo.register))
            self.metrics.writes.labels("renew").inc(len(todo.renew))
            self.metrics.writes.labels("remove").inc(len(todo.remove))
            self.metrics.held.set(len(todo.held))
        self.last_plan = todo
        async with self._done:
            self.reconciliations += 1
            self._done.notify_all()
        return todo

    def _count(self, outcomes: list[object]) -> None:
        invalid = {o.pod: o.reason for o in outcomes if isinstance(o, NotWorker) and o.invalid}
        for pod, reason in invalid.items():
            if self._invalid_logged.get(pod) != reason:
                log.warning("pod %s is labelled as a worker but cannot be one: %s", pod, reason)
        self._invalid_logged = invalid
        not_ready = sum(isinstance(o, NotWorker) and not o.invalid for o in outcomes)
        self.metrics.pods.labels("invalid").set(len(invalid))
        self.metrics.pods.labels("not_ready").set(not_ready)
        self.metrics.pods.labels("worker").set(len(outcomes) - len(invalid) - not_ready)
