"""``POST /admin/workers`` with ``{"url": ...}`` alone: the gateway asks the worker's engine
for the rest of its spec (real sims and a real Redis registry on 127.0.0.1)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest

from cortex.gateway.config import HealthConfig, RegistryConfig
from cortex.registry import RedisRegistry
from cortex.testing import RedisServer, free_port, wait_until_async

from .conftest import BLOCK, MODEL, TOKEN, StartGateway, StartSim

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

    async def routable() -> bool:
        async with http.get(gw.url + "/admin/workers", headers=ADMIN) as resp:
            listing = await resp.json()
        return any(w["id"] == "found" and w["routable"] for w in listing["workers"])

    await wait_until_async(routable, timeout=20, what="the discovered worker to be routable")
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
