"""Workers known by URL alone: ``POST /admin/workers`` with ``{"url": ...}`` and the static
seed ``discovery.worker_urls``; the gateway asks each worker's engine for the rest of its
spec (real sims and a real Redis registry on 127.0.0.1)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest

from cortex.gateway.config.gateway import DiscoveryConfig, HealthConfig, RegistryConfig, load_config
from cortex.gateway.errors import ConfigError
from cortex.gateway.server import GatewayServer
from cortex.registry import RedisRegistry
from cortex.testing import RedisServer, free_port, wait_until_async

from ..conftest import BLOCK, MODEL, TOKEN, StartGateway, StartSim

pytestmark = pytest.mark.timeout(60)

ADMIN = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
async def registry(redis_server: RedisServer) -> AsyncIterator[RedisRegistry]:
    async with RedisRegistry(redis_server.url) as reg:
        yield reg


def sections(redis_url: str) -> dict[str, object]:
    return {"registry": RegistryConfig(redis_url=redis_url, lease_ttl_s=5.0,
                                       poll_interval_s=0.2),
            "health": HealthConfig(interval_s=0.2, timeout_s=2.0)}


async def routable(http: aiohttp.ClientSession, gw: GatewayServer, worker_id: str) -> bool:
    async with http.get(gw.url + "/admin/workers", headers=ADMIN) as resp:
        listing = await resp.json()
    return any(w["id"] == worker_id and w["routable"] for w in listing["workers"])


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
async def test_a_url_alone_registers_the_worker_the_engine_describes(
    start_sim: StartSim, start_gateway: StartGateway, http: aiohttp.ClientSession,
    redis_server: RedisServer, registry: RedisRegistry, engine: str,
) -> None:
    sim = await start_sim(engine=engine, max_model_len=4096)
    gw = await start_gateway([], **sections(redis_server.url))
    async with http.post(gw.url + "/admin/workers", headers=ADMIN,
                         json={"url": sim.url, "id": "found"}) as resp:
        assert resp.status == 201, await resp.text()
        worker = (await resp.json())["worker"]
    assert (worker["engine"], worker["model"], worker["block_size"], worker["context_length"],
            worker["kv_events"]) == (engine, MODEL, BLOCK, 4096, sim.kv_events_endpoint)
    stored = await registry.get("found")
    assert stored is not None and stored.replay == sim.replay_endpoint

    async def found() -> bool:
        return await routable(http, gw, "found")

    await wait_until_async(found, timeout=20, what="the discovered worker to be routable")
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    async with http.post(gw.url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        assert resp.headers["x-cortex-assigned-worker"] == "found"


async def test_a_worker_that_cannot_describe_itself_is_a_400_naming_the_fields(
    start_gateway: StartGateway, http: aiohttp.ClientSession, redis_server: RedisServer,
    registry: RedisRegistry,
) -> None:
    gw = await start_gateway([], **sections(redis_server.url))
    url = f"http://127.0.0.1:{free_port()}"
    async with http.post(gw.url + "/admin/workers", headers=ADMIN,
                         json={"url": url, "model": "m"}) as resp:
        body = await resp.json()
    assert resp.status == 400 and body["error"]["code"] == "invalid_request"
    assert f"could not learn engine from {url}" in body["error"]["message"]
    assert (await registry.list()).workers == {}


async def test_seed_urls_are_discovered_at_start_and_late_workers_when_they_come(
    start_sim: StartSim, start_gateway: StartGateway, http: aiohttp.ClientSession,
    redis_server: RedisServer, registry: RedisRegistry,
) -> None:
    early = await start_sim(engine="vllm")
    late_port = free_port()
    late_url = f"http://127.0.0.1:{late_port}"
    gw = await start_gateway([], **sections(redis_server.url), discovery=DiscoveryConfig(
        worker_urls=(early.url, late_url), timeout_s=1.0, retry_interval_s=0.2))
    early_id = f"127.0.0.1-{early.port}"
    assert await routable(http, gw, early_id)  # in the pool when the gateway is up
    stored = await registry.get(early_id)
    assert stored is not None and stored.kv_events == early.kv_events_endpoint
    assert await registry.get(f"127.0.0.1-{late_port}") is None

    await start_sim(engine="sglang", port=late_port)

    async def late_routable() -> bool:
        return await routable(http, gw, f"127.0.0.1-{late_port}")

    await wait_until_async(late_routable, timeout=20, what="the late seed to be discovered")
    late = await registry.get(f"127.0.0.1-{late_port}")
    assert late is not None and (late.engine.value, late.block_size) == ("sglang", BLOCK)


def test_seed_urls_from_the_environment_and_bad_ones_named() -> None:
    models = '[{"name": "m"}]'
    config = load_config(None, {"CORTEX_GATEWAY_MODELS": models,
                                "CORTEX_GATEWAY_DISCOVERY_WORKER_URLS":
                                    "http://10.0.0.5:30000, http://10.0.0.6:30000"})
    assert config.discovery.worker_urls == ("http://10.0.0.5:30000", "http://10.0.0.6:30000")
    with pytest.raises(ConfigError, match=r"discovery\.worker_urls: url: .*credentials"):
        load_config(None, {"CORTEX_GATEWAY_MODELS": models,
                           "CORTEX_GATEWAY_DISCOVERY_WORKER_URLS": "http://u:p@h:1"})
