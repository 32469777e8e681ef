"""Engine-reported load: the parsers per engine kind (pure) and the poller (async shell).

SGLang: ``GET /v1/loads`` (``{loads: [{num_running_reqs, num_waiting_reqs, …}]}``), falling
back to the older ``GET /get_load`` (``[{num_reqs, num_waiting_reqs, …}]``). vLLM:
``GET /metrics`` (``vllm:num_requests_running`` / ``vllm:num_requests_waiting``, summed over
label sets). Values are summed over DP ranks.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp

from cortex.gateway.config.gateway import LoadConfig
from cortex.gateway.fleet.pool import Health, WorkerPool, WorkerState
from cortex.gateway.metrics import GatewayMetrics
from cortex.hashing import Engine
from cortex.registry.spec import WorkerSpec

__all__ = ["LoadPoller", "parse_sglang_get_load", "parse_sglang_loads", "parse_vllm_metrics"]

log = logging.getLogger(__name__)


class LoadFormatError(ValueError):
    """The engine's load report has an unexpected shape."""


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise LoadFormatError(f"not a count: {value!r}")
    return int(value)


def parse_sglang_loads(obj: Any) -> tuple[int, int]:
    """``/v1/loads`` → (running, waiting) summed over DP ranks."""
    loads = obj.get("loads") if isinstance(obj, dict) else None
    if not isinstance(loads, list):
        raise LoadFormatError("no 'loads' list")
    running = waiting = 0
    for rank in loads:
        if not isinstance(rank, dict):
            raise LoadFormatError("a 'loads' entry is not an object")
        running += _int(rank.get("num_running_reqs", 0))
        waiting += _int(rank.get("num_waiting_reqs", 0))
    return running, waiting


def parse_sglang_get_load(obj: Any) -> tuple[int, int]:
    """``/get_load`` (a list per DP rank, or one object) → (running, waiting)."""
    ranks = obj if isinstance(obj, list) else [obj]
    running = waiting = 0
    for rank in ranks:
        if not isinstance(rank, dict):
            raise LoadFormatError("a load entry is not an object")
        running += _int(rank.get("num_reqs", 0))
        waiting += _int(rank.get("num_waiting_reqs", 0))
    return running, waiting


def parse_vllm_metrics(text: str) -> tuple[int, int]:
    """Prometheus text → (running, waiting) from ``vllm:num_requests_{running,waiting}``."""
    totals = {"vllm:num_requests_running": 0.0, "vllm:num_requests_waiting": 0.0}
    seen = False
    for line in text.splitlines():
        if not line.startswith("vllm:num_requests_"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in totals:
            try:
                totals[name] += float(line.rsplit(" ", 1)[1])
            except (IndexError, ValueError):
                raise LoadFormatError(f"bad sample line {line[:80]!r}") from None
            seen = True
    if not seen:
        raise LoadFormatError("no vllm:num_requests_* samples")
    return int(totals["vllm:num_requests_running"]), int(totals["vllm:num_requests_waiting"])


class LoadPoller:
    """Polls every healthy worker's engine load each ``poll_interval_s``; a failed poll
    leaves the last value to go stale (routing then treats the worker's load as missing)."""

    def __init__(
        self,
        pool: WorkerPool,
        session: aiohttp.ClientSession,
        config: LoadConfig,
        metrics: GatewayMetrics,
        auth: Callable[[WorkerSpec], Mapping[str, str]] = lambda spec: {},
    ) -> None:
        self.pool = pool
        self.session = session
        self._auth = auth  # a worker's credential headers
        self.config = config
        self.metrics = metrics
        self._legacy: set[str] = set()  # SGLang workers without /v1/loads

    async def run(self) -> None:
        while True:
            workers = [w for w in self.pool if w.health is Health.HEALTHY]
            if workers:
                await asyncio.gather(*(self.poll(w) for w in workers))
            await asyncio.sleep(self.config.poll_interval_s)

    async def poll(self, worker: WorkerState) -> None:
        sent = time.monotonic()
        number = worker.load_poll_begun()
        try:
            async with asyncio.timeout(self.config.timeout_s):
                running, waiting = await self._fetch(worker)
        except (TimeoutError, aiohttp.ClientError, LoadFormatError, ValueError) as exc:
            self.metrics.load_polls.labels(result="error").inc()
            log.debug("load poll failed worker=%s: %r", worker.id, exc, extra={"worker": worker.id})
            return
        worker.load_polled(number, running, waiting, sent)
        self.metrics.load_polls.labels(result="ok").inc()
        self.metrics.worker(self.metrics.worker_engine_running, worker.id).set(running)
        self.metrics.worker(self.metrics.worker_engine_waiting, worker.id).set(waiting)

    async def _fetch(self, worker: WorkerState) -> tuple[int, int]:
        base = worker.spec.url.rstrip("/")
        headers = self._auth(worker.spec)
        if worker.spec.engine is Engine.VLLM:
            async with self.session.get(base + "/metrics", headers=headers) as resp:
                resp.raise_for_status()
                return parse_vllm_metrics(await resp.text())
        if worker.id not in self._legacy:
            async with self.session.get(base + "/v1/loads", headers=headers) as resp:
                if resp.status == 404:
                    self._legacy.add(worker.id)
                else:
                    resp.raise_for_status()
                    return parse_sglang_loads(json.loads(await resp.read()))
        async with self.session.get(base + "/get_load", headers=headers) as resp:
            resp.raise_for_status()
            return parse_sglang_get_load(json.loads(await resp.read()))
