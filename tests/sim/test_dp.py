"""Data-parallel ranks: a KV pool, prefix cache and event stream each; the engine's rank pick."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import zmq.asyncio

from cortex.hashing import Engine
from cortex.kvevents.codec import BlockStored
from cortex.kvevents.frames import ReplayEnd, parse_replay_reply, replay_request
from cortex.sim.config import Role, TimingConfig
from cortex.sim.dp import RankPicker
from cortex.sim.server import SimServer
from cortex.sim.testkit import EventSubscriber, StartSim, chat_body
from cortex.testing import wait_until_async

PROMPT = list(range(2000, 2017))  # 17 tokens: 4 full blocks of 4 can be hits


async def post(http: aiohttp.ClientSession, url: str, body: Any,
               headers: dict[str, str] | None = None) -> tuple[int, Any]:
    async with http.post(url, json=body, headers=headers) as resp:
        return resp.status, await resp.json(content_type=None)


def generate(ids: list[int], **extra: Any) -> dict[str, Any]:
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": 1}, **extra}


async def replayed(endpoint: str) -> int:
    """How many batches a replay DEALER gets back from seq 0."""
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        await sock.send_multipart(replay_request(0))
        count = 0
        while not isinstance(parse_replay_reply(await asyncio.wait_for(sock.recv_multipart(),
                                                                       10)), ReplayEnd):
            count += 1
        return count
    finally:
        sock.close(linger=0)
        ctx.term()


@contextlib.asynccontextmanager
async def rank_subscribers(sim: SimServer, http: aiohttp.ClientSession
                           ) -> AsyncIterator[list[EventSubscriber]]:
    ctx = zmq.asyncio.Context()
    subs = [EventSubscriber.connect(ctx, sim.kv_events_endpoint_of(rank), sim.config.engine)
            for rank in range(sim.config.dp_size)]
    try:
        for sub in subs:
            await sub.sync(http, sim.url)
        yield subs
    finally:
        for sub in subs:
            sub.close()
        ctx.term()


def test_rank_choice_follows_each_engine() -> None:
    sglang = RankPicker(Engine.SGLANG, Role.REGULAR, 3)
    idle = [(0, 0)] * 3
    assert [sglang.pick(None, None, idle) for _ in range(4)] == [0, 1, 2, 0]  # round robin
    assert sglang.pick(2, None, idle) == 2 and sglang.pick(None, None, idle) == 1
    prefill = RankPicker(Engine.SGLANG, Role.PREFILL, 3)
    assert prefill.pick(None, 10, idle) == 1 and prefill.pick(None, None, idle) == 0
    vllm = RankPicker(Engine.VLLM, Role.REGULAR, 3)
    assert vllm.pick(None, None, [(0, 2), (0, 1), (0, 1)]) == 1  # least loaded, first on ties
    assert vllm.pick(None, None, [(1, 0), (0, 3), (0, 4)]) == 1  # 4 * waiting + running
    assert vllm.check(3) is not None and vllm.check(2) is None
    assert RankPicker(Engine.VLLM, Role.REGULAR, 1).check(7) is None  # dp 1 ignores it


async def test_sglang_ranks_have_their_own_cache_events_and_loads(
        start_sim: StartSim, http: aiohttp.ClientSession) -> None:
    sim = await start_sim(engine="sglang", dp_size=2, topic="kv")
    assert len(sim.engines) == 2
    async with rank_subscribers(sim, http) as subs:
        cached = []
        for _ in range(3):  # round robin: rank 0, 1, 0
            status, out = await post(http, sim.url + "/generate", generate(PROMPT))
            assert status == 200, out
            cached.append(out["meta_info"]["cached_tokens"])
        assert cached == [0, 0, 16]
        status, out = await post(http, sim.url + "/generate",
                                 generate(PROMPT, data_parallel_rank=1))
        assert out["meta_info"]["cached_tokens"] == 16  # pinned to rank 1's cache
        for rank, sub in enumerate(subs):
            await sub.wait_for(lambda sub=sub: any(isinstance(e, BlockStored) for e in sub.events))
            assert {batch.dp_rank for _, batch in sub.batches} == {rank}
        assert [e.cache.cached_blocks for e in sim.engines] == [4, 4]
    assert await replayed(sim.replay_endpoint_of(1) or "") > 0  # rank 1's replay socket
    async with http.get(sim.url + "/server_info") as resp:
        info = await resp.json()
    assert info["dp_size"] == 2 and info["kv_events"]["dp_size"] == 2
    assert info["kv_events"]["endpoint_port_base"] == sim.kv_events_port
    assert len(info["internal_states"]) == 2
    async with http.get(sim.url + "/get_load") as resp:
        assert [load["dp_rank"] for load in await resp.json()] == [0, 1]
    async with http.get(sim.url + "/v1/loads") as resp:
        loads = await resp.json()
        assert loads["dp_rank_count"] == 2 and len(loads["loads"]) == 2
    async with http.get(sim.url + "/sim/state") as resp:
        state = await resp.json()
        assert state["cache"]["cached_blocks"] == 8 and len(state["ranks"]) == 2
    assert sim.worker_spec()["dp_size"] == 2
    status, out = await post(http, sim.url + "/generate", generate(PROMPT, routed_dp_rank=2))
    assert status == 400 and "out of range" in out["message"]
    async with http.post(sim.url + "/flush_cache") as resp:
        assert resp.status == 200
    assert [e.cache.cached_blocks for e in sim.engines] == [0, 0]


async def test_vllm_ranks_take_the_header_and_balance_load(
        start_sim: StartSim, http: aiohttp.ClientSession) -> None:
    sim = await start_sim(engine="vllm", dp_size=2)
    body = {"model": "cortex-sim", "prompt": PROMPT, "max_tokens": 1}
    for _ in range(2):
        status, _ = await post(http, sim.url + "/v1/completions", body,
                               {"X-data-parallel-rank": "1"})
        assert status == 200
    assert [e.stats.requests_finished for e in sim.engines] == [0, 2]
    assert sim.engines[1].cache.lookup(PROMPT) == 16
    status, out = await post(http, sim.url + "/v1/completions", body,
                             {"X-data-parallel-rank": "5"})
    assert status == 400 and out["error"]["param"] == "data_parallel_rank"
    async with http.get(sim.url + "/metrics") as resp:
        metrics = await resp.text()
    assert 'vllm:num_requests_running{engine="1",model_name="cortex-sim"}' in metrics
    # Two long concurrent requests land on different (idle) ranks.
    slow = await start_sim(engine="vllm", dp_size=2,
                           timing=TimingConfig(decode_ms_per_token=10.0))
    first = asyncio.ensure_future(post(http, slow.url + "/v1/completions",
                                       {**body, "max_tokens": 40, "ignore_eos": True}))
    await wait_until_async(lambda: slow.engines[0].running == 1, what="the first request")
    await post(http, slow.url + "/v1/completions", body)
    await first
    assert [e.stats.requests_finished for e in slow.engines] == [1, 1]


async def test_sglang_pd_prefill_follows_the_bootstrap_room(
        start_sim: StartSim, http: aiohttp.ClientSession) -> None:
    prefill = await start_sim(engine="sglang", role="prefill", dp_size=2, bootstrap_port=0,
                              bootstrap_timeout_s=10.0)
    decode = await start_sim(engine="sglang", role="decode", dp_size=2, transfer_timeout_s=10.0)
    for room in (random.randrange(2**62) * 2 + 1, random.randrange(2**62) * 2):
        body = chat_body("which rank?", max_tokens=3, bootstrap_host="127.0.0.1",
                         bootstrap_port=prefill.bootstrap_port, bootstrap_room=room)
        (p_status, p_out), (d_status, d_out) = await asyncio.gather(
            post(http, prefill.url + "/v1/chat/completions", body),
            post(http, decode.url + "/v1/chat/completions", body))
        assert (p_status, d_status) == (200, 200), (p_out, d_out)
    assert [e.stats.requests_finished for e in prefill.engines] == [1, 1]
    assert [e.stats.requests_finished for e in decode.engines] == [1, 1]  # round robin


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
async def test_dp_size_one_ignores_rank_fields(start_sim: StartSim, http: aiohttp.ClientSession,
                                               engine: str) -> None:
    sim = await start_sim(engine=engine)
    status, out = await post(http, sim.url + "/v1/chat/completions",
                             chat_body("hi", data_parallel_rank=3),
                             {"X-data-parallel-rank": "3"})
    assert status == 200, out
