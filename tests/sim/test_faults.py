"""Fault injection over HTTP: switched at run time through the admin endpoint."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from cortex.sim.config import TimingConfig
from cortex.sim.testkit import StartSim, chat_body
from cortex.testing import wait_until_async


async def set_faults(http: aiohttp.ClientSession, url: str, **fields: object) -> None:
    async with http.post(url + "/sim/faults", json=fields) as resp:
        assert resp.status == 200, await resp.text()


async def test_http_down_hangs_generation_until_cleared(start_sim: StartSim,
                                                       http: aiohttp.ClientSession) -> None:
    sim = await start_sim(engine="sglang")
    await set_faults(http, sim.url, http_down=True)
    with pytest.raises(asyncio.TimeoutError):
        async with http.post(sim.url + "/generate", json={"text": "hi"},
                             timeout=aiohttp.ClientTimeout(total=0.3)):
            pass
    for path in ("/health", "/v1/loads", "/get_load", "/server_info"):  # probes still answer
        async with http.get(sim.url + path) as resp:
            assert resp.status == 200, path
    async with http.get(sim.url + "/sim/state") as resp:  # admin always answers
        state = await resp.json()
        assert state["faults"]["http_down"] is True
        assert state["faults"]["fault_paths"] == "generation"
    await set_faults(http, sim.url, fault_paths="all")  # now a wedged engine: probes hang too
    with pytest.raises(asyncio.TimeoutError):
        async with http.get(sim.url + "/health", timeout=aiohttp.ClientTimeout(total=0.3)):
            pass
    pending = asyncio.ensure_future(http.post(sim.url + "/generate", json={"text": "hi"}))
    async with http.delete(sim.url + "/sim/faults") as resp:
        assert resp.status == 200 and (await resp.json())["fault_paths"] == "generation"
    async with await pending as resp:
        assert resp.status == 200


async def test_max_running_saturates_the_engine_until_cleared(start_sim: StartSim,
                                                              http: aiohttp.ClientSession
                                                              ) -> None:
    sim = await start_sim(engine="vllm", timing=TimingConfig(
        prefill_overhead_ms=0.0, prefill_ms_per_uncached_token=0.0, decode_ms_per_token=5.0))
    await set_faults(http, sim.url, max_running=1)
    body = {"model": "cortex-sim", "prompt": "hi", "max_tokens": 400, "ignore_eos": True}
    answers = [asyncio.ensure_future(http.post(sim.url + "/v1/completions", json=body))
               for _ in range(3)]
    await wait_until_async(lambda: (sim.engine.running, sim.engine.waiting) == (1, 2),
                           timeout=5.0, what="one running, two queued")
    async with http.delete(sim.url + "/sim/faults") as resp:  # the configured cap again
        assert resp.status == 200 and (await resp.json())["max_running"] is None
    await wait_until_async(lambda: sim.engine.waiting == 0, timeout=5.0, what="all admitted")
    for answer in answers:
        async with await answer as resp:
            assert resp.status == 200
    async with http.post(sim.url + "/sim/faults", json={"max_running": 0}) as resp:
        assert resp.status == 400


async def test_error_rate_and_latency_hit_their_scope(start_sim: StartSim,
                                                      http: aiohttp.ClientSession) -> None:
    sim = await start_sim(engine="vllm")
    await set_faults(http, sim.url, error_rate=1.0, error_status=503)
    async with http.post(sim.url + "/v1/chat/completions", json=chat_body("hi")) as resp:
        assert resp.status == 503
        assert (await resp.json())["error"]["code"] == 503
    for path in ("/health", "/load", "/metrics"):
        async with http.get(sim.url + path) as resp:
            assert resp.status == 200, path
    await set_faults(http, sim.url, fault_paths="all")
    async with http.get(sim.url + "/health") as resp:
        assert resp.status == 503
    await set_faults(http, sim.url, error_rate=0.0, latency_ms=150.0, fault_paths="generation")
    loop = asyncio.get_running_loop()
    start = loop.time()
    async with http.post(sim.url + "/v1/completions",
                         json={"model": "cortex-sim", "prompt": "x", "max_tokens": 1}) as resp:
        assert resp.status == 200
    assert loop.time() - start >= 0.15
    for bad in ({"error_rate": 2}, {"nonsense": 1}, {"fault_paths": "health"}):
        async with http.post(sim.url + "/sim/faults", json=bad) as resp:
            assert resp.status == 400, bad  # validated as a whole
    sim.set_faults(fault_paths="all")  # the in-process API takes the scope too
    assert sim.faults.config.fault_paths == "all"


async def test_stream_is_cut_after_k_chunks(start_sim: StartSim, http: aiohttp.ClientSession
                                            ) -> None:
    sim = await start_sim(engine="vllm")
    await set_faults(http, sim.url, cut_stream_after=3)
    received = b""
    with pytest.raises(aiohttp.ClientPayloadError):
        async with http.post(sim.url + "/v1/chat/completions",
                             json=chat_body("hello", max_tokens=20, stream=True)) as resp:
            assert resp.status == 200
            async for chunk in resp.content.iter_any():
                received += chunk
    assert received.count(b"data: ") == 3 and b"[DONE]" not in received
    assert sim.engine.running == 0  # the cut request released everything
    await set_faults(http, sim.url, cut_stream_after=None)
    async with http.post(sim.url + "/v1/chat/completions",
                         json=chat_body("hello", max_tokens=20, stream=True)) as resp:
        assert (await resp.read()).rstrip().endswith(b"data: [DONE]")


async def test_stream_stalls_after_k_chunks_until_cleared_or_the_client_leaves(
    start_sim: StartSim, http: aiohttp.ClientSession,
) -> None:
    sim = await start_sim(engine="sglang")
    await set_faults(http, sim.url, stall_stream_after=1)
    async with http.post(sim.url + "/v1/chat/completions",
                         json=chat_body("hello", max_tokens=20, stream=True)) as resp:
        assert resp.status == 200
        first = await resp.content.readuntil(b"\n\n")
        assert first.startswith(b"data: ")
        with pytest.raises(asyncio.TimeoutError):  # silent, the connection held open
            async with asyncio.timeout(0.5):
                await resp.content.readuntil(b"\n\n")
        await set_faults(http, sim.url, stall_stream_after=None)  # the engine wakes up
        assert (await resp.read()).rstrip().endswith(b"data: [DONE]")
    await set_faults(http, sim.url, stall_stream_after=0)  # headers, then nothing at all
    async with http.post(sim.url + "/v1/completions",
                         json={"model": "cortex-sim", "prompt": "hi", "stream": True}) as resp:
        assert resp.status == 200
        with pytest.raises(asyncio.TimeoutError):
            async with asyncio.timeout(0.5):
                await resp.content.readany()
    # leaving the block closed the connection: the stalled handler lets go
    await wait_until_async(lambda: not sim.engine.running, timeout=10, what="release")
    async with http.get(sim.url + "/sim/faults") as resp:
        assert (await resp.json())["stall_stream_after"] == 0
    async with http.post(sim.url + "/sim/faults", json={"stall_stream_after": -1}) as resp:
        assert resp.status == 400


async def test_client_disconnect_releases_the_request(start_sim: StartSim,
                                                      http: aiohttp.ClientSession) -> None:
    sim = await start_sim(engine="sglang", timing=TimingConfig(decode_ms_per_token=50))
    async with http.post(sim.url + "/generate",
                         json={"text": "hello", "stream": True,
                               "sampling_params": {"max_new_tokens": 200}}) as resp:
        await resp.content.readuntil(b"\n\n")
        assert sim.engine.running == 1
    # Leaving the block closed the connection mid-stream.
    await wait_until_async(lambda: not sim.engine.running and not sim.engine.cache.active_leases,
                           timeout=10, what="the aborted request to be released")
