"""The load poller reads each worker's KV capacity beside its load, vLLM's from the samples
it names (real HTTP, 127.0.0.1)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from cortex.gateway.config.gateway import BreakerConfig, LoadConfig, UpstreamConfig
from cortex.gateway.fleet.load import VLLM_LOAD_SAMPLES, LoadPoller
from cortex.gateway.fleet.pool import WorkerPool, WorkerState
from cortex.gateway.metrics import GatewayMetrics
from cortex.gateway.upstream.client import UpstreamClient
from cortex.hashing import Engine
from cortex.registry import WorkerSpec
from cortex.testing import serve_app

VLLM_METRICS = (
    'vllm:cache_config_info{block_size="16",enable_prefix_caching="True",'
    'num_cpu_blocks="4096",num_gpu_blocks="1024"} 1.0\n'
    'vllm:num_requests_running{model_name="m"} 2.0\n'
    'vllm:num_requests_waiting{model_name="m"} 1.0\n')


@contextlib.asynccontextmanager
async def engine(routes: dict[str, web.StreamResponse | dict[str, object] | str | int]
                 ) -> AsyncIterator[tuple[str, list[str]]]:
    asked: list[str] = []
    names: list[list[str]] = []

    async def answer(request: web.Request) -> web.StreamResponse:
        asked.append(request.path)
        names.append(request.query.getall("name[]", []))
        found = routes.get(request.path)
        if found is None:
            return web.Response(status=404)
        if isinstance(found, int):
            return web.Response(status=found)
        if isinstance(found, str):
            return web.Response(text=found)
        assert isinstance(found, dict)
        return web.json_response(found)

    app = web.Application()
    app.router.add_get("/{tail:.*}", answer)
    async with serve_app(app) as url:
        yield url, asked
    assert all(n == list(VLLM_LOAD_SAMPLES) for p, n in zip(asked, names, strict=True)
               if p == "/metrics/")


async def poll(url: str, engine_kind: Engine, dp_size: int = 1, times: int = 1
               ) -> tuple[WorkerState, GatewayMetrics]:
    pool = WorkerPool(BreakerConfig())
    spec = WorkerSpec(id="w", url=url, engine=engine_kind, model="m", dp_size=dp_size)
    pool.sync({"w": spec})
    worker = pool.get("w")
    assert worker is not None
    metrics = GatewayMetrics()
    async with UpstreamClient(UpstreamConfig()) as upstream:
        poller = LoadPoller(pool, upstream, LoadConfig(timeout_s=5.0), metrics)
        for _ in range(times):
            await poller.poll(worker)
    return worker, metrics


async def test_vllm_capacity_is_its_gpu_blocks_from_the_same_metrics_text() -> None:
    async with engine({"/metrics/": VLLM_METRICS}) as (url, asked):
        worker, metrics = await poll(url, Engine.VLLM, dp_size=2, times=2)
    assert worker.kv_capacity == 2048  # the CPU offload pool is another tier
    assert worker.engine is not None and asked == ["/metrics/", "/metrics/"]
    assert metrics.registry.get_sample_value("cortex_gateway_worker_kv_capacity_blocks",
                                             {"worker": "w"}) == 2048


@pytest.mark.parametrize("mount", [404, "# an engine whose registry names nothing\n"])
async def test_a_vllm_worker_that_does_not_filter_by_name_is_polled_whole(
        mount: int | str) -> None:
    async with engine({"/metrics/": mount, "/metrics": VLLM_METRICS}) as (url, asked):
        worker, _ = await poll(url, Engine.VLLM, times=2)
    assert worker.engine is not None and worker.engine.running == 2
    assert asked == ["/metrics/", "/metrics", "/metrics"]  # asked by name once only


async def test_a_failing_vllm_mount_fails_the_poll_and_is_asked_again() -> None:
    async with engine({"/metrics/": 503, "/metrics": VLLM_METRICS}) as (url, asked):
        worker, metrics = await poll(url, Engine.VLLM, times=2)
    assert worker.engine is None and asked == ["/metrics/", "/metrics/"]
    assert metrics.registry.get_sample_value("cortex_gateway_load_polls_total",
                                             {"result": "error"}) == 2


async def test_sglang_capacity_is_asked_once_from_server_info() -> None:
    routes: dict[str, web.StreamResponse | dict[str, object] | str] = {
        "/v1/loads": {"loads": [{"dp_rank": 0, "num_running_reqs": 1,
                                 "num_waiting_reqs": 0}]},
        "/get_server_info": {"max_total_num_tokens": 65536, "page_size": 64}}
    async with engine(routes) as (url, asked):
        worker, _ = await poll(url, Engine.SGLANG, times=2)
    assert worker.kv_capacity == 1024
    assert asked == ["/v1/loads", "/server_info", "/get_server_info", "/v1/loads"]


async def test_no_capacity_named_leaves_it_unknown() -> None:
    async with engine({"/metrics/": 'vllm:num_requests_running{a="b"} 0\n'
                                   'vllm:num_requests_waiting{a="b"} 0\n'}) as (url, _):
        worker, _ = await poll(url, Engine.VLLM)
    assert worker.kv_capacity is None and worker.engine is not None
