"""The HTTP surface end to end: real sims, real hypercorn on 127.0.0.1, real HTTP clients."""

from __future__ import annotations

import asyncio
import io
import json
from typing import Any

import aiohttp

from cortex.gateway.config.gateway import IndexConfig, ModelConfig, ServerConfig
from cortex.testing import wait_until_async

from ..conftest import (
    BLOCK,
    DECODE_ONLY,
    MODEL,
    TOKEN,
    StartGateway,
    StartSim,
    gateway_index,
    spec_of,
)

ADMIN = {"Authorization": f"Bearer {TOKEN}"}


def chat(text: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "system", "content": "Be brief."},
                                         {"role": "user", "content": text}], **extra}


async def sse_events(resp: aiohttp.ClientResponse) -> list[str]:
    raw = (await resp.read()).decode()
    return [e.removeprefix("data: ") for e in raw.split("\n\n") if e.strip()]


async def test_bad_inputs_are_rejected_before_any_worker(
    start_sim: StartSim, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim()
    limit_model = ModelConfig(name=MODEL, block_size=BLOCK, max_prompt_tokens=64)
    server = ServerConfig(host="127.0.0.1", port=0, admin_token=TOKEN, max_body_bytes=100_000)
    gw = await start_gateway([spec_of(sim, "w1")], models=(limit_model,), server=server)
    url = gw.url
    cases: list[tuple[str, str, Any, int, str]] = [
        ("POST", "/v1/chat/completions", b"{nope", 400, "invalid_json"),
        ("POST", "/v1/chat/completions", {"messages": []}, 400, "invalid_request"),
        ("POST", "/v1/chat/completions", chat("x", model="gpt-9"), 404, "model_not_found"),
        ("POST", "/v1/chat/completions", chat("word " * 200), 400, "context_length_exceeded"),
        ("POST", "/v1/completions", {"model": MODEL, "prompt": [1, "a"]}, 400,
         "invalid_request"),
        ("POST", "/generate", {"sampling_params": {}}, 400, "invalid_request"),
        ("POST", "/v1/chat/completions", io.BytesIO(b"x" * 200_000), 413, "request_too_large"),
        ("GET", "/v1/chat/completions", None, 405, "method_not_allowed"),
        ("GET", "/nowhere", None, 404, "not_found"),
    ]
    for method, path, body, status, code in cases:
        data = body if isinstance(body, bytes | io.BytesIO) or body is None else (
            json.dumps(body).encode())
        async with http.request(method, url + path, data=data,
                                headers={"Content-Type": "application/json"}) as resp:
            payload = await resp.json()
            assert (resp.status, payload["error"]["code"]) == (status, code), (path, body)
            assert resp.headers["x-request-id"]
            assert "Traceback" not in json.dumps(payload)
            if path.startswith("/v1/") and method == "POST":
                assert resp.headers["x-cortex-match-mode"] == "none"
                assert resp.headers["x-cortex-assigned-worker"] == "none"
    assert sim.engine.stats_dict()["requests_started"] == 0


async def test_streaming_passthrough_usage_and_request_id(
    start_sim: StartSim, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim()
    gw = await start_gateway([spec_of(sim, "w1")])
    headers = {"x-request-id": "req-12345"}
    async with http.post(gw.url + "/v1/chat/completions", json=chat("hi", stream=True),
                         headers=headers) as resp:
        assert resp.status == 200
        assert resp.headers["content-type"] == "text/event-stream"
        assert resp.headers["x-request-id"] == "req-12345"
        assert resp.headers["x-cortex-assigned-worker"] == "w1"
        assert resp.headers["x-cortex-match-mode"] == "load_aware"  # no index configured
        events = await sse_events(resp)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["choices"] for c in chunks)  # the usage chunk we injected was stripped
    async with http.post(gw.url + "/v1/chat/completions", json=chat(
            "hi", stream=True, stream_options={"include_usage": True})) as resp:
        events = await sse_events(resp)
    usage = json.loads(events[-2])
    assert usage["choices"] == [] and usage["usage"]["prompt_tokens"] > 0
    async with http.post(gw.url + "/generate", json={"text": "hello", "stream": True}) as resp:
        events = await sse_events(resp)
    assert events[-1] == "[DONE]" and "meta_info" in json.loads(events[-2])
    async with http.post(gw.url + "/v1/completions", json={"model": MODEL, "prompt": [1, 2, 3],
                                                           "max_tokens": 4}) as resp:
        body = await resp.json()
        assert resp.status == 200 and body["usage"]["prompt_tokens"] == 3
    metrics = await (await http.get(gw.url + "/metrics")).text()
    assert 'cortex_gateway_cache_prediction_total{outcome="exact"}' in metrics


async def test_ops_endpoints_and_models(
    start_sim: StartSim, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim()
    gw = await start_gateway([spec_of(sim, "w1")])
    async with http.get(gw.url + "/health/live") as resp:
        assert resp.status == 200
    async with http.get(gw.url + "/health/ready") as resp:
        ready = await resp.json()
        assert resp.status == 200 and ready["status"] == "degraded"
        assert ready["degraded"] == ["no_index"] and ready["workers"]["routable"] == 1
    async with http.get(gw.url + "/v1/models") as resp:
        assert [m["id"] for m in (await resp.json())["data"]] == [MODEL]
    async with http.get(gw.url + "/metrics") as resp:
        text = await resp.text()
        for name in ("cortex_gateway_ready 1.0",
                     'cortex_gateway_degraded{reason="no_index"} 1.0',
                     "cortex_gateway_routing_seconds",
                     'cortex_gateway_worker_healthy{worker="w1"}'):
            assert name in text


async def test_index_down_keeps_serving_with_load_only_modes(
    start_sim: StartSim, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    from cortex.testing import free_port

    sims = [await start_sim(), await start_sim()]
    gw = await start_gateway([spec_of(s, f"w{i}") for i, s in enumerate(sims)],
                             index=IndexConfig(targets=(f"127.0.0.1:{free_port()}",),
                                               retry_after_ms=200))
    modes = set()
    for i in range(6):
        async with http.post(gw.url + "/v1/chat/completions",
                             json=chat(f"question {i} " * 20)) as resp:
            assert resp.status == 200
            modes.add(resp.headers["x-cortex-match-mode"])
            assert resp.headers["x-cortex-match-reason"] == "index_unavailable"
            assert resp.headers["x-cortex-cache-hit-tokens"] == "0"
    assert modes <= {"load_aware", "fallback_p2c", "fallback_round_robin"}
    async with http.get(gw.url + "/health/ready") as resp:
        ready = await resp.json()
        assert resp.status == 200 and "no_index" in ready["degraded"]
        assert ready["index"] == "unavailable"


async def test_failure_before_first_byte_moves_to_next_worker(
    start_sim: StartSim, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    broken = await start_sim()
    good = await start_sim()
    gw = await start_gateway([spec_of(broken, "broken"), spec_of(good, "good")])
    broken.faults.update({"error_rate": 1.0, "error_status": 503})
    for i in range(4):
        async with http.post(gw.url + "/v1/chat/completions",
                             json=chat(f"retry me {i}", stream=i % 2 == 0)) as resp:
            assert resp.status == 200
            assert resp.headers["x-cortex-assigned-worker"] == "good"
            await resp.read()
    metrics = await (await http.get(gw.url + "/metrics")).text()
    assert 'cortex_gateway_upstream_errors_total{kind="status",worker="broken"}' in metrics


async def test_worker_dying_mid_stream_ends_with_an_sse_error(
    start_sim: StartSim, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    dying = await start_sim(output_tokens=(60, 61))
    healthy = await start_sim()
    gw = await start_gateway([spec_of(dying, "dying"), spec_of(healthy, "healthy")])
    dying.faults.update({"cut_stream_after": 3})
    saw_error = False
    for i in range(6):  # requests spread over both workers
        async with http.post(gw.url + "/v1/chat/completions",
                             json=chat(f"story {i}", stream=True)) as resp:
            assert resp.status == 200
            worker = resp.headers["x-cortex-assigned-worker"]
            events = await sse_events(resp)
        assert events[-1] == "[DONE]"
        if worker == "dying":
            error = json.loads(events[-2])["error"]
            assert error["code"] == "upstream_stream_error"
            assert len(events) == 5  # 3 chunks passed through, then the error and [DONE]
            saw_error = True
        else:
            assert "error" not in events[-2]
    assert saw_error


async def test_client_disconnect_cancels_the_upstream_request(
    start_sim: StartSim, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim(timing=DECODE_ONLY, output_tokens=(500, 501))
    gw = await start_gateway([spec_of(sim, "w1")])
    resp = await http.post(gw.url + "/v1/chat/completions",
                           json=chat("long answer", stream=True, max_tokens=500))
    assert resp.status == 200
    await resp.content.readuntil(b"\n\n")  # the stream is flowing
    assert sim.engine.running == 1
    resp.close()  # the client goes away
    await wait_until_async(lambda: sim.engine.running == 0, timeout=5,
                           what="the sim to abort the generation")
    gateway = gw.gateway
    await wait_until_async(lambda: gateway.pool.get("w1").inflight == 0,  # type: ignore[union-attr]
                           timeout=5, what="the in-flight slot to be released")
    assert sim.engine.stats_dict()["generation_tokens"] < 100
    metrics = await (await http.get(gw.url + "/metrics")).text()
    assert "cortex_gateway_client_disconnects_total 1.0" in metrics


async def test_a_client_that_closes_after_done_is_not_counted_as_gone(
    start_sim: StartSim, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim()
    gw = await start_gateway([spec_of(sim, "w1")])
    for i in range(5):  # each on a connection of its own, closed once [DONE] is read
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)
                                         ) as once, once.post(
                gw.url + "/v1/chat/completions", json=chat(f"story {i}", stream=True)) as resp:
            assert (await sse_events(resp))[-1] == "[DONE]"
    metrics = await (await http.get(gw.url + "/metrics")).text()
    assert ('cortex_gateway_requests_total{endpoint="/v1/chat/completions",'
            'model="cortex-sim",status="200"} 5.0') in metrics
    assert "cortex_gateway_client_disconnects_total 0.0" in metrics
    checked = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                  if line.startswith("cortex_gateway_cache_prediction_total{"))
    assert checked == 5  # each answer's usage was read after its [DONE]: nothing cut short


async def test_a_request_counts_its_uncached_prompt_on_the_worker_until_its_first_byte(
    start_sim: StartSim, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    from cortex.sim.config import TimingConfig

    slow_prefill = TimingConfig(prefill_ms_per_uncached_token=20.0, prefill_overhead_ms=0.0,
                                decode_ms_per_token=1.0)
    sim = await start_sim(timing=slow_prefill)
    gw = await start_gateway([spec_of(sim, "w1")])
    worker = gw.gateway.pool.get("w1")
    assert worker is not None and worker.prefilling == 0
    seen: list[int] = []

    async def call() -> dict[str, Any]:
        async with http.post(gw.url + "/v1/chat/completions",
                             json=chat("count my prefill", stream=False)) as resp:
            assert resp.status == 200
            body: dict[str, Any] = await resp.json()
            return body

    task = asyncio.create_task(call())

    def prefilling() -> bool:
        seen.append(worker.prefilling)
        return worker.prefilling > 0

    await wait_until_async(prefilling, timeout=5, interval=0.005,
                           what="the request's prefill to be counted")
    usage = (await task)["usage"]
    # nothing was cached: the whole prompt was counted, and nothing is left once it answered
    assert max(seen) == usage["prompt_tokens"]
    assert worker.prefilling == 0 and worker.pending == 0


async def test_admin_api(
    start_sim: StartSim, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    first = await start_sim()
    second = await start_sim()
    gw = await start_gateway([spec_of(first, "w1")])
    async with http.get(gw.url + "/admin/workers") as resp:
        assert resp.status == 401
    async with http.get(gw.url + "/admin/workers", headers={"Authorization": "Bearer no"}) as r:
        assert r.status == 401 and (await r.json())["error"]["code"] == "unauthorized"
    async with http.post(gw.url + "/admin/workers", headers=ADMIN, json={"id": "bad"}) as resp:
        assert resp.status == 400
    async with http.post(gw.url + "/admin/workers", headers=ADMIN,
                         json=spec_of(second, "w2").to_dict()) as resp:
        assert resp.status == 201

    async def listed() -> dict[str, Any]:
        async with http.get(gw.url + "/admin/workers", headers=ADMIN) as resp:
            return {w["id"]: w for w in (await resp.json())["workers"]}

    async def w2_routable() -> bool:
        w2 = (await listed()).get("w2", {})
        return w2.get("routable") is True and w2.get("engine_waiting") is not None

    await wait_until_async(w2_routable, timeout=10, what="w2 to join the pool")
    async with http.post(gw.url + "/admin/explain", headers=ADMIN,
                         json=chat("explain me " * 40)) as resp:
        explained = await resp.json()
    assert resp.status == 200
    assert explained["prompt_tokens"] > 40 and explained["block_keys"] == (
        explained["prompt_tokens"] // BLOCK)
    assert {c["worker"] for c in explained["candidates"]} == {"w1", "w2"}
    assert explained["decision"]["mode"] == "load_aware"
    assert first.engine.stats_dict()["requests_started"] == 0  # nothing was sent
    async with http.delete(gw.url + "/admin/workers/w2", headers=ADMIN) as resp:
        assert resp.status == 200
    async with http.delete(gw.url + "/admin/workers/w2", headers=ADMIN) as resp:
        assert resp.status == 404

    async def w2_gone() -> bool:
        return "w2" not in await listed()

    await wait_until_async(w2_gone, timeout=10, what="w2 to leave the pool")


async def test_no_worker_is_a_503(start_gateway: StartGateway,
                                  http: aiohttp.ClientSession) -> None:
    gw = await start_gateway([])
    async with http.post(gw.url + "/v1/chat/completions", json=chat("x")) as resp:
        assert resp.status == 503
        assert (await resp.json())["error"]["code"] == "no_available_worker"
    async with http.get(gw.url + "/health/ready") as resp:
        # the process serves (JSON 503s): it stays in its load balancer
        assert resp.status == 200 and (await resp.json())["status"] == "unavailable"
    await asyncio.sleep(0)


async def test_block_size_mismatch_is_reported(
    start_sim: StartSim, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim()
    spec = spec_of(sim, "w1").with_changes(block_size=BLOCK * 2)
    gw = await start_gateway([spec])
    line = ('cortex_gateway_credit_blocked_workers{model="cortex-sim",'
            'reason="block_size_mismatch"} 1.0')

    async def reported() -> bool:
        async with http.get(gw.url + "/metrics") as resp:
            return line in await resp.text()

    await wait_until_async(reported, timeout=5, what="the mismatch metric")
    async with http.post(gw.url + "/v1/chat/completions", json=chat("still routed")) as resp:
        assert resp.status == 200  # load-only routing still serves it


async def test_vllm_workers_are_served_and_their_load_polled(
    start_sim: StartSim, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim(engine="vllm")
    model = ModelConfig(name=MODEL, block_size=BLOCK, engine="vllm")  # type: ignore[arg-type]
    gw = await start_gateway([spec_of(sim, "v1")], models=(model,))
    async with http.post(gw.url + "/v1/chat/completions",
                         json=chat("hello vllm", stream=True)) as resp:
        assert resp.status == 200 and resp.headers["x-cortex-assigned-worker"] == "v1"
        assert (await sse_events(resp))[-1] == "[DONE]"
    async with http.get(gw.url + "/admin/workers", headers=ADMIN) as resp:
        (worker,) = (await resp.json())["workers"]
    assert worker["engine"] == "vllm" and worker["engine_waiting"] is not None


async def test_index_without_ready_ledgers_is_reported(
    start_sim: StartSim, start_gateway: StartGateway, http: aiohttp.ClientSession,
    index_server: Any,
) -> None:
    sim = await start_sim()
    gw = await start_gateway([spec_of(sim, "w1")],
                             index=gateway_index(index_server.target, workers_poll_s=0.1))

    async def no_ready_ledger() -> bool:
        async with http.get(gw.url + "/health/ready") as resp:
            body = await resp.json()
            return resp.status == 200 and body["degraded"] == ["no_ready_ledger"]

    await wait_until_async(no_ready_ledger, timeout=5, what="no_ready_ledger in readiness")
    async with http.post(gw.url + "/v1/chat/completions", json=chat("q " * 40)) as resp:
        assert resp.status == 200
        assert resp.headers["x-cortex-match-reason"] == "no_ready_ledger"
