"""The engines' HTTP surface, served in-process on 127.0.0.1 (port 0)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest

from cortex.registry.engines import sglang_work_from_loads, vllm_work_from_metrics
from cortex.sim.config import TimingConfig
from cortex.sim.testkit import StartSim, chat_body
from cortex.testing import wait_until_async

LONG = "Tell me everything about the long and winding history of the Roman empire, please. " * 3


async def post(http: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, Any]:
    async with http.post(url, json=body) as resp:
        return resp.status, await resp.json(content_type=None)


def sse_events(text: str) -> list[Any]:
    events = []
    for block in text.split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
async def test_second_request_reports_the_shared_prefix_as_cached(
        start_sim: StartSim, http: aiohttp.ClientSession, engine: str) -> None:
    sim = await start_sim(engine=engine)
    body = chat_body(LONG, max_tokens=4, some_router_field={"x": 1})  # unknown fields accepted
    status, first = await post(http, sim.url + "/v1/chat/completions", body)
    assert status == 200, first
    prompt = first["usage"]["prompt_tokens"]
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert first["usage"]["completion_tokens"] == 4
    assert first["choices"][0]["finish_reason"] == "length"
    status, second = await post(http, sim.url + "/v1/chat/completions", body)
    assert status == 200
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == (prompt - 1) // 4 * 4
    assert second["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]


async def test_streaming_chat_with_usage_chunk(start_sim: StartSim, http: aiohttp.ClientSession
                                               ) -> None:
    sim = await start_sim(engine="vllm")
    body = chat_body(LONG, max_tokens=5, stream=True, stream_options={"include_usage": True})
    async with http.post(sim.url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        events = sse_events(await resp.text())
    assert events[-1] == "[DONE]"
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 5
    assert usage["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    chunks = events[:-2]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    _, whole = await post(http, sim.url + "/v1/chat/completions",
                          chat_body(LONG, max_tokens=5))
    assert whole["choices"][0]["message"]["content"] == text  # deterministic answers


async def test_completions_accept_text_token_ids_and_arrays(start_sim: StartSim,
                                                           http: aiohttp.ClientSession) -> None:
    sim = await start_sim(engine="vllm")
    status, out = await post(http, sim.url + "/v1/completions",
                             {"model": "cortex-sim", "prompt": list(range(100, 120)),
                              "max_tokens": 3})
    assert status == 200 and out["usage"]["prompt_tokens"] == 20
    status, out = await post(http, sim.url + "/v1/completions",
                             {"model": "cortex-sim", "prompt": list(range(100, 120)),
                              "max_tokens": 3})
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 16
    status, out = await post(http, sim.url + "/v1/completions",
                             {"model": "cortex-sim", "prompt": ["a b c", "d e f"], "max_tokens": 2,
                              "ignore_eos": True})
    assert status == 200 and [c["index"] for c in out["choices"]] == [0, 1]
    assert out["usage"]["completion_tokens"] == 4
    async with http.post(sim.url + "/v1/completions",
                         json={"model": "cortex-sim", "prompt": "hello", "stream": True,
                               "max_tokens": 2}) as resp:
        events = sse_events(await resp.text())
    assert events[-1] == "[DONE]" and events[0]["object"] == "text_completion"


async def test_generate_reports_meta_info_cached_tokens(start_sim: StartSim,
                                                        http: aiohttp.ClientSession) -> None:
    sim = await start_sim(engine="sglang")
    body = {"input_ids": list(range(1, 30)), "sampling_params": {"max_new_tokens": 6,
                                                                   "ignore_eos": True}}
    status, out = await post(http, sim.url + "/generate", body)
    assert status == 200 and out["meta_info"]["cached_tokens"] == 0
    assert len(out["output_ids"]) == 6 and out["meta_info"]["finish_reason"]["type"] == "length"
    status, out = await post(http, sim.url + "/generate", body)
    assert out["meta_info"]["cached_tokens"] == 28
    status, batch = await post(http, sim.url + "/generate",
                               {"text": ["one two", "three four"],
                                "sampling_params": {"max_new_tokens": 2}})
    assert status == 200 and isinstance(batch, list) and len(batch) == 2
    async with http.post(sim.url + "/generate", json={**body, "stream": True}) as resp:
        events = sse_events(await resp.text())
    assert events[-1] == "[DONE]" and events[-2]["meta_info"]["cached_tokens"] == 28
    assert events[-2]["output_ids"] == out["output_ids"]


async def test_natural_answers_stop_with_eos_and_ignore_eos_runs_to_max(
        start_sim: StartSim, http: aiohttp.ClientSession) -> None:
    sim = await start_sim(engine="vllm", output_tokens=(3, 3))
    _, out = await post(http, sim.url + "/v1/chat/completions", chat_body("hi"))
    assert out["choices"][0]["finish_reason"] == "stop" and out["usage"]["completion_tokens"] == 3
    _, out = await post(http, sim.url + "/v1/chat/completions",
                        chat_body("hi", max_tokens=9, ignore_eos=True))
    assert out["choices"][0]["finish_reason"] == "length" and out["usage"]["completion_tokens"] == 9


async def test_errors_are_openai_bodies(start_sim: StartSim, http: aiohttp.ClientSession) -> None:
    vllm = await start_sim(engine="vllm", max_model_len=64)
    sglang = await start_sim(engine="sglang")
    status, out = await post(http, vllm.url + "/v1/chat/completions", {"model": "cortex-sim"})
    assert status == 400 and out["error"]["type"] == "BadRequestError"
    assert "messages" in out["error"]["message"]
    status, out = await post(http, vllm.url + "/v1/chat/completions",
                             chat_body("hi", model="other"))
    assert status == 404 and out["error"]["code"] == 404
    status, out = await post(http, vllm.url + "/v1/completions",
                             {"model": "cortex-sim", "prompt": "x", "max_tokens": 100})
    assert status == 400 and "maximum context length" in out["error"]["message"]
    async with http.post(sglang.url + "/v1/chat/completions", data=b"{not json") as resp:
        out = await resp.json()
        assert resp.status == 400 and out["object"] == "error" and out["code"] == 400


async def test_sglang_info_and_load_endpoints(start_sim: StartSim, http: aiohttp.ClientSession
                                              ) -> None:
    sim = await start_sim(engine="sglang", topic="kv")
    for path in ("/server_info", "/get_server_info"):
        async with http.get(sim.url + path) as resp:
            info = await resp.json()
        assert info["page_size"] == 4 and info["disaggregation_mode"] == "null"
        assert info["kv_events"] == {
            "publisher": "zmq", "endpoint_host": "127.0.0.1",
            "endpoint_port_base": sim.kv_events_port, "topic": "kv", "block_size": 4,
            "dp_size": 1, "replay_endpoint_port_base": sim.replay_port}
    async with http.get(sim.url + "/model_info") as resp:
        assert (await resp.json())["is_generation"] is True
    async with http.get(sim.url + "/get_load") as resp:
        (load,) = await resp.json()
        assert load["dp_rank"] == 0 and load["num_waiting_reqs"] == 0
    async with http.get(sim.url + "/v1/loads") as resp:
        loads = (await resp.json())["loads"]
        assert loads[0]["max_total_num_tokens"] == 256 * 4
    async with http.get(sim.url + "/health") as resp:
        assert resp.status == 200
    async with http.get(sim.url + "/v1/models") as resp:
        assert (await resp.json())["data"][0]["id"] == "cortex-sim"


async def test_vllm_metrics_use_the_real_names(start_sim: StartSim, http: aiohttp.ClientSession
                                               ) -> None:
    sim = await start_sim(engine="vllm")
    for _ in range(2):
        await post(http, sim.url + "/v1/completions",
                   {"model": "cortex-sim", "prompt": list(range(1, 10)), "max_tokens": 1})
    async with http.get(sim.url + "/metrics") as resp:
        text = await resp.text()
    samples = {line.split("{")[0]: float(line.rsplit(" ", 1)[1])
               for line in text.splitlines() if line and not line.startswith("#")}
    assert samples["vllm:num_requests_running"] == 0
    assert samples["vllm:num_requests_waiting"] == 0
    assert 0 < samples["vllm:kv_cache_usage_perc"] <= 1
    assert samples["vllm:prefix_cache_queries_total"] == 18
    assert samples["vllm:prefix_cache_hits_total"] == 8
    assert 'model_name="cortex-sim"' in text


async def test_vllm_metrics_mount_filters_by_name_and_its_route_does_not(
        start_sim: StartSim, http: aiohttp.ClientSession) -> None:
    sim = await start_sim(engine="vllm")
    await post(http, sim.url + "/v1/completions",
               {"model": "cortex-sim", "prompt": list(range(1, 10)), "max_tokens": 1})
    names = [("name[]", "vllm:num_requests_waiting"), ("name[]", "vllm:prompt_tokens_total"),
             ("name[]", "vllm:cache_config_info"), ("name[]", "vllm:no_such_metric")]
    async with http.get(sim.url + "/metrics/", params=names) as resp:
        assert resp.status == 200
        text = await resp.text()
    async with http.get(sim.url + "/metrics", params=names) as resp:
        whole = await resp.text()
    kept = [line for line in text.splitlines() if not line.startswith("#")]
    assert [line.split("{")[0] for line in kept] == [
        "vllm:num_requests_waiting", "vllm:prompt_tokens_total", "vllm:cache_config_info"]
    assert "# TYPE vllm:prompt_tokens_total counter" in text  # each family's header kept
    assert "# HELP vllm:num_requests_running" not in text
    assert all(line in whole for line in text.splitlines())
    assert "vllm:num_requests_running{" in whole  # the exact route ignores the filter
    async with http.get(sim.url + "/metrics/") as resp:
        assert (await resp.text()).splitlines() == whole.splitlines()


async def test_flush_refuses_while_busy_then_clears(start_sim: StartSim,
                                                    http: aiohttp.ClientSession) -> None:
    sim = await start_sim(engine="sglang")
    await post(http, sim.url + "/generate", {"input_ids": list(range(1, 30)),
                                             "sampling_params": {"max_new_tokens": 1}})
    assert sim.engine.cache.cached_blocks > 0
    lease = sim.engine.cache.admit([5] * 8, 8)  # a request in flight
    assert lease is not None
    async with http.post(sim.url + "/flush_cache") as resp:
        assert resp.status == 400
    sim.engine.cache.release(lease)
    async with http.post(sim.url + "/flush_cache") as resp:
        assert resp.status == 200
    assert sim.engine.cache.cached_blocks == 0


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
async def test_the_work_counters_move_while_a_long_answer_is_generated(
    engine: str, start_sim: StartSim, http: aiohttp.ClientSession,
) -> None:
    # like a real engine's: vLLM counts each token at the step that made it, SGLang's KV
    # tokens in use grow as it decodes; neither waits for the request to end
    sim = await start_sim(engine=engine, timing=TimingConfig(
        prefill_overhead_ms=0.0, prefill_ms_per_uncached_token=0.0, decode_ms_per_token=10.0))

    async def mark() -> tuple[float, ...] | None:
        if engine == "vllm":
            async with http.get(sim.url + "/metrics") as resp:
                return vllm_work_from_metrics(await resp.text())
        async with http.get(sim.url + "/v1/loads") as resp:
            return sglang_work_from_loads(await resp.json())

    before = await mark()
    request = asyncio.create_task(post(http, sim.url + "/v1/completions", {
        "model": "cortex-sim", "prompt": LONG, "max_tokens": 300, "ignore_eos": True}))
    await wait_until_async(lambda: sim.engine.running == 1, timeout=5.0,
                           what="the generation to start")
    seen = [await mark()]

    async def moved() -> bool:
        now = await mark()
        if now == seen[-1]:
            return False
        seen.append(now)
        return True

    for _ in range(3):  # a 3 s answer: the mark changes again and again before it ends
        await wait_until_async(moved, timeout=1.0, interval=0.05, what="the mark to change")
    assert not request.done()
    assert before not in seen
    status, _ = await request
    assert status == 200
