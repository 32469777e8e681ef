"""PD handshakes between real sim processes: SGLang bootstrap rooms and vLLM remote blocks."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from cortex.sim.process import SimProcess
from cortex.sim.testkit import chat_body

PROMPT = "Summarise the plot of a long novel about sailors, storms and a white whale. " * 2
COMMON = ("--port", "0", "--kv-events-port", "0", "--block-size", "4", "--zero-cost",
          "--log-level", "warning")


@pytest.fixture(scope="module")
def pd_sims() -> Iterator[dict[str, SimProcess]]:
    """Four sim processes (SGLang and vLLM, prefill and decode), started in parallel."""
    specs = {
        "sglang_p": ("--engine", "sglang", "--role", "prefill", "--bootstrap-port", "0",
                     "--bootstrap-timeout-s", "1.5"),
        "sglang_d": ("--engine", "sglang", "--role", "decode", "--transfer-timeout-s", "1.5"),
        "vllm_p": ("--engine", "vllm", "--role", "prefill"),
        "vllm_d": ("--engine", "vllm", "--role", "decode", "--transfer-timeout-s", "1.5"),
    }
    with contextlib.ExitStack() as stack:
        sims = {name: SimProcess(*args, *COMMON) for name, args in specs.items()}
        for sim in sims.values():
            stack.callback(sim.close)
            sim.launch()
        for sim in sims.values():
            sim.wait_ready()
        yield sims


async def post(session: aiohttp.ClientSession, url: str, body: Any
               ) -> tuple[int, dict[str, Any], dict[str, str]]:
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        return resp.status, await resp.json(), dict(resp.headers)


async def test_sglang_bootstrap_handshake(pd_sims: dict[str, SimProcess]) -> None:
    prefill, decode = pd_sims["sglang_p"], pd_sims["sglang_d"]
    async with aiohttp.ClientSession() as session:
        for attempt in range(2):
            body = chat_body(PROMPT, max_tokens=5, bootstrap_host="127.0.0.1",
                             bootstrap_port=prefill.bootstrap_port,
                             bootstrap_room=random.randrange(2**63))
            (p_status, p_body, _), (d_status, d_body, _) = await asyncio.gather(
                post(session, prefill.url, body), post(session, decode.url, body))
            assert p_status == 200 and d_status == 200, (p_body, d_body)
            assert p_body["usage"]["completion_tokens"] == 1
            assert p_body["choices"][0]["finish_reason"] == "length"
            assert d_body["usage"]["completion_tokens"] == 5
            # The decode reports the prefill's prefix-cache hit (sent with the KV).
            cached = d_body["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached == p_body["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert (cached > 0) == (attempt == 1)


async def test_sglang_wrong_room_or_host_fails_like_the_engine(
        pd_sims: dict[str, SimProcess]) -> None:
    prefill, decode = pd_sims["sglang_p"], pd_sims["sglang_d"]
    base = chat_body(PROMPT, max_tokens=3, bootstrap_host="127.0.0.1",
                     bootstrap_port=prefill.bootstrap_port)
    async with aiohttp.ClientSession() as session:
        (p_status, p_body, _), (d_status, d_body, _) = await asyncio.gather(
            post(session, prefill.url, {**base, "bootstrap_room": 11}),
            post(session, decode.url, {**base, "bootstrap_room": 12}))
        assert p_status == 500 and "KVPoll.Bootstrapping" in p_body["message"]
        assert d_status == 500 and "KVPoll.WaitingForInput" in d_body["message"]
        # A wrong host (nothing listens there) fails the decode at once.
        status, body, _ = await post(session, decode.url,
                                     {**base, "bootstrap_room": 13, "bootstrap_host": "127.0.0.2"})
        assert status == 500 and "bootstrap server" in body["message"]
        # The pair still works afterwards.
        good = {**base, "bootstrap_room": 14}
        results = await asyncio.gather(post(session, prefill.url, good),
                                       post(session, decode.url, good))
        assert [r[0] for r in results] == [200, 200]


async def test_vllm_kv_transfer_params_handshake(pd_sims: dict[str, SimProcess]) -> None:
    prefill, decode = pd_sims["vllm_p"], pd_sims["vllm_d"]
    body = chat_body(PROMPT + " vllm", max_tokens=6)
    to_prefill = {**body, "max_tokens": 1, "kv_transfer_params": {
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
        "remote_block_ids": None, "remote_host": None, "remote_port": None}}
    async with aiohttp.ClientSession() as session:
        status, p_body, _ = await post(session, prefill.url, to_prefill)
        assert status == 200
        params = p_body["kv_transfer_params"]
        assert params["do_remote_prefill"] is True and params["remote_host"] == "127.0.0.1"
        assert params["remote_block_ids"][0] and params["remote_request_id"] == p_body["id"]
        prompt_tokens = p_body["usage"]["prompt_tokens"]
        status, d_body, headers = await post(session, decode.url,
                                             {**body, "kv_transfer_params": params})
        assert status == 200 and headers["x-cortex-sim-kv-source"] == "remote"
        # vLLM's PD pitfall, reproduced: pulled KV counts as cached on the decode leg.
        assert d_body["usage"]["prompt_tokens_details"]["cached_tokens"] == prompt_tokens // 4 * 4
        assert d_body["usage"]["completion_tokens"] == 6
        # The blocks were read once: a second read finds nothing and recomputes locally.
        status, _, headers = await post(session, decode.url,
                                        {**body, "kv_transfer_params": params})
        assert status == 200 and headers["x-cortex-sim-kv-source"] == "local"
        # A wrong host: the decode gives up after its timeout and computes locally.
        wrong = {**params, "remote_host": "127.0.0.2"}
        status, _, headers = await post(session, decode.url,
                                        {**chat_body(PROMPT + " other", max_tokens=2),
                                         "kv_transfer_params": wrong})
        assert status == 200 and headers["x-cortex-sim-kv-source"] == "local"
