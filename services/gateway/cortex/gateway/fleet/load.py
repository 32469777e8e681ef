"""Engine-reported load: the poller (the answers' parsers are :mod:`cortex.registry.engines`).

SGLang: ``GET /v1/loads``, falling back to the older ``GET /get_load``; vLLM: the samples of
``/metrics`` the poll reads, by name (``GET /metrics/?name[]=…``: vLLM's ``/metrics`` route
ignores the filter, the ``/metrics/`` mount beside it is prometheus_client's own app, which
honours it; the engine renders five families, ~1.9 KB instead of ~54 KB: on vLLM 0.32,
0.7 ms of the engine's CPU per poll instead of 6.0), and the whole ``GET /metrics`` for a
worker whose answer to that lacked them (an engine exporting from several processes, an
older release, a proxy). Values are summed over DP ranks. The same answer
carries the engine's work mark (token counters, or SGLang's KV tokens in use), which the
wedge watch (:mod:`cortex.gateway.dispatch.attempt`) reads: a poll costs the engine no queue
slot, so a saturated worker still shows it works.

Each worker's KV capacity (device blocks, times its DP ranks: routing weighs the ledger's
blocks against it) comes along: vLLM's ``vllm:cache_config_info`` ``num_gpu_blocks`` from
the same ``/metrics`` text, SGLang's ``/server_info`` ``max_total_num_tokens`` over its
``page_size``, asked once (``/get_server_info`` before 0.4.7).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import urllib.parse
from collections.abc import Callable, Iterable, Mapping

from cortex.gateway.config.gateway import LoadConfig
from cortex.gateway.fleet.pool import Health, WorkerPool, WorkerState
from cortex.gateway.metrics import GatewayMetrics
from cortex.gateway.upstream.client import UpstreamClient
from cortex.gateway.upstream.errors import FailureKind, UpstreamFailure
from cortex.hashing import Engine
from cortex.registry.engines import (
    LoadFormatError,
    WorkMark,
    kv_capacity_from_sglang_server_info,
    kv_device_blocks_from_vllm_metrics,
    parse_sglang_get_load,
    parse_sglang_loads,
    parse_vllm_metrics,
    sglang_work_from_get_load,
    sglang_work_from_loads,
    vllm_work_from_metrics,
)
from cortex.registry.spec import WorkerSpec

__all__ = ["VLLM_LOAD_PATH", "VLLM_LOAD_SAMPLES", "LoadPoller"]

log = logging.getLogger(__name__)

VLLM_LOAD_SAMPLES = ("vllm:num_requests_running", "vllm:num_requests_waiting",
                     "vllm:cache_config_info", "vllm:prompt_tokens_total",
                     "vllm:generation_tokens_total")
"""The vLLM samples a load poll reads: the load, the KV capacity and the work mark."""

VLLM_LOAD_PATH = "/metrics/?" + urllib.parse.urlencode([("name[]", n) for n in VLLM_LOAD_SAMPLES])
"""What a load poll asks a vLLM worker: :data:`VLLM_LOAD_SAMPLES`, by name."""


def _ok(status: int, body: bytes) -> bytes:
    """``body`` of a 2xx answer; :class:`UpstreamFailure` (``status``) for any other."""
    if not 200 <= status < 300:
        raise UpstreamFailure(FailureKind.STATUS, f"status {status}", status=status)
    return body


class LoadPoller:
    """Polls every healthy worker's engine load each ``poll_interval_s``; a failed poll
    leaves the last value to go stale (routing then treats the worker's load as missing).
    ``poll_interval_s`` 0: off, nothing is ever polled."""

    def __init__(
        self,
        pool: WorkerPool,
        upstream: UpstreamClient,
        config: LoadConfig,
        metrics: GatewayMetrics,
        auth: Callable[[WorkerSpec], Mapping[str, str]] = lambda spec: {},
    ) -> None:
        self.pool = pool
        self.upstream = upstream
        self._auth = auth  # a worker's credential headers
        self.config = config
        self.metrics = metrics
        self._legacy: set[str] = set()  # SGLang workers without /v1/loads
        self._whole_metrics: set[str] = set()  # vLLM workers not filtering /metrics by name
        self._capacity_asked: set[str] = set()  # SGLang workers asked for their capacity

    @property
    def off(self) -> bool:
        return self.config.poll_interval_s == 0

    async def run(self) -> None:
        if self.off:
            log.warning("engine load polling is off (load.poll_interval_s 0): routing counts "
                        "only this gateway's requests, the wedge watch only probes")
            return
        while True:
            await self.poll_all(w for w in self.pool if w.health is Health.HEALTHY)
            await asyncio.sleep(self.config.poll_interval_s)

    async def poll_all(self, workers: Iterable[WorkerState]) -> None:
        """Poll ``workers`` at once (none while polling is off)."""
        if not self.off:
            await asyncio.gather(*(self.poll(w) for w in workers))

    async def poll(self, worker: WorkerState) -> None:
        sent = time.monotonic()
        number = worker.load_poll_begun()
        try:
            async with asyncio.timeout(self.config.timeout_s):
                running, waiting, work = await self._fetch(worker)
        except (TimeoutError, UpstreamFailure, LoadFormatError, ValueError) as exc:
            worker.load_poll_failed(number, sent)
            self.metrics.load_polls.labels(result="error").inc()
            log.debug("load poll failed worker=%s: %r", worker.id, exc, extra={"worker": worker.id})
            return
        worker.load_polled(number, running, waiting, sent, work)
        self.metrics.load_polls.labels(result="ok").inc()
        if worker.spec.engine is Engine.SGLANG and worker.id not in self._capacity_asked:
            self._capacity_asked.add(worker.id)
            try:
                async with asyncio.timeout(self.config.timeout_s):
                    self._set_capacity(worker, await self._sglang_capacity(worker))
            except (TimeoutError, UpstreamFailure, ValueError) as exc:
                log.debug("capacity read failed worker=%s: %r", worker.id, exc,
                          extra={"worker": worker.id})
        self.metrics.worker(self.metrics.worker_engine_running, worker.id).set(running)
        self.metrics.worker(self.metrics.worker_engine_waiting, worker.id).set(waiting)

    async def _fetch(self, worker: WorkerState) -> tuple[int, int, WorkMark | None]:
        """(running, waiting, work mark) from the worker's engine."""
        base = worker.spec.url.rstrip("/")
        headers = self._auth(worker.spec)
        if worker.spec.engine is Engine.VLLM:
            text, load = await self._vllm_metrics(worker, base, headers)
            if load is None:
                raise LoadFormatError("no readable vllm:num_requests_* samples")
            self._set_capacity(worker, kv_device_blocks_from_vllm_metrics(text))
            return (*load, vllm_work_from_metrics(text))
        get = self.upstream.get
        if worker.id not in self._legacy:
            status, body = await get(base + "/v1/loads", headers)
            if status == 404:
                self._legacy.add(worker.id)
            else:
                obj = json.loads(_ok(status, body))
                return (*parse_sglang_loads(obj), sglang_work_from_loads(obj))
        obj = json.loads(_ok(*await get(base + "/get_load", headers)))
        return (*parse_sglang_get_load(obj), sglang_work_from_get_load(obj))

    async def _vllm_metrics(self, worker: WorkerState, base: str, headers: Mapping[str, str]
                            ) -> tuple[str, tuple[int, int] | None]:
        """The ``/metrics`` text of a vLLM worker and the (running, waiting) load read from
        it: only :data:`VLLM_LOAD_SAMPLES` (:data:`VLLM_LOAD_PATH`), unless it once answered
        that without its load (then, and from then on, the whole text)."""
        if worker.id not in self._whole_metrics:
            status, body = await self.upstream.get(base + VLLM_LOAD_PATH, headers)
            if status >= 500:
                _ok(status, body)  # a failed poll, not an answer
            if status == 200:
                text = body.decode("utf-8", "replace")
                load = parse_vllm_metrics(text).load
                if load is not None:
                    return text, load
            self._whole_metrics.add(worker.id)
            log.info("worker=%s does not filter /metrics by name (status %d): polling the "
                     "whole text", worker.id, status, extra={"worker": worker.id})
        text = _ok(*await self.upstream.get(base + "/metrics", headers)).decode("utf-8",
                                                                                 "replace")
        return text, parse_vllm_metrics(text).load

    async def _sglang_capacity(self, worker: WorkerState) -> int | None:
        base = worker.spec.url.rstrip("/")
        for path in ("/server_info", "/get_server_info"):
            status, body = await self.upstream.get(base + path, self._auth(worker.spec))
            if status != 404:
                return kv_capacity_from_sglang_server_info(json.loads(_ok(status, body)))
        return None

    def _set_capacity(self, worker: WorkerState, per_rank: int | None) -> None:
        if per_rank is None or per_rank <= 0:
            return
        worker.kv_capacity = per_rank * worker.spec.dp_size
        self.metrics.worker(self.metrics.worker_kv_capacity, worker.id).set(worker.kv_capacity)
