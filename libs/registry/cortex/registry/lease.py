"""``LeaseKeeper``: hold one worker's lease for as long as a context is open.

Gateways renew leases from their health probes; this keeper serves static registrations
(``cortex workers add --keep``), dev clusters and tests. A lease found missing (expired
during an outage, Redis restarted empty) is written again — unless an operator removed the
worker (a tombstone): then the keeper writes nothing until the tombstone is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from types import TracebackType

from cortex.edge.tasks import stop_tasks
from cortex.registry.base import Assertion, Registry
from cortex.registry.errors import RegistryUnavailable
from cortex.registry.spec import WorkerSpec

__all__ = ["LeaseKeeper"]

log = logging.getLogger(__name__)


class LeaseKeeper:
    """Registers ``spec`` on enter (errors propagate; clears a tombstone: an explicit
    add), re-asserts it every ``ttl_s / 3`` seconds, deregisters on exit unless
    ``deregister_on_exit`` is false."""

    def __init__(
        self,
        registry: Registry,
        spec: WorkerSpec,
        *,
        ttl_s: float | None = None,
        deregister_on_exit: bool = True,
    ) -> None:
        self.registry = registry
        self.spec = spec
        self.ttl_s = registry.default_ttl_s if ttl_s is None else ttl_s
        if self.ttl_s <= 0:
            raise ValueError("LeaseKeeper needs a positive ttl_s")
        self.deregister_on_exit = deregister_on_exit
        self.renewals = 0
        self.failures = 0
        self.tombstoned = False  # the last re-assertion found an operator's removal
        self._task: asyncio.Task[None] | None = None

    def __repr__(self) -> str:
        return (
            f"LeaseKeeper(worker={self.spec.id!r}, ttl_s={self.ttl_s}, renewals={self.renewals},"
            f" failures={self.failures}, tombstoned={self.tombstoned})"
        )

    async def __aenter__(self) -> LeaseKeeper:
        await self.registry.register(self.spec, self.ttl_s)
        self._task = asyncio.create_task(self._renew_loop(), name=f"lease-{self.spec.id}")
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        task, self._task = self._task, None
        if task is not None:
            await stop_tasks([task])
        if self.deregister_on_exit:
            with contextlib.suppress(RegistryUnavailable):
                await self.registry.deregister(self.spec.id)

    async def _renew_loop(self) -> None:
        while True:
            await asyncio.sleep(self.ttl_s / 3)
            try:
                outcome = await self.registry.reassert(self.spec, self.ttl_s)
            except RegistryUnavailable as exc:
                self.failures += 1
                log.warning("lease renewal failed worker=%s: %s", self.spec.id, exc,
                            extra={"worker": self.spec.id})
                continue
            tombstoned = outcome is Assertion.TOMBSTONED
            if tombstoned and not self.tombstoned:
                log.warning("worker=%s was removed by an operator; not renewing its lease",
                            self.spec.id, extra={"worker": self.spec.id})
            elif outcome is Assertion.CREATED:
                log.info("lease of worker=%s was gone; registered again", self.spec.id,
                         extra={"worker": self.spec.id})
            self.tombstoned = tombstoned
            if not tombstoned:
                self.renewals += 1
