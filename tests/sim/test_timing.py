"""The timing model: cache hits and queueing show up in latency (lower bounds only)."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from cortex.sim.config import TimingConfig
from cortex.sim.testkit import StartSim
from cortex.sim.timing import TimingModel


def test_costs_scale_with_uncached_tokens_and_zero_cost_is_free() -> None:
    model = TimingModel(TimingConfig())
    assert 20 <= model.prefill_ms(2000) <= 100  # a cold 2,000-token prefill: tens of ms
    assert model.prefill_ms(0) == TimingConfig().prefill_overhead_ms
    assert model.decode_ms(10) == 10 * TimingConfig().decode_ms_per_token
    free = TimingModel(TimingConfig(zero_cost=True))
    assert free.prefill_ms(10_000) == 0 and free.decode_ms(100) == 0
    with pytest.raises(ValueError):
        TimingConfig(decode_ms_per_token=-1)


async def timed_generate(http: aiohttp.ClientSession, url: str, ids: list[int]
                         ) -> tuple[float, int]:
    start = time.monotonic()
    async with http.post(url + "/generate", json={
            "input_ids": ids, "sampling_params": {"max_new_tokens": 1}}) as resp:
        body = await resp.json()
    return time.monotonic() - start, body["meta_info"]["cached_tokens"]


async def test_prefill_costs_only_the_uncached_tokens(start_sim: StartSim,
                                                      http: aiohttp.ClientSession) -> None:
    timing = TimingConfig(prefill_ms_per_uncached_token=0.5, prefill_overhead_ms=0,
                          decode_ms_per_token=0)
    sim = await start_sim(engine="sglang", timing=timing, kv_capacity_blocks=1024)
    ids = list(range(1, 801))
    cold, cached = await timed_generate(http, sim.url, ids)
    assert cached == 0 and cold >= 0.4  # 800 uncached tokens x 0.5 ms
    assert sim.engine.cache.lookup(ids) == 796
    # Only the 4 uncached tokens are paid for now (2 ms): the engine says so too.
    _, cached = await timed_generate(http, sim.url, ids)
    assert cached == 796


async def test_max_running_queues_fifo(start_sim: StartSim, http: aiohttp.ClientSession) -> None:
    timing = TimingConfig(prefill_ms_per_uncached_token=0, prefill_overhead_ms=0,
                          decode_ms_per_token=20)
    sim = await start_sim(engine="vllm", timing=timing, max_running=1)

    async def one(i: int) -> float:
        async with http.post(sim.url + "/v1/completions", json={
                "model": "cortex-sim", "prompt": [i + 1] * 8, "max_tokens": 6,
                "ignore_eos": True}) as resp:
            assert resp.status == 200
            await resp.read()
        return time.monotonic()

    start = time.monotonic()
    finished = await asyncio.gather(*(one(i) for i in range(3)))
    # One at a time, 5 x 20 ms of decode each: the last finishes after all three ran.
    assert max(finished) - start >= 3 * 0.1


async def test_a_stream_counts_the_engines_share_of_its_time_to_first_token(
        start_sim: StartSim, http: aiohttp.ClientSession) -> None:
    timing = TimingConfig(prefill_ms_per_uncached_token=0.0, prefill_overhead_ms=30.0,
                          decode_ms_per_token=0)
    sim = await start_sim(engine="sglang", timing=timing, kv_capacity_blocks=1024)
    for stream in (False, True, True):
        async with http.post(sim.url + "/v1/chat/completions", json={
                "model": sim.config.model, "max_tokens": 3, "stream": stream,
                "messages": [{"role": "user", "content": "hello there"}]}) as resp:
            assert resp.status == 200
            await resp.read()
    stats = sim.engine.stats_dict()
    assert stats["first_token_streams"] == 2  # streamed requests only
    assert stats["first_token_us"] >= 2 * 30_000  # each waited for its 30 ms prefill
