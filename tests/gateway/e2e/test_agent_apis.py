"""``/v1/messages`` and stateless ``/v1/responses`` routed on exact KV, end to end.

Real Redis, index, ingest, sims serving both APIs the way each engine does, and the gateway
on 127.0.0.1: the second send of a request is ``exact_kv`` on the worker that served the
first, crediting the whole cached prefix and never more than the engine reports
(``usage.cache_read_input_tokens`` / ``usage.input_tokens_details.cached_tokens``); streams
are relayed as the engine sent them; follow-ups by ``previous_response_id`` stay pinned.
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest

from cortex.gateway.config.gateway import ModelConfig
from cortex.hashing import Engine
from cortex.index.server import IndexServer
from cortex.testing import RedisServer, wait_until_async

from ..conftest import BLOCK, MODEL, StartGateway, StartSim, spec_of
from .test_cluster import Cluster, cluster

SYSTEM = "You are a careful coding agent. Read files before editing them. " * 30
TOOLS = [{"name": "bash", "description": "Run a shell command. " * 10,
          "input_schema": {"type": "object", "properties": {"cmd": {"type": "string"}},
                           "required": ["cmd"]}}]


def messages_body(tag: str) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 8, "system": [{"type": "text", "text": SYSTEM}],
            "tools": TOOLS, "messages": [
                {"role": "user", "content": f"[{tag}] list the files"},
                {"role": "assistant", "content": [
                    {"type": "text", "text": "Listing."},
                    {"type": "tool_use", "id": "toolu_1", "name": "bash",
                     "input": {"cmd": "ls"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "a.py b.py"}]}]}


def responses_body(tag: str) -> dict[str, Any]:
    return {"model": MODEL, "store": False, "max_output_tokens": 8, "instructions": SYSTEM,
            "tools": [{"type": "function", "name": "bash", "description": "Run. " * 10,
                       "parameters": TOOLS[0]["input_schema"]}],
            "input": [
                {"type": "message", "role": "user",
                 "content": [{"type": "input_text", "text": f"[{tag}] list the files"}]},
                {"type": "function_call", "call_id": "c1", "name": "bash",
                 "arguments": "{\"cmd\": \"ls\"}"},
                {"type": "function_call_output", "call_id": "c1", "output": "a.py b.py"}]}


API = {"messages": ("/v1/messages", messages_body), "responses": ("/v1/responses",
                                                                  responses_body)}


def cached_of(api: str, usage: dict[str, Any]) -> int:
    if api == "messages":
        return int(usage.get("cache_read_input_tokens") or 0)
    return int(usage["input_tokens_details"]["cached_tokens"])


async def send(c: Cluster, api: str, body: dict[str, Any], stream: bool
               ) -> tuple[dict[str, str], int, dict[str, Any] | list[str]]:
    """→ (headers, the engine's cached tokens, the answer or the stream's event names)."""
    path = API[api][0]
    async with c.http.post(c.gateway.url + path, json={**body, "stream": stream}) as resp:
        assert resp.status == 200, await resp.text()
        if not stream:
            answer = await resp.json()
            return dict(resp.headers), cached_of(api, answer["usage"]), answer
        raw = (await resp.read()).decode()
    names, usage = [], {}
    for event in raw.split("\n\n"):
        if not event.strip():
            continue
        name_line, data_line = event.split("\n")
        assert name_line.startswith("event: ") and data_line.startswith("data: ")
        data = json.loads(data_line.removeprefix("data: "))
        names.append(data["type"])
        assert name_line == f"event: {data['type']}"
        if data["type"] == "message_delta":
            usage = data["usage"]
        elif data["type"] == "response.completed":
            usage = data["response"]["usage"]
    return dict(resp.headers), cached_of(api, usage), names


async def full_prompt(c: Cluster, api: str, body: dict[str, Any]) -> tuple[str, int]:
    """Wait until the index holds the whole prompt at one worker: (worker, tokens)."""
    async with c.http.post(c.gateway.url + f"/admin/explain?endpoint={api}", json=body,
                           headers={"Authorization": "Bearer test-admin-token-0123456789"}
                           ) as resp:
        explained = await resp.json()
    full = explained["query_blocks"] * explained["block_size"]
    holder = ""

    async def held() -> bool:
        nonlocal holder
        async with c.http.post(c.gateway.url + f"/admin/explain?endpoint={api}", json=body,
                               headers={"Authorization": "Bearer test-admin-token-0123456789"}
                               ) as resp:
            found = await resp.json()
        best = max(found["candidates"], key=lambda x: x["index_tokens"])
        holder = best["worker"]
        return bool(best["index_tokens"] == full)

    await wait_until_async(held, timeout=10, what="the whole prompt indexed")
    return holder, full


@pytest.mark.parametrize("engine", [Engine.VLLM, Engine.SGLANG])
@pytest.mark.parametrize("api", ["messages", "responses"])
@pytest.mark.parametrize("stream", [False, True])
async def test_second_send_is_exact_kv_on_the_same_worker(
    redis_server: RedisServer, index_server: IndexServer, start_sim: StartSim,
    start_gateway: StartGateway, http: aiohttp.ClientSession, engine: Engine, api: str,
    stream: bool,
) -> None:
    sims = {f"w{i}": await start_sim(engine=engine) for i in range(3)}
    models = (ModelConfig(name=MODEL, block_size=BLOCK, engine=engine),)
    async with cluster(redis_server, index_server, sims, start_gateway, http,
                       models=models) as c:
        body = API[api][1](f"{api}-{stream}")
        headers, cached, _ = await send(c, api, body, stream)
        first = headers["x-cortex-assigned-worker"]
        assert cached == 0 and first in sims
        holder, full = await full_prompt(c, api, body)
        assert holder == first

        headers, cached, answer = await send(c, api, body, stream)
        assert headers["x-cortex-assigned-worker"] == first, headers
        assert headers["x-cortex-match-mode"] == "exact_kv"
        hit = int(headers["x-cortex-cache-hit-tokens"])
        assert hit == full == cached  # the whole cached prefix, never more than reported
        if stream and api == "messages":
            assert answer[0] == "message_start" and answer[-1] == "message_stop"
        elif stream:
            assert answer[0] == "response.created" and answer[-1] == "response.completed"

        metrics = await (await http.get(c.gateway.url + "/metrics")).text()
        assert 'cortex_gateway_cache_prediction_total{outcome="over"}' not in metrics
        assert 'cortex_gateway_cache_prediction_total{outcome="exact"}' in metrics


async def test_followups_stay_pinned_and_unmodelled_requests_are_relayed(
    redis_server: RedisServer, index_server: IndexServer, start_sim: StartSim,
    start_gateway: StartGateway, http: aiohttp.ClientSession,
) -> None:
    sims = {f"w{i}": await start_sim(engine=Engine.VLLM) for i in range(3)}
    models = (ModelConfig(name=MODEL, block_size=BLOCK, engine=Engine.VLLM),)
    async with cluster(redis_server, index_server, sims, start_gateway, http,
                       models=models) as c:
        body = responses_body("pinned")
        for stream in (False, True):
            async with http.post(c.gateway.url + "/v1/responses",
                                 json={**body, "stream": stream}) as resp:
                assert resp.status == 200
                owner = resp.headers["x-cortex-assigned-worker"]
                assert resp.headers["x-cortex-match-mode"] != "passthrough"
                raw = await resp.read()
            if stream:
                created = json.loads(raw.split(b"\n\n")[0].split(b"\n")[1][6:])
                response_id = created["response"]["id"]
            else:
                response_id = json.loads(raw)["id"]
            for _ in range(3):  # the follow-up goes to the owner, relayed as before
                async with http.post(c.gateway.url + "/v1/responses", json={
                        "model": MODEL, "previous_response_id": response_id,
                        "input": "and now?"}) as resp:
                    assert resp.status == 200, await resp.text()
                    assert resp.headers["x-cortex-assigned-worker"] == owner
                    assert resp.headers["x-cortex-match-mode"] == "passthrough"

        # a Responses 'custom' tool is not modelled: relayed by load, answered by the engine
        custom = {**body, "tools": [{"type": "custom", "name": "apply_patch"}]}
        async with http.post(c.gateway.url + "/v1/responses", json=custom) as resp:
            assert resp.status == 200
            assert resp.headers["x-cortex-match-mode"] == "passthrough"

        # what the engine rejects is a 400 before routing (an Anthropic error object)
        async with http.post(c.gateway.url + "/v1/messages", json={
                "model": MODEL, "max_tokens": 0, "messages": []}) as resp:
            assert resp.status == 400
            error = anthropic_error_of(await resp.read())
            assert error["type"] == "invalid_request_error" and "max_tokens" in error["message"]
            assert resp.headers["x-cortex-assigned-worker"] == "none"


def anthropic_error_of(raw: bytes) -> dict[str, Any]:
    """The ``error`` of an Anthropic error object (and nothing of OpenAI's shape)."""
    obj = json.loads(raw)
    assert obj["type"] == "error" and set(obj) == {"type", "error"}, obj
    assert set(obj["error"]) == {"type", "message"} and obj["error"]["message"], obj
    error: dict[str, Any] = obj["error"]
    return error


async def test_messages_errors_are_anthropic_objects_with_their_status(
    start_sim: StartSim, start_gateway: StartGateway, http: aiohttp.ClientSession,
) -> None:
    sim = await start_sim(engine=Engine.VLLM, output_tokens=(40, 41))
    models = (ModelConfig(name=MODEL, block_size=BLOCK, engine=Engine.VLLM),)
    gw = await start_gateway([spec_of(sim, "w1")], models=models)
    body = messages_body("errors")
    # the client's mistakes, refused before routing: 400 / 404 / 400 (not JSON)
    for sent, status, kind in (({**body, "max_tokens": 0}, 400, "invalid_request_error"),
                               ({**body, "model": "no-such-model"}, 404, "not_found_error"),
                               (b"{nope", 400, "invalid_request_error")):
        async with http.post(gw.url + "/v1/messages",
                             **({"data": sent} if isinstance(sent, bytes) else {"json": sent})
                             ) as resp:
            assert resp.status == status
            assert resp.headers["content-type"] == "application/json"
            assert resp.headers["x-cortex-assigned-worker"] == "none"
            raw = await resp.read()
            assert int(resp.headers["content-length"]) == len(raw)
            assert anthropic_error_of(raw)["type"] == kind
    # a path under /v1/messages the gateway does not serve: Anthropic's 404 too
    async with http.post(gw.url + "/v1/messages/batches", json=body) as resp:
        assert resp.status == 404
        assert anthropic_error_of(await resp.read())["type"] == "not_found_error"
    # the worker refuses (a 4xx is the client's, kept) or fails (502 after the retries)
    for engine_status, status, kind in ((429, 429, "rate_limit_error"), (500, 502, "api_error")):
        sim.faults.update({"error_rate": 1.0, "error_status": engine_status})
        async with http.post(gw.url + "/v1/messages", json=body) as resp:
            assert resp.status == status
            assert anthropic_error_of(await resp.read())["type"] == kind
    # a stream the worker breaks ends with Anthropic's error event, no OpenAI [DONE]
    sim.faults.update({"error_rate": 0.0, "cut_stream_after": 3})
    async with http.post(gw.url + "/v1/messages", json={**body, "stream": True}) as resp:
        assert resp.status == 200
        events = [e for e in (await resp.read()).decode().split("\n\n") if e.strip()]
    assert len(events) == 4  # three of the engine's events, then the error
    name, data = events[-1].split("\n")
    assert name == "event: error"
    assert anthropic_error_of(data.removeprefix("data: ").encode())["type"] == "api_error"
    # the OpenAI paths keep OpenAI's shape
    sim.faults.clear()
    async with http.post(gw.url + "/v1/chat/completions", json={"model": MODEL,
                         "max_tokens": 0, "messages": []}) as resp:
        assert resp.status == 400
        assert set((await resp.json())["error"]) == {"message", "type", "param", "code"}
