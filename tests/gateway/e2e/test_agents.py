"""Agents end to end (real Redis, index, ingest, sims and the gateway on 127.0.0.1): a
session's turns stay home, every answer carries its reuse accounting and keeps
``delivered <= captured <= available``, and a worker whose KV pool is full is not given a
new prefix while another has free blocks."""

from __future__ import annotations

import logging
from typing import Any

import aiohttp
import pytest

from cortex.index.server import IndexServer
from cortex.sim.server import SimServer
from cortex.testing import RedisServer, wait_until_async

from ..conftest import MODEL, StartGateway, StartSim
from .test_cluster import SYSTEM, Cluster, cluster


def reuse_of(headers: dict[str, str]) -> dict[str, str]:
    fields = (part.strip().partition("=") for part in headers["x-cortex-reuse"].split(";"))
    return {k: v for k, _, v in fields}


async def engine_holds(http: aiohttp.ClientSession, sim: SimServer, body: dict[str, Any]
                       ) -> int:
    """The tokens of ``body``'s prompt that ``sim`` holds in full blocks, read from the sim."""
    async with http.post(sim.url + "/tokenize", json={"model": body["model"],
                                                      "messages": body["messages"]}) as resp:
        ids = (await resp.json())["tokens"]
    async with http.get(sim.url + "/sim/cache?tokens=1") as resp:
        listing = await resp.json()
    size = listing["block_size"]
    blocks = {(b["parent"], tuple(b["tokens"])): b["hash"] for b in listing["blocks"]}
    parent, held = None, 0
    while held + size <= len(ids) and (parent, tuple(ids[held:held + size])) in blocks:
        parent = blocks[parent, tuple(ids[held:held + size])]
        held += size
    return held


async def wait_ledger_holds(c: Cluster, body: dict[str, Any], worker: str) -> None:
    """Wait until the ledger credits ``worker`` with every block of ``body`` the engine holds:
    the KV events of the turn before have arrived."""
    async def caught_up() -> bool:
        held = await engine_holds(c.http, c.sims[worker], body)
        return bool((await c.candidate(body, worker))["index_tokens"] >= held > 0)

    await wait_until_async(caught_up, timeout=10, what=f"the ledger to learn {worker}'s blocks")


def turns(session: str, n: int) -> list[dict[str, Any]]:
    """``n`` growing turns of one agent session (a tool result appended each time)."""
    history = [{"role": "system", "content": SYSTEM},
               {"role": "user", "content": f"task of {session}: fix the build"}]
    out = []
    for k in range(n):
        if k:
            history += [{"role": "assistant", "content": f"calling tool {k} for {session}"},
                        {"role": "user", "content": f"tool result {k}: ok " * 12}]
        out.append({"model": MODEL, "max_tokens": 4, "messages": list(history)})
    return out


async def test_a_sessions_turns_stay_home_and_reuse_is_accounted(
    redis_server: RedisServer, index_server: IndexServer, start_sim: StartSim,
    start_gateway: StartGateway, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="cortex.gateway.access")
    sims = {f"w{i}": await start_sim() for i in range(2)}
    async with cluster(redis_server, index_server, sims, start_gateway, http) as c:
        homes: dict[str, set[str]] = {}
        for session in ("alpha", "beta", "gamma"):
            for k, body in enumerate(turns(session, 4)):
                if k:  # what the engine will deliver must be known, or captured lags it
                    await wait_ledger_holds(c, body, *homes[session])
                async with http.post(c.gateway.url + "/v1/chat/completions", json=body,
                                     headers={"x-session-id": session}) as resp:
                    assert resp.status == 200, await resp.text()
                    payload = await resp.json()
                    headers = dict(resp.headers)
                reuse = reuse_of(headers)
                delivered = payload["usage"]["prompt_tokens_details"]["cached_tokens"]
                assert int(reuse["delivered"]) == delivered
                assert delivered <= int(reuse["captured"]) <= int(reuse["available"])
                homes.setdefault(session, set()).add(headers["x-cortex-assigned-worker"])
        assert all(len(workers) == 1 for workers in homes.values()), homes
        metrics = await (await http.get(c.gateway.url + "/metrics")).text()
        assert 'cortex_gateway_session_hints_total{outcome="kept"} 9.0' in metrics
        access = [r for r in caplog.records if r.name == "cortex.gateway.access"
                  and getattr(r, "path", "") == "/v1/chat/completions"]
        assert len(access) == 12
        for record in access:
            fields = record.__dict__
            assert fields["reuse_delivered"] <= fields["reuse_captured"] <= fields[
                "reuse_available"]
            assert "reuse_captured=" in record.getMessage()
        assert 'kind="delivered"' in metrics
        assert "cortex_gateway_reuse_prompt_tokens_total" in metrics


async def test_a_full_kv_pool_does_not_get_a_new_prefix_while_another_has_room(
    redis_server: RedisServer, index_server: IndexServer, start_sim: StartSim,
    start_gateway: StartGateway, http: aiohttp.ClientSession,
) -> None:
    sims = {f"w{i}": await start_sim(kv_capacity_blocks=64) for i in range(2)}
    async with cluster(redis_server, index_server, sims, start_gateway, http) as c:
        # fill w0's pool past full with prompts sent to it directly (it evicts)
        for i in range(4):
            body = {"model": MODEL, "max_tokens": 2, "messages": [
                {"role": "user", "content": f"filler {i} " + "lorem ipsum dolor " * 60}]}
            async with http.post(sims["w0"].url + "/v1/chat/completions", json=body) as resp:
                assert resp.status == 200

        def new_prefix(i: int) -> dict[str, Any]:
            return {"model": MODEL, "max_tokens": 2, "messages": [
                {"role": "user", "content": f"new prefix {i}: " + "alpha beta " * 40}]}

        async def w0_full() -> bool:
            explained = await c.explain(new_prefix(0))
            w0 = next(x for x in explained["candidates"] if x["worker"] == "w0")
            return bool(w0["kv_pressure"] > 0)

        await wait_until_async(w0_full, timeout=20, what="the gateway to see w0's pool full")
        chosen = []
        for i in range(6):
            headers, _ = await c.send(new_prefix(i))
            chosen.append(headers["x-cortex-assigned-worker"])
        assert chosen == ["w1"] * 6
