"""Routing end to end: real Redis, index, ingest, sims and the gateway on 127.0.0.1.

The gateway's predicted hit tokens are checked against what the engine reports
(``usage.prompt_tokens_details.cached_tokens``): never more, and equal on a warm repeat.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest

from cortex.gateway.config.gateway import LoadConfig, RegistryConfig, RoutingConfig
from cortex.gateway.server import GatewayServer
from cortex.index.server import IndexServer
from cortex.ingest.config import IngestConfig
from cortex.ingest.forwarder import IndexTarget
from cortex.ingest.service import IngestService
from cortex.sim.server import SimServer
from cortex.testing import RedisServer, wait_until_async

from ..conftest import DECODE_ONLY, MODEL, TOKEN, StartGateway, StartSim, gateway_index, spec_of

ADMIN = {"Authorization": f"Bearer {TOKEN}"}
SYSTEM = "You are the cluster's careful assistant. Follow the house rules. " * 40
TAIL = " and a few more words to fill whole blocks" * 8


def chat(question: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "system", "content": SYSTEM},
                                         {"role": "user", "content": question}], **extra}


@dataclass
class Cluster:
    gateway: GatewayServer
    sims: dict[str, SimServer]
    http: aiohttp.ClientSession
    replicas: list[GatewayServer] = field(default_factory=list)  # gateway first

    async def explain(self, body: dict[str, Any]) -> dict[str, Any]:
        async with self.http.post(self.gateway.url + "/admin/explain", json=body,
                                  headers=ADMIN) as resp:
            assert resp.status == 200, await resp.text()
            result: dict[str, Any] = await resp.json()
            return result

    async def candidate(self, body: dict[str, Any], worker: str) -> dict[str, Any]:
        explained = await self.explain(body)
        return next(c for c in explained["candidates"] if c["worker"] == worker)

    async def send(self, body: dict[str, Any]) -> tuple[dict[str, str], int]:
        """Non-streaming request → (decision headers, engine cached_tokens)."""
        async with self.http.post(self.gateway.url + "/v1/chat/completions",
                                  json=body) as resp:
            assert resp.status == 200, await resp.text()
            payload = await resp.json()
            return dict(resp.headers), payload["usage"]["prompt_tokens_details"]["cached_tokens"]

    async def stream(self, body: dict[str, Any]) -> tuple[dict[str, str], int]:
        """Streaming request with usage → (decision headers, engine cached_tokens)."""
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        async with self.http.post(self.gateway.url + "/v1/chat/completions",
                                  json=body) as resp:
            assert resp.status == 200
            raw = (await resp.read()).decode()
        events = [e.removeprefix("data: ") for e in raw.split("\n\n") if e.strip()]
        assert events[-1] == "[DONE]"
        usage = json.loads(events[-2])["usage"]
        return dict(resp.headers), usage["prompt_tokens_details"]["cached_tokens"]


@contextlib.asynccontextmanager
async def cluster(redis: RedisServer, index: IndexServer, sims: dict[str, SimServer],
                  start_gateway: StartGateway, http: aiohttp.ClientSession,
                  routing: RoutingConfig | None = None, replicas: int = 1,
                  load: LoadConfig | None = None, **sections: Any) -> AsyncIterator[Cluster]:
    ingest_config = IngestConfig(index=(IndexTarget("127.0.0.1", index.port),),
                                 redis_url=redis.url, metrics_port=None, poll_interval_s=0.2,
                                 ingest_id="test-ingest")
    sections = {
        "registry": RegistryConfig(redis_url=redis.url, poll_interval_s=0.2),
        "index": gateway_index(index.target, retry_after_ms=200),
        **sections,
    }
    if routing is not None:
        sections["routing"] = routing
    if load is not None:
        sections["load"] = load
    specs = [spec_of(sim, wid) for wid, sim in sims.items()]
    gateways = [await start_gateway(specs, **sections) for _ in range(replicas)]
    async with IngestService(ingest_config):
        c = Cluster(gateways[0], sims, http, gateways)
        probes = iter(range(10_000))

        async def all_ready() -> bool:
            # a new query each time: a cached answer could predate the READY transitions
            explained = await c.explain(chat(f"warm up {next(probes)}{TAIL}"))
            return all(x["ledger"] == "ready" for x in explained["candidates"]) and len(
                explained["candidates"]) == len(sims)

        await wait_until_async(all_ready, timeout=20, what="every ledger READY")
        for replica in gateways[1:]:
            await wait_until_async(functools.partial(_sees_all_ready, http, replica, len(sims)),
                                   timeout=20, what="every ledger READY at every replica")
        yield c


async def _sees_all_ready(http: aiohttp.ClientSession, gateway: GatewayServer, workers: int
                          ) -> bool:
    async with http.get(gateway.url + "/admin/workers", headers=ADMIN) as resp:
        listing = (await resp.json())["workers"]
    return len(listing) == workers and all(w["ledger"] == "ready" and w["routable"]
                                           for w in listing)


async def wait_index_holds(c: Cluster, body: dict[str, Any], worker: str) -> int:
    """Wait until the index (not only predictions) credits ``worker``; its matched tokens."""
    tokens = 0

    async def held() -> bool:
        nonlocal tokens
        tokens = (await c.candidate(body, worker))["index_tokens"]
        return bool(tokens > 0)

    await wait_until_async(held, timeout=10, what=f"the index to credit {worker}")
    return tokens


@pytest.fixture
def redis(redis_server: RedisServer) -> RedisServer:
    return redis_server


async def test_same_prefix_lands_on_holder_until_its_cache_is_flushed(
    redis: RedisServer, index_server: IndexServer, start_sim: StartSim,
    start_gateway: StartGateway, http: aiohttp.ClientSession,
) -> None:
    sims = {f"w{i}": await start_sim() for i in range(3)}
    async with cluster(redis, index_server, sims, start_gateway, http) as c:
        headers, cached = await c.send(chat("first question"))
        holder = headers["x-cortex-assigned-worker"]
        assert (headers["x-cortex-cache-hit-tokens"], cached) == ("0", 0)

        second = chat("a second, different question")
        await wait_index_holds(c, second, holder)
        for _ in range(3):  # ties would rotate: the hit must keep it on the holder
            headers, cached = await c.stream(second)
            assert headers["x-cortex-assigned-worker"] == holder
            assert headers["x-cortex-match-mode"] == "exact_kv"
            hit = int(headers["x-cortex-cache-hit-tokens"])
            assert 0 < hit <= cached  # never over-predicted

        # warm repeat: once the index holds the whole prompt, prediction == engine report
        explained = await c.explain(second)
        full = explained["query_blocks"] * explained["block_size"]

        async def fully_held() -> bool:
            return bool((await c.candidate(second, holder))["index_tokens"] == full)

        await wait_until_async(fully_held, timeout=10, what="the whole prompt indexed")
        headers, cached = await c.send(second)
        assert int(headers["x-cortex-cache-hit-tokens"]) == cached == full

        # flush the holder: the index clears it, the change feed invalidates, hits vanish
        async with http.post(sims[holder].url + "/flush_cache") as resp:
            assert resp.status == 200

        async def no_credit() -> bool:
            cand = await c.candidate(second, holder)
            return bool(cand["index_tokens"] == 0 and cand["predicted_tokens"] == 0)

        await wait_until_async(no_credit, timeout=10, what="the flushed holder to lose credit")
        headers, cached = await c.send(second)
        assert headers["x-cortex-cache-hit-tokens"] == "0" and cached == 0
        assert headers["x-cortex-match-mode"] == "load_aware"

        metrics = await (await http.get(c.gateway.url + "/metrics")).text()
        assert 'cortex_gateway_cache_prediction_total{outcome="over"}' not in metrics
        assert 'cortex_gateway_decisions_total{mode="exact_kv",reason="hit"}' in metrics
        assert 'cortex_gateway_match_source_total{source="replica"}' in metrics
        assert 'cortex_gateway_match_source_total{source="index"}' not in metrics
        assert 'cortex_gateway_replica_state{state="synced"} 1.0' in metrics


def long_chat(tag: str, question: str, **extra: Any) -> dict[str, Any]:
    """A brand-new ~2,400-token system prompt per ``tag`` (its hit outweighs ~37 active
    requests at the default weights) and a question."""
    system = f"[{tag}] " + SYSTEM * 4
    return {"model": MODEL, "messages": [{"role": "system", "content": system},
                                         {"role": "user", "content": question}], **extra}


async def burst(http: aiohttp.ClientSession, urls: list[str], bodies: list[dict[str, Any]]
                ) -> list[dict[str, str]]:
    """Send every body at once (body ``i`` to ``urls[i % len(urls)]``): decision headers."""

    async def one(i: int, body: dict[str, Any]) -> dict[str, str]:
        async with http.post(urls[i % len(urls)] + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            await resp.read()
            return dict(resp.headers)

    return await asyncio.gather(*(one(i, b) for i, b in enumerate(bodies)))


async def test_a_simultaneous_burst_of_a_new_prefix_lands_on_one_worker(
    redis: RedisServer, index_server: IndexServer, start_sim: StartSim,
    start_gateway: StartGateway, http: aiohttp.ClientSession,
) -> None:
    sims = {f"w{i}": await start_sim() for i in range(3)}
    async with cluster(redis, index_server, sims, start_gateway, http) as c:
        # all in flight at once: routed before any BlockStored can reach the index
        replies = await burst(http, [c.gateway.url],
                              [long_chat("burst", f"question {i}") for i in range(16)])
        assert len({h["x-cortex-assigned-worker"] for h in replies}) == 1, replies
        modes = sorted(h["x-cortex-match-mode"] for h in replies)
        assert modes == ["exact_kv"] * 15 + ["load_aware"]  # the first decision, then its hit
        reasons = {h["x-cortex-match-reason"] for h in replies}
        assert reasons <= {"prefix_hash", "predicted_hit", "hit"}


async def test_a_burst_spills_over_once_the_holder_reaches_its_watermark(
    redis: RedisServer, index_server: IndexServer, start_sim: StartSim,
    start_gateway: StartGateway, http: aiohttp.ClientSession,
) -> None:
    sims = {f"w{i}": await start_sim(timing=DECODE_ONLY) for i in range(2)}
    routing = RoutingConfig(high_watermark=3, load_stale_after_s=5.0)
    async with cluster(redis, index_server, sims, start_gateway, http, routing) as c:
        held: list[aiohttp.ClientResponse] = []

        async def hold(i: int) -> str:  # a stream that stays open until the test closes it
            resp = await http.post(c.gateway.url + "/v1/chat/completions", json=long_chat(
                "spill", f"story {i}", stream=True, ignore_eos=True, max_tokens=300))
            held.append(resp)
            assert resp.status == 200
            await resp.content.readuntil(b"\n\n")
            return resp.headers["x-cortex-assigned-worker"]

        try:
            workers = await asyncio.gather(*(hold(i) for i in range(6)))
            reasons = sorted(r.headers["x-cortex-match-reason"] for r in held)
        finally:
            for resp in held:
                resp.close()
        # affinity fills the holder up to its watermark, the rest go to the other worker
        # (which then follows its own prediction): never more than 3 on either
        assert sorted(workers.count(w) for w in sims) == [3, 3]
        assert reasons.count("over_watermark") == 1  # the request that spilled first
        assert reasons.count("predicted_hit") + reasons.count("hit") == 4


async def test_a_prompt_nobody_holds_goes_to_an_idle_worker_not_by_hash_to_a_busy_one(
    redis: RedisServer, index_server: IndexServer, start_sim: StartSim,
    start_gateway: StartGateway, http: aiohttp.ClientSession,
) -> None:
    sims = {f"w{i}": await start_sim(timing=DECODE_ONLY) for i in range(2)}
    async with cluster(redis, index_server, sims, start_gateway, http) as c:
        # on the idle cluster the prefix hash spreads new prompts over both workers
        hashed = {tag: (await c.explain(long_chat(tag, "probe")))["decision"]
                  for tag in (f"new {i}" for i in range(12))}
        assert {d["reason"] for d in hashed.values()} == {"prefix_hash"}
        on_w0 = [tag for tag, d in hashed.items() if d["worker"] == "w0"]
        assert 2 <= len(on_w0) < len(hashed)
        busy = await http.post(c.gateway.url + "/v1/chat/completions", json=long_chat(
            on_w0[0], "a long story", stream=True, ignore_eos=True, max_tokens=300))
        try:
            assert busy.status == 200
            await busy.content.readuntil(b"\n\n")  # running on w0, decoding
            assert busy.headers["x-cortex-assigned-worker"] == "w0"
            for tag in on_w0[1:]:  # the hash's choice is busy now: the idle worker gets it
                decision = (await c.explain(long_chat(tag, "probe")))["decision"]
                assert (decision["worker"], decision["reason"]) == ("w1", "no_hit"), tag
            headers, _ = await c.send(long_chat(on_w0[1], "sent", max_tokens=2))
            assert headers["x-cortex-assigned-worker"] == "w1"
        finally:
            busy.close()


async def test_a_failure_before_the_first_byte_moves_the_predicted_blocks_along(
    redis: RedisServer, index_server: IndexServer, start_sim: StartSim,
    start_gateway: StartGateway, http: aiohttp.ClientSession,
) -> None:
    sims = {"broken": await start_sim(), "good": await start_sim()}
    async with cluster(redis, index_server, sims, start_gateway, http) as c:
        sims["broken"].faults.update({"error_rate": 1.0, "error_status": 503})
        # a new prefix whose hash picks the broken worker (explain neither credits nor sends)
        for i in range(100):
            tag = f"moved {i}"
            if (await c.explain(long_chat(tag, "probe")))["decision"]["worker"] == "broken":
                break
        headers, _ = await c.send(long_chat(tag, "first"))
        assert (headers["x-cortex-assigned-worker"], headers["x-cortex-attempts"]) == ("good", "2")
        explained = await c.explain(long_chat(tag, "next"))
        credit = {x["worker"]: x["predicted_tokens"] for x in explained["candidates"]}
        assert credit["broken"] == 0 and credit["good"] > 0  # withdrawn, then re-credited
        headers, _ = await c.send(long_chat(tag, "second"))
        assert headers["x-cortex-assigned-worker"] == "good"
        assert headers["x-cortex-attempts"] == "1"
        assert headers["x-cortex-match-reason"] in ("predicted_hit", "hit")


async def test_two_replicas_send_a_new_prefix_to_the_same_worker(
    redis: RedisServer, index_server: IndexServer, start_sim: StartSim,
    start_gateway: StartGateway, http: aiohttp.ClientSession,
) -> None:
    sims = {f"w{i}": await start_sim() for i in range(4)}
    # Each replica sees its own requests at once and the other's only through the engines'
    # polled load. Polled at start only here, so the two views of a burst differ by each
    # replica's own requests alone — what the tie tolerance is for — and not, now and then,
    # by a poll that caught the other replica's first requests.
    routing = RoutingConfig(load_stale_after_s=600.0)
    async with cluster(redis, index_server, sims, start_gateway, http, routing, replicas=2,
                       load=LoadConfig(poll_interval_s=300.0)) as c:
        urls = [gw.url for gw in c.replicas]
        holders = set()
        for tag in ("first", "second"):  # prefixes that no replica has seen
            replies = await burst(http, urls, [long_chat(tag, f"q {i}") for i in range(16)])
            workers = {h["x-cortex-assigned-worker"] for h in replies}
            assert len(workers) == 1, (tag, replies)
            reasons = [h["x-cortex-match-reason"] for h in replies]
            assert reasons.count("prefix_hash") in (1, 2)  # each replica's first decision
            assert set(reasons) <= {"prefix_hash", "predicted_hit", "hit"}
            holders |= workers
        # the same decision for a prefix at either replica, whichever sees it first
        for tag in ("fourth", "fifth", "sixth", "seventh"):
            first = await c.explain(long_chat(tag, "probe"))
            async with http.post(urls[1] + "/admin/explain", json=long_chat(tag, "other"),
                                 headers=ADMIN) as resp:
                second = await resp.json()
            assert first["decision"]["reason"] == second["decision"]["reason"] == "prefix_hash"
            assert first["decision"]["worker"] == second["decision"]["worker"]
            holders.add(first["decision"]["worker"])
        assert len(holders) > 1  # different prefixes spread over the workers


async def test_hot_holder_over_its_watermark_sheds_new_requests(
    redis: RedisServer, index_server: IndexServer, start_sim: StartSim,
    start_gateway: StartGateway, http: aiohttp.ClientSession,
) -> None:
    sims = {f"w{i}": await start_sim(timing=DECODE_ONLY, output_tokens=(2, 3)) for i in range(2)}
    routing = RoutingConfig(high_watermark=2, load_stale_after_s=5.0)
    async with cluster(redis, index_server, sims, start_gateway, http, routing) as c:
        headers, _ = await c.send(chat("seed the prefix"))
        holder = headers["x-cortex-assigned-worker"]
        other = next(w for w in sims if w != holder)
        await wait_index_holds(c, chat("next"), holder)
        # two long requests with the prefix fill the holder up to its watermark
        long_body = chat("tell a long story", stream=True, ignore_eos=True, max_tokens=300)
        held: list[aiohttp.ClientResponse] = []
        try:
            for _ in range(2):
                resp = await http.post(c.gateway.url + "/v1/chat/completions", json=long_body)
                assert resp.headers["x-cortex-assigned-worker"] == holder
                await resp.content.readuntil(b"\n\n")
                held.append(resp)
            headers, _ = await c.send(chat("one more question"))
            assert headers["x-cortex-assigned-worker"] == other
            assert headers["x-cortex-match-reason"] in ("over_watermark", "no_hit")
            explained = await c.explain(chat("one more question"))
            hot = next(x for x in explained["candidates"] if x["worker"] == holder)
            assert hot["credit_note"] == "over_watermark" and hot["index_tokens"] > 0
        finally:
            for resp in held:
                resp.close()


async def test_redis_outage_degrades_readiness_but_not_serving(
    redis: RedisServer, start_sim: StartSim, start_gateway: StartGateway,
    http: aiohttp.ClientSession,
) -> None:
    sim = await start_sim()
    gw = await start_gateway([spec_of(sim, "w1")],
                             registry=RegistryConfig(redis_url=redis.url, poll_interval_s=0.2,
                                                     lease_ttl_s=2.0))
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(redis.url)
    try:
        async def lease_renewed() -> bool:
            ttl = await client.pttl("cortex:v1:worker:w1")
            return bool(ttl > 1500)

        await wait_until_async(lease_renewed, timeout=5, what="the lease to be renewed")
    finally:
        await client.aclose()
    redis.stop()

    async def degraded() -> bool:
        async with http.get(gw.url + "/health/ready") as resp:
            return resp.status == 200 and "no_redis" in (await resp.json())["degraded"]

    await wait_until_async(degraded, timeout=10, what="readiness to report no_redis")
    async with http.post(gw.url + "/v1/chat/completions", json=chat("still served?")) as resp:
        assert resp.status == 200
    redis.start()

    async def recovered() -> bool:
        async with http.get(gw.url + "/health/ready") as resp:
            return "no_redis" not in (await resp.json())["degraded"]

    await wait_until_async(recovered, timeout=10, what="the registry to come back")
