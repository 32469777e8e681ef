"""The endpoints tools call: health, model metadata, CORS, and the passthrough endpoints
(embeddings, rerank, score, responses, messages) and passthrough models — real sims, a real
gateway, real HTTP on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp

from cortex.bench.answer_proxy import AnswerProxy, Shape
from cortex.gateway.config.gateway import ModelConfig
from cortex.gateway.config.middleware import CorsConfig
from cortex.testing import wait_until_async

from ..conftest import BLOCK, DECODE_ONLY, MODEL, StartGateway, StartSim, spec_of


async def sse_data(resp: aiohttp.ClientResponse) -> list[Any]:
    raw = (await resp.read()).decode()
    return [json.loads(line[5:]) for line in raw.splitlines()
            if line.startswith("data:") and line[5:].strip() != "[DONE]"]


async def test_health_and_the_models_as_vllm_describes_them(
    start_sim: StartSim, start_gateway: StartGateway, http: aiohttp.ClientSession,
) -> None:
    sim = await start_sim(max_model_len=32768)
    gw = await start_gateway([spec_of(sim, "w1")])
    async with http.get(gw.url + "/health") as resp:
        assert resp.status == 200 and (await resp.json())["status"] in ("ready", "degraded")
    async with http.get(gw.url + "/v1/models") as resp:
        listing = await resp.json()
    assert [m["id"] for m in listing["data"]] == [MODEL]
    entry = listing["data"][0]
    assert (entry["object"], entry["owned_by"], entry["root"]) == ("model", "cortex", MODEL)
    assert entry["max_model_len"] == 32768 and isinstance(entry["created"], int)
    async with http.get(gw.url + f"/v1/models/{MODEL}") as resp:
        assert resp.status == 200 and await resp.json() == entry
    async with http.get(gw.url + "/v1/models/gpt-9") as resp:
        error = (await resp.json())["error"]
        assert resp.status == 404 and error["code"] == "model_not_found"
        assert error["type"] == "not_found_error"


async def test_cors_is_off_by_default_and_answers_configured_origins(
    start_sim: StartSim, start_gateway: StartGateway, http: aiohttp.ClientSession,
) -> None:
    sim = await start_sim()
    preflight = {"Origin": "https://app.example.com", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    closed = await start_gateway([spec_of(sim, "w1")])
    async with http.options(closed.url + "/v1/chat/completions", headers=preflight) as resp:
        assert resp.status == 405 and "Access-Control-Allow-Origin" not in resp.headers

    gw = await start_gateway([spec_of(sim, "w1")], cors=CorsConfig(
        allow_origins=("https://app.example.com",)))
    async with http.options(gw.url + "/v1/chat/completions", headers=preflight) as resp:
        assert resp.status == 204
        assert resp.headers["Access-Control-Allow-Origin"] == "https://app.example.com"
        assert "POST" in resp.headers["Access-Control-Allow-Methods"]
        assert "authorization" in resp.headers["Access-Control-Allow-Headers"]
        assert resp.headers["Access-Control-Max-Age"] == "600"
    async with http.post(gw.url + "/v1/chat/completions",
                         headers={"Origin": "https://app.example.com"},
                         json={"model": MODEL, "max_tokens": 2,
                               "messages": [{"role": "user", "content": "hi"}]}) as resp:
        assert resp.status == 200
        assert resp.headers["Access-Control-Allow-Origin"] == "https://app.example.com"
        assert "x-cortex-assigned-worker" in resp.headers["Access-Control-Expose-Headers"]
    evil = {**preflight, "Origin": "https://evil.example.com"}
    async with http.options(gw.url + "/v1/chat/completions", headers=evil) as resp:
        assert resp.status == 405 and "Access-Control-Allow-Origin" not in resp.headers
    async with http.get(gw.url + "/v1/models", headers={"Origin": evil["Origin"]}) as resp:
        assert resp.status == 200 and "Access-Control-Allow-Origin" not in resp.headers


async def test_embeddings_rerank_score_are_relayed_and_messages_routed_to_a_worker_of_the_model(
    start_sim: StartSim, start_gateway: StartGateway, http: aiohttp.ClientSession,
) -> None:
    sim = await start_sim()
    gw = await start_gateway([spec_of(sim, "w1")])
    calls: list[tuple[str, dict[str, Any]]] = [
        ("/v1/embeddings", {"model": MODEL, "input": ["a cache", "a router"]}),
        ("/v1/rerank", {"model": MODEL, "query": "kv cache",
                        "documents": ["the kv cache of a worker", "a recipe for bread"]}),
        ("/v1/score", {"model": MODEL, "text_1": "kv cache", "text_2": ["kv cache", "bread"]}),
        ("/v1/messages", {"model": MODEL, "max_tokens": 3,
                          "messages": [{"role": "user", "content": "hi"}]}),
    ]
    answers = {}
    for path, body in calls:
        async with http.post(gw.url + path, json=body) as resp:
            assert resp.status == 200, (path, await resp.text())
            # /v1/messages is routed on its tokens (no index here: by load)
            assert resp.headers["x-cortex-match-mode"] == (
                "load_aware" if path == "/v1/messages" else "passthrough")
            assert resp.headers["x-cortex-assigned-worker"] == "w1"
            assert resp.headers["x-request-id"]
            answers[path] = await resp.json()
    assert [len(d["embedding"]) for d in answers["/v1/embeddings"]["data"]] == [8, 8]
    assert answers["/v1/rerank"]["results"][0]["index"] == 0
    assert [d["score"] for d in answers["/v1/score"]["data"]] == [1.0, 0.0]
    assert answers["/v1/messages"]["type"] == "message"
    async with http.post(gw.url + "/v1/messages", json={**calls[3][1], "stream": True}) as resp:
        assert resp.status == 200 and resp.content_type == "text/event-stream"
        events = await sse_data(resp)
    assert [e["type"] for e in events][0::len(events) - 1] == ["message_start", "message_stop"]

    started = sim.engine.stats_dict()["requests_started"]  # the two /v1/messages
    assert started == 2
    for body, status, code in (({"input": "x"}, 400, "invalid_request"),
                               ({"model": "gpt-9", "input": "x"}, 404, "model_not_found")):
        async with http.post(gw.url + "/v1/embeddings", json=body) as resp:
            assert resp.status == status and (await resp.json())["error"]["code"] == code
            assert sim.engine.stats_dict()["requests_started"] == started
    async with http.get(gw.url + "/metrics") as resp:
        metrics = await resp.text()
    assert ('cortex_gateway_requests_total{endpoint="/v1/embeddings",model="cortex-sim",'
            'status="200"} 1.0') in metrics


async def test_responses_follow_ups_get_and_cancel_go_to_the_worker_that_holds_them(
    start_sim: StartSim, start_gateway: StartGateway, http: aiohttp.ClientSession,
) -> None:
    sims = [await start_sim(), await start_sim()]
    gw = await start_gateway([spec_of(s, f"w{i}") for i, s in enumerate(sims)])
    url = gw.url + "/v1/responses"
    for stream in (False, True):
        async with http.post(url, json={"model": MODEL, "input": "hi", "stream": stream}) as r:
            assert r.status == 200
            owner = r.headers["x-cortex-assigned-worker"]
            if stream:
                events = await sse_data(r)
                response_id = events[0]["response"]["id"]
            else:
                response_id = (await r.json())["id"]
        chain = response_id
        for turn in range(6):  # a sim answers 404 for a response it does not hold
            async with http.post(url, json={"model": MODEL, "input": f"turn {turn}",
                                            "previous_response_id": chain}) as r:
                assert r.status == 200, await r.text()
                assert r.headers["x-cortex-assigned-worker"] == owner
                answer = await r.json()
                assert answer["previous_response_id"] == chain
                chain = answer["id"]
        async with http.get(f"{url}/{response_id}") as r:
            assert r.status == 200 and r.headers["x-cortex-assigned-worker"] == owner
            assert (await r.json())["id"] == response_id
        async with http.post(f"{url}/{response_id}/cancel") as r:
            assert r.status == 200 and (await r.json())["status"] == "cancelled"
    async with http.get(f"{url}/resp_unknown") as r:
        assert r.status == 404 and (await r.json())["error"]["code"] == "not_found"


async def test_a_replica_that_did_not_relay_a_response_finds_its_owner_on_the_workers(
    start_sim: StartSim, start_gateway: StartGateway, http: aiohttp.ClientSession,
) -> None:
    """Two gateway replicas share no response table: a follow-up, a GET and a cancel of a
    response the other replica relayed still reach the worker that holds it."""
    sims = [await start_sim(), await start_sim(), await start_sim()]
    workers = [spec_of(s, f"w{i}") for i, s in enumerate(sims)]
    first, other = await start_gateway(workers), await start_gateway(workers)
    async with http.post(first.url + "/v1/responses",
                         json={"model": MODEL, "input": "hi"}) as r:
        assert r.status == 200
        owner, response_id = r.headers["x-cortex-assigned-worker"], (await r.json())["id"]
    for turn in range(3):
        async with http.post(other.url + "/v1/responses", json={
                "model": MODEL, "input": f"turn {turn}", "previous_response_id": response_id}
                             ) as r:
            assert r.status == 200, await r.text()
            assert r.headers["x-cortex-assigned-worker"] == owner
    async with http.get(f"{other.url}/v1/responses/{response_id}") as r:
        assert r.status == 200 and r.headers["x-cortex-assigned-worker"] == owner
    async with http.get(f"{other.url}/v1/responses/resp_nowhere") as r:
        assert r.status == 404 and (await r.json())["error"]["code"] == "not_found"
    async with http.get(other.url + "/metrics") as r:
        metrics = await r.text()
    # asked once for the id (then learned), once for the unknown one
    assert 'cortex_gateway_response_owner_probes_total{result="found"} 1.0' in metrics
    assert 'cortex_gateway_response_owner_probes_total{result="none"} 1.0' in metrics


async def test_a_passthrough_model_is_proxied_by_load_without_tokenizing(
    start_sim: StartSim, start_gateway: StartGateway, http: aiohttp.ClientSession,
) -> None:
    sims = [await start_sim(timing=DECODE_ONLY), await start_sim(timing=DECODE_ONLY)]
    model = ModelConfig(name=MODEL, block_size=BLOCK, passthrough=True)
    gw = await start_gateway([spec_of(s, f"w{i}") for i, s in enumerate(sims)],
                             models=(model,))
    url = gw.url + "/v1/chat/completions"

    def chat(text: str, **extra: Any) -> dict[str, Any]:
        return {"model": MODEL, "messages": [{"role": "user", "content": text}], **extra}

    slow = asyncio.create_task(http.post(url, json=chat("long", max_tokens=40,
                                                        ignore_eos=True)))
    await wait_until_async(lambda: sum(w.inflight for w in gw.gateway.pool) == 1, timeout=10,
                           what="the slow request open")
    busy = next(w.id for w in gw.gateway.pool if w.inflight)
    for i in range(3):
        async with http.post(url, json=chat(f"quick {i}", max_tokens=2)) as resp:
            assert resp.status == 200
            assert resp.headers["x-cortex-match-mode"] == "passthrough"
            assert resp.headers["x-cortex-assigned-worker"] != busy  # the idle one
    async with http.post(url, json=chat("streamed", max_tokens=3, stream=True)) as resp:
        assert resp.status == 200 and resp.headers["x-cortex-match-mode"] == "passthrough"
        assert (await resp.read()).decode().rstrip().endswith("data: [DONE]")
    async with await slow as resp:
        assert resp.status == 200
    async with http.get(gw.url + "/metrics") as resp:
        metrics = await resp.text()
    assert "cortex_gateway_decisions_total{" not in metrics  # no routing decision was made
    assert "cortex_gateway_prompt_tokens_count 0.0" in metrics  # nothing was tokenized


async def test_a_passthrough_model_with_a_fixed_upstream_needs_no_registered_worker(
    start_sim: StartSim, start_gateway: StartGateway, http: aiohttp.ClientSession,
) -> None:
    sim = await start_sim()
    model = ModelConfig(name=MODEL, block_size=BLOCK, passthrough=True, upstream_url=sim.url)
    gw = await start_gateway([], models=(model,))
    async with http.get(gw.url + "/v1/models") as resp:
        assert [m["id"] for m in (await resp.json())["data"]] == [MODEL]
    async with http.post(gw.url + "/v1/chat/completions", json={
            "model": MODEL, "max_tokens": 2,
            "messages": [{"role": "user", "content": "hi"}]}) as resp:
        assert resp.status == 200, await resp.text()
        assert resp.headers["x-cortex-assigned-worker"] == "upstream"
        assert resp.headers["x-cortex-match-mode"] == "passthrough"
    assert sim.engine.stats_dict()["requests_started"] == 1


async def test_a_passthrough_answer_that_breaks_its_promise_is_a_502_never_relayed(
    start_sim: StartSim, start_gateway: StartGateway, http: aiohttp.ClientSession,
) -> None:
    sim = await start_sim()
    async with AnswerProxy(sim.url) as proxy:
        model = ModelConfig(name=MODEL, block_size=BLOCK, passthrough=True,
                            upstream_url=proxy.url)
        gw = await start_gateway([], models=(model,))
        body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
        for shape, stream in ((Shape.NOT_JSON, False), (Shape.GARBAGE_SSE, True),
                              (Shape.JSON_FOR_STREAM, True)):
            proxy.shape = shape
            async with http.post(gw.url + "/v1/chat/completions",
                                 json={**body, "stream": stream}) as resp:
                answer = await resp.read()
                assert resp.status == 502, (shape, answer)
                assert b"<html>" not in answer and b"not an event stream" not in answer
        proxy.shape = Shape.LATE_GARBAGE_SSE  # after the first byte: an error event ends it
        async with http.post(gw.url + "/v1/chat/completions", json={**body, "stream": True}
                             ) as resp:
            answer = await resp.read()
            assert resp.status == 200 and b"not an event stream" not in answer
            assert b'"upstream_stream_error"' in answer and answer.endswith(b"data: [DONE]\n\n")
        # each broken answer is a counted failure of the fixed upstream (worker "upstream")
        failures = gw.gateway.metrics.registry.get_sample_value(
            "cortex_gateway_upstream_errors_total", {"worker": "upstream", "kind": "bad_answer"})
        assert failures == 4
        proxy.shape = None
        async with http.post(gw.url + "/v1/chat/completions", json={**body, "stream": True}
                             ) as resp:
            assert resp.status == 200
            assert (await resp.read()).decode().rstrip().endswith("data: [DONE]")
