"""Prefill/decode pools end to end: real Redis, index, ingest, sims in PD roles, hypercorn.

The prefill worker is chosen by the ledger (its hit shows in ``x-cortex-cache-hit-tokens``
and in the engine's ``cached_tokens``), the decode worker by load; the handshake is the
engines' own (SGLang bootstrap rooms, vLLM ``kv_transfer_params``) and the KV really moves
between the sims. vLLM usage is fixed from the prefill leg.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest

from cortex.gateway.config.gateway import ModelConfig, PDConfig, RegistryConfig
from cortex.gateway.server import GatewayServer
from cortex.hashing import Engine
from cortex.index.server import IndexServer
from cortex.ingest.config import IngestConfig
from cortex.ingest.forwarder import IndexTarget
from cortex.ingest.service import IngestService
from cortex.sim.server import SimServer
from cortex.testing import RedisServer, wait_until_async

from ..conftest import BLOCK, MODEL, TOKEN, StartGateway, StartSim, gateway_index, spec_of

ADMIN = {"Authorization": f"Bearer {TOKEN}"}
SYSTEM = "You are the disaggregated cluster's assistant. Answer with care and brevity. " * 30


def chat(question: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "system", "content": SYSTEM},
                                         {"role": "user", "content": question}],
            "max_tokens": 6, **extra}


@dataclass
class PDCluster:
    gateway: GatewayServer
    prefill: dict[str, SimServer]
    decode: dict[str, SimServer]
    http: aiohttp.ClientSession

    async def explain(self, body: dict[str, Any]) -> dict[str, Any]:
        async with self.http.post(self.gateway.url + "/admin/explain", json=body,
                                  headers=ADMIN) as resp:
            assert resp.status == 200, await resp.text()
            result: dict[str, Any] = await resp.json()
            return result

    async def send(self, body: dict[str, Any], path: str = "/v1/chat/completions"
                   ) -> tuple[dict[str, str], Any]:
        async with self.http.post(self.gateway.url + path, json=body) as resp:
            assert resp.status == 200, await resp.text()
            return dict(resp.headers), await resp.json()

    async def stream(self, body: dict[str, Any]) -> tuple[dict[str, str], dict[str, Any], str]:
        """Streamed with usage → (headers, usage, generated text)."""
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        async with self.http.post(self.gateway.url + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            raw = (await resp.read()).decode()
        events = [e.removeprefix("data: ") for e in raw.split("\n\n") if e.strip()]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks
                       if c["choices"])
        return dict(resp.headers), chunks[-1]["usage"], text


@contextlib.asynccontextmanager
async def pd_cluster(engine: str, redis: RedisServer, index: IndexServer, start_sim: StartSim,
                     start_gateway: StartGateway, http: aiohttp.ClientSession,
                     pd: PDConfig | None = None) -> AsyncIterator[PDCluster]:
    extra = {"bootstrap_port": 0} if engine == "sglang" else {}
    prefill = {f"p{i}": await start_sim(engine=engine, role="prefill", **extra) for i in range(2)}
    decode = {f"d{i}": await start_sim(engine=engine, role="decode", transfer_timeout_s=30)
              for i in range(2)}
    specs = [spec_of(sim, wid, role="prefill", bootstrap_port=sim.bootstrap_port)
             for wid, sim in prefill.items()]
    specs += [spec_of(sim, wid, role="decode") for wid, sim in decode.items()]
    sections: dict[str, Any] = {
        "models": (ModelConfig(name=MODEL, block_size=BLOCK, engine=Engine(engine)),),
        "registry": RegistryConfig(redis_url=redis.url, poll_interval_s=0.2),
        "index": gateway_index(index.target, retry_after_ms=200),
    }
    if pd is not None:
        sections["pd"] = pd
    gw = await start_gateway(specs, **sections)
    ingest = IngestConfig(index=(IndexTarget("127.0.0.1", index.port),), redis_url=redis.url,
                          metrics_port=None, poll_interval_s=0.2, ingest_id="pd-ingest")
    async with IngestService(ingest):
        c = PDCluster(gw, prefill, decode, http)
        probes = iter(range(10_000))

        async def prefill_ledgers_ready() -> bool:
            explained = await c.explain(chat(f"warm up {next(probes)}"))
            return all(x["ledger"] == "ready" for x in explained["candidates"]) and len(
                explained["candidates"]) == len(prefill)

        await wait_until_async(prefill_ledgers_ready, timeout=20, what="prefill ledgers READY")
        yield c


async def wait_held(c: PDCluster, body: dict[str, Any], worker: str) -> None:
    async def held() -> bool:
        explained = await c.explain(body)
        cand = next(x for x in explained["candidates"] if x["worker"] == worker)
        return bool(cand["index_tokens"] > 0)

    await wait_until_async(held, timeout=10, what=f"the index to credit {worker}")


def usage_cached(usage: dict[str, Any]) -> int:
    cached: int = usage["prompt_tokens_details"]["cached_tokens"]
    return cached


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
async def test_pd_pair_follows_prefill_affinity_through_the_real_handshake(
    engine: str, redis_server: RedisServer, index_server: IndexServer, start_sim: StartSim,
    start_gateway: StartGateway, http: aiohttp.ClientSession,
) -> None:
    async with pd_cluster(engine, redis_server, index_server, start_sim, start_gateway,
                          http) as c:
        headers, body = await c.send(chat("the first question"))
        prefill = headers["x-cortex-prefill-worker"]
        assert prefill in c.prefill and headers["x-cortex-decode-worker"] in c.decode
        assert headers["x-cortex-pd"] == "disaggregated"
        assert headers["x-cortex-assigned-worker"] == headers["x-cortex-decode-worker"]
        assert headers["x-cortex-cache-hit-tokens"] == "0"
        usage = body["usage"]
        assert usage_cached(usage) == 0  # vLLM: not the decode's "everything was cached"
        assert usage["completion_tokens"] == 6
        assert usage["total_tokens"] == usage["prompt_tokens"] + 6

        second = chat("a second, different question")
        await wait_held(c, second, prefill)
        explained = await c.explain(second)
        assert explained["pd"]["prefill_worker"] == prefill
        assert explained["pd"]["decode_decision"]["reason"] == "load_only"
        assert explained["decision"]["worker"] == explained["pd"]["decode_worker"]

        headers, usage, text = await c.stream(second)
        assert text and headers["x-cortex-prefill-worker"] == prefill
        assert headers["x-cortex-match-mode"] == "exact_kv"
        hit = int(headers["x-cortex-cache-hit-tokens"])
        assert 0 < hit <= usage_cached(usage)  # the prefill's hit, never over-predicted
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]

        headers, body = await c.send(second)
        assert headers["x-cortex-prefill-worker"] == prefill
        assert 0 < int(headers["x-cortex-cache-hit-tokens"]) <= usage_cached(body["usage"])
        assert body["usage"]["prompt_tokens"] == usage["prompt_tokens"]

    # the KV really moved: every decode pulled from a prefill, none recomputed
    pulls = [sim.engine.stats for sim in c.decode.values()]
    assert sum(s.kv_pulls for s in pulls) == 3 and sum(s.kv_pull_failures for s in pulls) == 0
    if engine == "vllm":  # the decode counted the pulled KV as cached; the client did not
        assert sum(s.cached_tokens for s in pulls) > usage_cached(usage) + usage_cached(
            body["usage"])
    metrics = await (await http.get(c.gateway.url + "/metrics")).text()
    assert 'cortex_gateway_cache_prediction_total{outcome="over"}' not in metrics
    assert (f'cortex_gateway_pd_requests_total{{engine="{engine}",outcome="disaggregated"}} 3.0'
            in metrics)
    assert "cortex_gateway_pd_handoff_seconds_count" in metrics


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
async def test_pd_simultaneous_burst_of_a_new_prefix_lands_on_one_prefill_worker(
    engine: str, redis_server: RedisServer, index_server: IndexServer, start_sim: StartSim,
    start_gateway: StartGateway, http: aiohttp.ClientSession,
) -> None:
    async with pd_cluster(engine, redis_server, index_server, start_sim, start_gateway,
                          http) as c:
        system = "[a new prefix] " + SYSTEM * 3  # ~1,500 tokens: outweighs ~23 requests

        async def send(i: int) -> dict[str, str]:
            headers, _ = await c.send({"model": MODEL, "max_tokens": 6, "messages": [
                {"role": "system", "content": system}, {"role": "user", "content": f"q {i}"}]})
            return headers

        replies = await asyncio.gather(*(send(i) for i in range(8)))
        assert {h["x-cortex-pd"] for h in replies} == {"disaggregated"}
        assert len({h["x-cortex-prefill-worker"] for h in replies}) == 1, replies
        modes = sorted(h["x-cortex-match-mode"] for h in replies)
        assert modes == ["exact_kv"] * 7 + ["load_aware"]
        # decode legs are spread by load, counted from the decision on
        assert {h["x-cortex-decode-worker"] for h in replies} == set(c.decode)


async def test_pd_sglang_batches_get_one_room_per_sequence(
    redis_server: RedisServer, index_server: IndexServer, start_sim: StartSim,
    start_gateway: StartGateway, http: aiohttp.ClientSession,
) -> None:
    async with pd_cluster("sglang", redis_server, index_server, start_sim, start_gateway,
                          http) as c:
        headers, body = await c.send(chat("two answers please", n=2))
        assert headers["x-cortex-pd"] == "disaggregated"
        assert sorted(ch["index"] for ch in body["choices"]) == [0, 1]
        native = {"input_ids": [[1, 2, 3, 4, 5], [6, 7, 8, 9]],
                  "sampling_params": {"max_new_tokens": 3}}
        headers, body = await c.send(native, "/generate")
        assert [len(item["output_ids"]) for item in body] == [3, 3]
        stream = {"text": ["one prompt", "another prompt"], "stream": True,
                  "sampling_params": {"max_new_tokens": 2}}
        async with http.post(c.gateway.url + "/generate", json=stream) as resp:
            assert resp.status == 200
            assert (await resp.read()).rstrip().endswith(b"data: [DONE]")
    prefill_runs = sum(s.engine.stats.requests_finished for s in c.prefill.values())
    decode_runs = sum(s.engine.stats.requests_finished for s in c.decode.values())
    assert decode_runs >= 6 and prefill_runs >= 6  # 2 + 2 + 2 sequences, plus warm-ups


async def test_pd_vllm_conditional_disaggregation_prefills_on_the_decode(
    redis_server: RedisServer, index_server: IndexServer, start_sim: StartSim,
    start_gateway: StartGateway, http: aiohttp.ClientSession,
) -> None:
    pd = PDConfig(local_prefill_max_tokens=100_000, local_prefill_max_ratio=1.0)
    async with pd_cluster("vllm", redis_server, index_server, start_sim, start_gateway, http,
                          pd) as c:
        before = sum(s.engine.stats.requests_started for s in c.prefill.values())
        headers, body = await c.send(chat("short enough to prefill locally"))
        assert headers["x-cortex-pd"] == "local_prefill"
        assert headers["x-cortex-prefill-worker"] == headers["x-cortex-decode-worker"]
        assert body["usage"]["completion_tokens"] == 6
        explained = await c.explain(chat("another one"))
        assert explained["pd"]["mode"] == "local_prefill"
        assert explained["pd"]["local_prefill_reason"] == "short_uncached"
        # n > 1: one kv_transfer_params carries one sequence, so the decode prefills
        headers, body = await c.send(chat("two answers", n=2))
        assert headers["x-cortex-pd"] == "local_prefill" and len(body["choices"]) == 2
        assert sum(s.engine.stats.requests_started for s in c.prefill.values()) == before
