"""``/tokenize`` and ``/detokenize`` answer byte for byte like the engine; answers are fed to
the cache after the response; the alignment self-check counts matches and mismatches.

Real gateways and sims over HTTP on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from cortex.gateway.api.tokenize import AlignmentCheck
from cortex.gateway.config.gateway import ModelConfig, TokenizeConfig
from cortex.gateway.server import GatewayServer
from cortex.hashing import Engine

from ..conftest import BLOCK, MODEL, StartGateway, StartSim, spec_of

pytestmark = pytest.mark.timeout(60)

CHATS: list[dict[str, Any]] = [
    {"messages": [{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "Wie spät ist es? 日本語"}]},
    {"messages": [{"role": "user", "content": "Write a haiku"},
                  {"role": "assistant", "content": "\n\nAutumn moon,"}],
     "continue_final_message": True, "add_generation_prompt": False},
    {"prompt": "plain text prompt", "add_special_tokens": False},
]


async def post(http: aiohttp.ClientSession, url: str, body: dict[str, Any]
               ) -> tuple[int, bytes]:
    async with http.post(url, data=json.dumps({"model": MODEL, **body})) as response:
        return response.status, await response.read()


async def wait_for(condition: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("engine", [Engine.VLLM, Engine.SGLANG])
async def test_tokenize_answers_equal_the_engines_byte_for_byte(
        engine: Engine, start_sim: StartSim, start_gateway: StartGateway,
        http: aiohttp.ClientSession) -> None:
    sim = await start_sim(engine=engine)
    gw = await start_gateway([spec_of(sim, "w1")], models=(ModelConfig(
        name=MODEL, block_size=BLOCK, engine=engine, max_model_len=sim.config.max_model_len
        if engine is Engine.VLLM else None),))
    bodies = [dict(b) for b in CHATS]
    if engine is Engine.SGLANG:
        bodies[1].pop("add_generation_prompt")
        bodies.append({"prompt": ["one", "two 2"]})
    else:
        bodies.append({"prompt": "strings too", "return_token_strs": True})
    for body in bodies:
        ours = await post(http, gw.url + "/tokenize", body)
        theirs = await post(http, sim.url + "/tokenize", body)
        assert ours[0] == 200 and ours == theirs, body
    ids = json.loads(ours[1])["tokens"]
    ids = ids[0] if isinstance(ids[0], list) else ids
    for body in ({"tokens": ids}, {"tokens": [0, *ids], "skip_special_tokens": False}):
        assert await post(http, gw.url + "/detokenize", body) == \
            await post(http, sim.url + "/detokenize", body)


async def test_bad_tokenize_requests_are_openai_errors(start_sim: StartSim,
                                                       start_gateway: StartGateway,
                                                       http: aiohttp.ClientSession) -> None:
    sim = await start_sim()
    gw = await start_gateway([spec_of(sim, "w1")])
    status, body = await post(http, gw.url + "/tokenize", {"prompt": "x", "messages": []})
    assert status == 400 and json.loads(body)["error"]["param"] == "prompt"
    status, body = await post(http, gw.url + "/tokenize", {"model": "nope", "prompt": "x"})
    assert status == 404 and json.loads(body)["error"]["code"] == "model_not_found"
    status, body = await post(http, gw.url + "/detokenize", {"tokens": ["a"]})
    assert status == 400 and json.loads(body)["error"]["param"] == "tokens"


async def stream_answer(http: aiohttp.ClientSession, url: str, messages: list[dict[str, str]],
                        max_tokens: int = 24) -> str:
    body = {"model": MODEL, "messages": messages, "stream": True, "max_tokens": max_tokens}
    text = []
    async with http.post(url + "/v1/chat/completions", json=body) as response:
        assert response.status == 200
        async for line in response.content:
            if line.startswith(b"data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    text.append(choice["delta"].get("content") or "")
    return "".join(text)


def fed(gw: GatewayServer, result: str = "fed") -> float:
    metric = gw.gateway.metrics.tokenize_answer_feeds.labels(model=MODEL, result=result)
    value: float = metric._value.get()
    return value


@pytest.mark.parametrize("stream", [True, False])
async def test_the_next_turn_encodes_only_its_new_message(
        stream: bool, start_sim: StartSim, start_gateway: StartGateway,
        http: aiohttp.ClientSession) -> None:
    sim = await start_sim()
    gw = await start_gateway([spec_of(sim, "w1")], tokenize=TokenizeConfig(feed_min_tokens=8))
    messages = [{"role": "system", "content": "You are terse. " * 40},
                {"role": "user", "content": "Tell me about tokenizers."}]
    if stream:
        answer = await stream_answer(http, gw.url, messages)
    else:
        async with http.post(gw.url + "/v1/chat/completions", json={
                "model": MODEL, "messages": messages, "max_tokens": 24}) as response:
            answer = (await response.json())["choices"][0]["message"]["content"]
    assert answer
    await wait_for(lambda: fed(gw) == 1)
    await stream_answer(http, gw.url, messages, max_tokens=2)  # too short to be worth it
    assert fed(gw, "short") == 1 and fed(gw) == 1
    cache = gw.gateway.tokenizers[MODEL].cache
    misses = cache.stats.misses
    messages += [{"role": "assistant", "content": answer},
                 {"role": "user", "content": "And the next question?"}]
    status, _ = await post(http, gw.url + "/tokenize", {"messages": messages})
    assert status == 200
    assert cache.stats.misses - misses == 1  # the new user message only


async def test_the_self_check_counts_matches_and_mismatches(
        tmp_path: Path, start_sim: StartSim, start_gateway: StartGateway,
        http: aiohttp.ClientSession) -> None:
    aligned = await start_sim()
    other = tmp_path / "other.jinja"
    other.write_text("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}")
    misaligned = await start_sim(chat_template=str(other))
    for sim, expected in ((aligned, "match"), (misaligned, "mismatch")):
        gw = await start_gateway([spec_of(sim, "w1")],
                                 tokenize=TokenizeConfig(self_check_interval_s=3600))
        async with http.post(gw.url + "/v1/chat/completions", json={
                "model": MODEL, "max_tokens": 2,
                "messages": [{"role": "user", "content": "check me"}]}) as response:
            assert response.status == 200
        assert await AlignmentCheck(gw.gateway).check_once() == {MODEL: expected}
        counted = gw.gateway.metrics.tokenize_self_checks.labels(
            model=MODEL, worker="w1", result=expected)._value.get()
        assert counted == 1
