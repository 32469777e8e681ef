"""LoRA adapters end to end: real Redis, index, ingest, sims serving adapters and the gateway
on 127.0.0.1. ``model`` = an adapter's name routes to the base model's workers that list the
adapter in ``/v1/models``; its blocks are keyed under the adapter (vLLM ``lora_name`` /
extra keys, SGLang 0.5.23 ``lora_name``) and never credited to base-model prompts."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from cortex.gateway.config.gateway import ModelConfig
from cortex.hashing import Engine
from cortex.index.server import IndexServer
from cortex.testing import RedisServer, wait_until_async

from ..conftest import BLOCK, MODEL, StartGateway, StartSim
from .test_cluster import ADMIN, chat, cluster

pytestmark = pytest.mark.timeout(60)

VERSIONS = {Engine.VLLM: "0.33.0", Engine.SGLANG: "0.5.23"}


@pytest.fixture
def redis(redis_server: RedisServer) -> RedisServer:
    return redis_server


def of(model: str, body: dict[str, Any]) -> dict[str, Any]:
    return {**body, "model": model}


@pytest.mark.parametrize("engine", [Engine.VLLM, Engine.SGLANG])
async def test_an_adapter_routes_to_its_workers_and_keys_apart(
    engine: Engine, redis: RedisServer, index_server: IndexServer, start_sim: StartSim,
    start_gateway: StartGateway, http: aiohttp.ClientSession,
) -> None:
    version = VERSIONS[engine]
    sims = {"w0": await start_sim(engine=engine, engine_version=version,
                                  lora_adapters=("sql",)),
            "w1": await start_sim(engine=engine, engine_version=version),
            "w2": await start_sim(engine=engine, engine_version=version,
                                  lora_adapters=("sql", "poem"))}
    models = (ModelConfig(name=MODEL, block_size=BLOCK, engine=engine),)
    async with cluster(redis, index_server, sims, start_gateway, http, models=models) as c:
        body = of("sql", chat("list the tables"))

        async def learned() -> bool:
            async with http.post(c.gateway.url + "/admin/explain", json=body,
                                 headers=ADMIN) as resp:
                return resp.status == 200

        await wait_until_async(learned, timeout=10, what="the adapters learned")
        explained = await c.explain(body)
        assert {x["worker"] for x in explained["candidates"]} == {"w0", "w2"}
        async with http.get(c.gateway.url + "/v1/models") as resp:
            listed = {(m["id"], m.get("parent")) for m in (await resp.json())["data"]}
        assert listed == {(MODEL, None), ("sql", MODEL), ("poem", MODEL)}

        headers, cached = await c.send(body)
        holder = headers["x-cortex-assigned-worker"]
        assert holder in ("w0", "w2") and cached == 0

        async def held() -> bool:
            return bool((await c.candidate(body, holder))["index_tokens"] > 0)

        await wait_until_async(held, timeout=10, what="the adapter's blocks indexed")
        async with http.post(c.gateway.url + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
            answer = await resp.json()
            assert resp.headers["x-cortex-assigned-worker"] == holder
            assert resp.headers["x-cortex-match-mode"] == "exact_kv"
            hit = int(resp.headers["x-cortex-cache-hit-tokens"])
        assert answer["model"] == "sql"
        assert 0 < hit <= answer["usage"]["prompt_tokens_details"]["cached_tokens"]

        # the same prompt on the base model: the adapter's blocks are not its prefix
        base = chat("list the tables")
        assert all(x["index_tokens"] == 0 for x in (await c.explain(base))["candidates"])
        headers, cached = await c.send(base)
        assert headers["x-cortex-cache-hit-tokens"] == "0" and cached == 0

        async with http.post(c.gateway.url + "/v1/chat/completions",
                             json=of("nobody", chat("hi"))) as resp:
            assert resp.status == 404
            assert (await resp.json())["error"]["code"] == "model_not_found"
        metrics = await (await http.get(c.gateway.url + "/metrics")).text()
        assert 'cortex_gateway_cache_prediction_total{outcome="over"}' not in metrics
