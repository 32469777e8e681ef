"""The fleet heals itself: leases re-asserted by probes, tombstones, busy workers kept.

Real Redis (restarted empty inside a test), real sims, real gateways on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from cortex.gateway.config.gateway import HealthConfig, RegistryConfig
from cortex.gateway.server import GatewayServer
from cortex.registry import RedisRegistry
from cortex.sim.config import SimConfig
from cortex.sim.server import SimServer
from cortex.testing import RedisServer, wait_until_async

from ..conftest import BLOCK, DECODE_ONLY, MODEL, TOKEN, ZERO, StartGateway, StartSim, spec_of

pytestmark = pytest.mark.timeout(60)

ADMIN = {"Authorization": f"Bearer {TOKEN}"}
INTERVAL_S = 0.2
LEASE_S = 2.0


def chat(text: str) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 4,
            "messages": [{"role": "user", "content": text}]}


def fleet_sections(redis_url: str, *, lease_s: float = LEASE_S, remove_after_s: float = 30.0,
                   timeout_s: float = 1.0) -> dict[str, Any]:
    return {
        "registry": RegistryConfig(redis_url=redis_url, lease_ttl_s=lease_s,
                                   poll_interval_s=INTERVAL_S),
        "health": HealthConfig(interval_s=INTERVAL_S, timeout_s=timeout_s,
                               remove_after_s=remove_after_s),
    }


@pytest.fixture
async def registry(redis_server: RedisServer) -> AsyncIterator[RedisRegistry]:
    async with RedisRegistry(redis_server.url) as reg:
        yield reg


async def pool_of(http: aiohttp.ClientSession, gw: GatewayServer) -> dict[str, Any]:
    async with http.get(gw.url + "/admin/workers", headers=ADMIN) as resp:
        return {w["id"]: w for w in (await resp.json())["workers"]}


async def wait_routable(http: aiohttp.ClientSession, gw: GatewayServer, *ids: str) -> None:
    async def ready() -> bool:
        pool = await pool_of(http, gw)
        return all(pool.get(i, {}).get("routable") for i in ids)

    await wait_until_async(ready, timeout=10, what=f"{ids} routable")


async def registered(registry: RedisRegistry, worker_id: str) -> bool:
    with contextlib.suppress(Exception):  # the registry may be restarting
        return await registry.get(worker_id) is not None
    return False


async def probes(http: aiohttp.ClientSession, gw: GatewayServer) -> float:
    async with http.get(gw.url + "/metrics") as resp:
        text = await resp.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("cortex_gateway_health_probes_total{"))


async def test_redis_restarted_empty_every_reachable_worker_is_back_within_one_lease(
    start_sim: StartSim, start_gateway: StartGateway, http: aiohttp.ClientSession,
    redis_server: RedisServer, registry: RedisRegistry,
) -> None:
    seeded, added = await start_sim(), await start_sim()
    gw = await start_gateway([spec_of(seeded, "seeded")], **fleet_sections(redis_server.url))
    await registry.register(spec_of(added, "added", labels={"zone": "b"}), ttl_s=LEASE_S)
    await wait_routable(http, gw, "seeded", "added")

    statuses: list[int] = []
    stop = asyncio.Event()

    async def load() -> None:
        while not stop.is_set():
            async with http.post(gw.url + "/v1/chat/completions", json=chat("hi")) as resp:
                statuses.append(resp.status)

    loader = asyncio.create_task(load())
    await wait_until_async(lambda: len(statuses) >= 5, timeout=10, what="load running")
    await asyncio.to_thread(redis_server.stop)  # no persistence: every lease is gone
    await asyncio.to_thread(redis_server.start)

    async def both_back() -> bool:
        return await registered(registry, "seeded") and await registered(registry, "added")

    await wait_until_async(both_back, timeout=LEASE_S, interval=0.05,
                           what="every reachable worker registered again")
    served = len(statuses)
    await wait_until_async(lambda: len(statuses) >= served + 5, timeout=10, what="more load")
    stop.set()
    await loader
    assert set(statuses) == {200}, statuses  # no request failed meanwhile
    # it came back with its last known spec, labels and all
    assert await registry.get("added") == spec_of(added, "added", labels={"zone": "b"})


async def test_a_worker_restarted_on_the_same_address_is_back_and_a_lapsed_one_returns(
    start_sim: StartSim, start_gateway: StartGateway, http: aiohttp.ClientSession,
    redis_server: RedisServer, registry: RedisRegistry,
) -> None:
    other = await start_sim()
    config = SimConfig(port=0, kv_events_port=0, replay_port=0, block_size=BLOCK, model=MODEL,
                       timing=ZERO)
    first = SimServer(config)
    await first.__aenter__()
    same = SimConfig(port=first.port, kv_events_port=first.kv_events_port,
                     replay_port=first.replay_port, block_size=BLOCK, model=MODEL, timing=ZERO)
    spec = spec_of(first, "a", labels={"rack": "7"})
    # leases lapse one second after the probes start failing: "gone" happens quickly here
    gw = await start_gateway([spec_of(other, "b")],
                             **fleet_sections(redis_server.url, lease_s=1.0, remove_after_s=0))
    await registry.register(spec, ttl_s=1.0)
    await wait_routable(http, gw, "a", "b")

    await first.aclose()  # the worker dies ...

    async def lapsed() -> bool:
        return "a" not in await pool_of(http, gw) and not await registered(registry, "a")

    await wait_until_async(lapsed, timeout=10, what="a's lease to lapse")
    async with SimServer(same):  # ... and comes back on the same address
        await wait_routable(http, gw, "a")
        assert await registry.get("a") == spec  # its last known spec, labels and all
        async with http.post(gw.url + "/v1/chat/completions", json=chat("back?")) as resp:
            assert resp.status == 200


async def test_a_worker_busy_with_this_gateways_request_is_not_removed(
    start_sim: StartSim, start_gateway: StartGateway, http: aiohttp.ClientSession,
    redis_server: RedisServer, registry: RedisRegistry,
) -> None:
    sim = await start_sim(timing=DECODE_ONLY)
    # a 2 s lease (a renewal at most every 0.5 s: 0.2 s apart, probes time out at 0.3 s;
    # margin for a loaded machine) that the 3 s request outlasts
    gw = await start_gateway([], **fleet_sections(redis_server.url, lease_s=2.0,
                                                  remove_after_s=0, timeout_s=0.3))
    await registry.register(spec_of(sim, "busy"), ttl_s=2.0)
    await wait_routable(http, gw, "busy")
    # every path answers 3 s late: health probes time out (0.3 s) like those of an engine
    # busy with one huge prompt, and the request itself takes 3 s
    sim.set_faults(latency_ms=3000, fault_paths="all")
    request = asyncio.create_task(http.post(gw.url + "/v1/chat/completions", json=chat("x")))
    present: list[bool] = []

    async def answered() -> bool:
        present.append(await registered(registry, "busy"))
        return request.done()

    await wait_until_async(answered, timeout=20, interval=0.05, what="the slow answer")
    async with await request as resp:
        assert resp.status == 200
    assert len(present) > 20 and all(present)  # > 2 s of lease: it was renewed throughout

    # idle, the same timeouts are evidence: the lease lapses and the worker leaves
    async def removed() -> bool:
        return not await registered(registry, "busy")

    await wait_until_async(removed, timeout=10, what="the idle, unreachable worker to go")


async def test_an_operator_removal_is_a_tombstone_no_replica_overrides(
    start_sim: StartSim, start_gateway: StartGateway, http: aiohttp.ClientSession,
    redis_server: RedisServer, registry: RedisRegistry,
) -> None:
    doomed, kept = await start_sim(), await start_sim()
    seeds = [spec_of(doomed, "doomed"), spec_of(kept, "kept")]
    one = await start_gateway(seeds, **fleet_sections(redis_server.url))
    two = await start_gateway(seeds, **fleet_sections(redis_server.url))
    await wait_routable(http, one, "doomed", "kept")
    await wait_routable(http, two, "doomed", "kept")

    async with http.delete(one.url + "/admin/workers/doomed?for_s=600",
                           headers=ADMIN) as resp:
        assert resp.status == 200
        assert (await resp.json())["had_lease"] is True
    assert "doomed" not in await pool_of(http, one)  # at once on the replica that removed it

    async def out_everywhere() -> bool:
        return "doomed" not in await pool_of(http, two)

    await wait_until_async(out_everywhere, timeout=10, what="the other replica to drop it")
    # both replicas keep probing "kept" and could reach "doomed": it must stay out
    seen = await probes(http, two)

    async def rounds_later() -> bool:
        return await probes(http, two) >= seen + 5

    await wait_until_async(rounds_later, timeout=10, what="five more probe rounds")
    assert not await registered(registry, "doomed")
    assert "doomed" not in await pool_of(http, one) and "doomed" not in await pool_of(http, two)
    stone = (await registry.list()).tombstones["doomed"]
    assert stone.reason == "admin API" and stone.ttl_s is not None and stone.ttl_s <= 600
    async with http.delete(one.url + "/admin/workers/doomed", headers=ADMIN) as resp:
        assert resp.status == 404  # not registered, not known: nothing to remove

    # a replica that starts with the worker as a static seed does not seed it either
    three = await start_gateway(seeds, **fleet_sections(redis_server.url))
    await wait_routable(http, three, "kept")
    assert "doomed" not in await pool_of(http, three)
    assert not await registered(registry, "doomed")

    # an operator adds it again: the tombstone goes, the worker is back everywhere
    async with http.post(one.url + "/admin/workers", headers=ADMIN,
                         json=spec_of(doomed, "doomed").to_dict()) as resp:
        assert resp.status == 201
    for gw in (one, two, three):
        await wait_routable(http, gw, "doomed")
    assert "doomed" not in (await registry.list()).tombstones


async def test_a_removal_without_tombstone_lets_a_reachable_worker_return(
    start_sim: StartSim, start_gateway: StartGateway, http: aiohttp.ClientSession,
    redis_server: RedisServer, registry: RedisRegistry,
) -> None:
    sim = await start_sim()
    gw = await start_gateway([], **fleet_sections(redis_server.url))
    await registry.register(spec_of(sim, "w"), ttl_s=LEASE_S)
    await wait_routable(http, gw, "w")
    async with http.delete(gw.url + "/admin/workers/w?tombstone=false", headers=ADMIN) as resp:
        assert (resp.status, (await resp.json())["tombstone"]) == (200, None)

    async def back() -> bool:
        return await registered(registry, "w")

    await wait_until_async(back, timeout=LEASE_S, what="the reachable worker re-asserted")
    async with http.delete(gw.url + "/admin/workers/w?for_s=-1", headers=ADMIN) as resp:
        assert (resp.status, (await resp.json())["error"]["param"]) == (400, "for_s")


async def test_a_url_with_credentials_is_rejected_by_the_admin_api(
    start_gateway: StartGateway, http: aiohttp.ClientSession,
) -> None:
    gw = await start_gateway([])
    spec = {"id": "w", "url": "http://user:secret@127.0.0.1:9", "engine": "sglang",
            "model": MODEL}
    async with http.post(gw.url + "/admin/workers", headers=ADMIN, json=spec) as resp:
        body = await resp.json()
    assert resp.status == 400 and body["error"]["code"] == "invalid_request"
    assert "credentials" in body["error"]["message"] and "secret" not in str(body)
    assert await pool_of(http, gw) == {}


async def test_series_of_workers_that_left_are_removed_from_the_metrics(
    start_sim: StartSim, start_gateway: StartGateway, http: aiohttp.ClientSession,
    redis_server: RedisServer, registry: RedisRegistry,
) -> None:
    sims = [await start_sim() for _ in range(3)]
    gw = await start_gateway([], **fleet_sections(redis_server.url))
    for i, sim in enumerate(sims):
        await registry.register(spec_of(sim, f"w{i}"), ttl_s=LEASE_S)
    await wait_routable(http, gw, "w0", "w1", "w2")
    for i in range(3):
        async with http.post(gw.url + "/v1/chat/completions", json=chat(f"q{i}")) as resp:
            assert resp.status == 200

    async def metrics() -> str:
        async with http.get(gw.url + "/metrics") as resp:
            return await resp.text()

    assert 'worker="w1"' in await metrics()
    for worker_id in ("w1", "w2"):
        async with http.delete(f"{gw.url}/admin/workers/{worker_id}", headers=ADMIN) as resp:
            assert resp.status == 200
    text = await metrics()
    assert 'worker="w1"' not in text and 'worker="w2"' not in text
    assert 'cortex_gateway_worker_healthy{worker="w0"} 1.0' in text
