"""Workers seeded by URL alone (``discovery.worker_urls``): ask each engine for its spec.

A worker may start after the gateway, or restart while it is asked: a URL whose discovery
fails (nobody answers, or the engine does not say its engine, model or block size) is asked
again every ``retry_interval_s`` until it answers, with one warning naming what is missing
each time the reason changes. Once a URL's spec is seeded it is the registry's like any
other worker (health probes renew its lease).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from cortex.gateway.config.gateway import DiscoveryConfig
from cortex.registry import SpecError, WorkerSpec, discover

__all__ = ["SEED_REQUIRES", "UrlSeeder"]

log = logging.getLogger(__name__)

SEED_REQUIRES = ("engine", "model", "block_size")
"""A seed nobody completes by hand must say these itself (block size: its hash domain)."""


class UrlSeeder:
    """Discovers ``config.worker_urls`` and hands each spec to ``seed`` once."""

    def __init__(self, config: DiscoveryConfig,
                 seed: Callable[[WorkerSpec], Awaitable[None]]) -> None:
        self.config = config
        self._seed = seed
        self.pending: list[str] = list(config.worker_urls)
        self._reasons: dict[str, str] = {}

    async def round(self) -> list[WorkerSpec]:
        """Ask every pending URL once (concurrently); returns the specs seeded."""
        found = await asyncio.gather(*(self._one(url) for url in self.pending))
        seeded = [spec for spec in found if spec is not None]
        done = {spec.url for spec in seeded}
        self.pending = [url for url in self.pending if url.rstrip("/") not in done]
        return seeded

    async def run(self) -> None:
        """A round now, then one every ``retry_interval_s`` until every URL is seeded."""
        await self.round()
        while self.pending:
            await asyncio.sleep(self.config.retry_interval_s)
            await self.round()

    async def _one(self, url: str) -> WorkerSpec | None:
        discovery = await discover(url, timeout_s=self.config.timeout_s)
        try:
            spec = discovery.spec(require=SEED_REQUIRES)
            self.config.address_policy.check(spec)  # its event endpoints too
        except SpecError as exc:
            if self._reasons.get(url) != str(exc):
                self._reasons[url] = str(exc)
                log.warning("worker seed %s not registered yet (asked again every %g s): %s",
                            url, self.config.retry_interval_s, exc)
            return None
        await self._seed(spec)
        log.info("worker seed %s discovered as worker=%s (%s, model %s, block size %s)",
                 url, spec.id, spec.engine.value, spec.model, spec.block_size,
                 extra={"worker": spec.id})
        return spec

    def __repr__(self) -> str:
        return f"UrlSeeder(pending={self.pending!r})"


