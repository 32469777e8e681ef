"""Memory tiers end to end: real Redis, index, ingest, sims with a host tier and the gateway
on 127.0.0.1. A prefix evicted from its holder's GPU into host memory is routed back to the
holder (the host-hit weight says so), and the predicted hit never exceeds the engine's
``cached_tokens``, for either engine's media names."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from cortex.gateway.config.gateway import ModelConfig, RoutingConfig, RoutingWeights
from cortex.hashing import Engine
from cortex.index.server import IndexServer
from cortex.testing import RedisServer, wait_until_async

from ..conftest import BLOCK, MODEL, StartGateway, StartSim
from .test_cluster import SYSTEM, Cluster, chat, cluster, wait_index_holds

pytestmark = pytest.mark.timeout(60)

VERSIONS = {Engine.VLLM: "0.33.0", Engine.SGLANG: "0.5.23"}


@pytest.fixture
def redis(redis_server: RedisServer) -> RedisServer:
    return redis_server


def other(tag: str) -> dict[str, Any]:
    """Another prompt of the same length: it evicts the first one's tail from a small GPU."""
    return {"model": MODEL, "messages": [{"role": "system", "content": f"[{tag}] " + SYSTEM},
                                         {"role": "user", "content": "something else"}]}


async def evict_tail_to_host(c: Cluster, http: aiohttp.ClientSession, holder_url: str,
                             first: dict[str, Any], holder: str) -> None:
    """Straight to the holder, not through the gateway: its GPU evicts the first prompt's
    tail into host memory; wait until the gateway sees it there."""
    async with http.post(holder_url + "/v1/chat/completions",
                         json={**other("evict"), "max_tokens": 4}) as resp:
        assert resp.status == 200, await resp.text()

    async def tail_in_host() -> bool:
        cand = await c.candidate(first, holder)
        return bool(cand["host_tokens"] > 0 and cand["predicted_tokens"] == 0)

    await wait_until_async(tail_in_host, timeout=10, what="the tail in the host tier")


@pytest.mark.parametrize("engine", [Engine.VLLM, Engine.SGLANG])
async def test_a_prefix_in_host_memory_is_routed_back_to_its_holder(
    engine: Engine, redis: RedisServer, index_server: IndexServer, start_sim: StartSim,
    start_gateway: StartGateway, http: aiohttp.ClientSession,
) -> None:
    sims = {f"w{i}": await start_sim(engine=engine, engine_version=VERSIONS[engine],
                                     kv_capacity_blocks=64, host_capacity_blocks=512)
            for i in range(2)}
    models = (ModelConfig(name=MODEL, block_size=BLOCK, engine=engine),)
    async with cluster(redis, index_server, sims, start_gateway, http, models=models) as c:
        first = chat("which rules apply here?")
        headers, _ = await c.send(first)
        holder = headers["x-cortex-assigned-worker"]
        await wait_index_holds(c, first, holder)
        await evict_tail_to_host(c, http, sims[holder].url, first, holder)
        cand = await c.candidate(first, holder)
        device, host = cand["index_tokens"], cand["host_tokens"]
        assert cand["matched_tokens"] == device + host
        assert cand["credit"] == pytest.approx(device + 0.75 * host)

        headers, cached = await c.send(first)
        assert headers["x-cortex-assigned-worker"] == holder
        assert headers["x-cortex-match-mode"] == "exact_kv"
        hit = int(headers["x-cortex-cache-hit-tokens"])
        assert hit == device + host
        assert hit <= cached  # the engine loads the host blocks back and reports them

        metrics = await (await http.get(c.gateway.url + "/metrics")).text()
        assert 'cortex_gateway_cache_prediction_total{outcome="over"}' not in metrics
        assert 'cortex_gateway_decisions_total{mode="exact_kv",reason="offload_hit"}' in metrics


async def test_gpu_only_crediting_ignores_the_host_tier(
    redis: RedisServer, index_server: IndexServer, start_sim: StartSim,
    start_gateway: StartGateway, http: aiohttp.ClientSession,
) -> None:
    sims = {f"w{i}": await start_sim(engine=Engine.SGLANG, engine_version="0.5.23",
                                     kv_capacity_blocks=64, host_capacity_blocks=512)
            for i in range(2)}
    routing = RoutingConfig(load_stale_after_s=5.0,
                            weights=RoutingWeights(host_hit=0.0, disk_hit=0.0))
    async with cluster(redis, index_server, sims, start_gateway, http, routing=routing) as c:
        first = chat("which rules apply here?")
        headers, _ = await c.send(first)
        holder = headers["x-cortex-assigned-worker"]
        await evict_tail_to_host(c, http, sims[holder].url, first, holder)
        cand = await c.candidate(first, holder)
        assert cand["matched_tokens"] == cand["index_tokens"] == cand["credit"]
