"""vLLM 0.33 prefill/decode: a streamed prefill leg hands its ``kv_transfer_params`` over in
its final chunk, and workers whose KV connectors cannot talk (NIXL connector version 15 vs
older, from labels or the engine's ``/server_info``) are never paired. Real Redis, index,
ingest, sims and gateway on 127.0.0.1."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest

from cortex.gateway.config.gateway import (
    BreakerConfig,
    ModelConfig,
    PDConfig,
    RegistryConfig,
)
from cortex.gateway.dispatch.pd.handoff import vllm_prefill_result
from cortex.gateway.fleet.pool import CircuitBreaker, WorkerState
from cortex.gateway.routing.scoring import connector_mismatch
from cortex.hashing import Engine
from cortex.index.server import IndexServer
from cortex.registry.spec import WorkerSpec
from cortex.testing import RedisServer, wait_until_async

from ..conftest import BLOCK, MODEL, StartGateway, StartSim, gateway_index, spec_of
from .test_pd import chat, pd_cluster, usage_cached

pytestmark = pytest.mark.timeout(60)


def test_prefill_result_reads_a_body_or_a_streams_final_chunk() -> None:
    params = {"remote_host": "h", "remote_registration_generation": 0}
    body = b'{"choices": [], "kv_transfer_params": {"remote_host": "h"}, "usage": {"a": 1}}'
    assert vllm_prefill_result(body) == ({"remote_host": "h"}, {"a": 1})
    stream = (b'data: {"choices": [{"delta": {"content": "x"}}]}\n\n'
              b'data: {"choices": [{"delta": {}, "finish_reason": "length"}],'
              b' "kv_transfer_params": ' + _json(params) + b'}\n\n'
              b'data: {"choices": [], "usage": {"prompt_tokens": 9}}\n\n'
              b"data: [DONE]\n\n")
    assert vllm_prefill_result(stream) == (params, {"prompt_tokens": 9})
    assert vllm_prefill_result(b"data: [DONE]\n\n") == (None, None)
    assert vllm_prefill_result(b"not json") == (None, None)


def _json(obj: Any) -> bytes:
    return json.dumps(obj).encode()


def _worker(worker_id: str, role: str, **labels: str) -> WorkerState:
    spec = WorkerSpec(id=worker_id, url="http://127.0.0.1:1", engine=Engine.VLLM, model=MODEL,
                      role=role, labels=labels)  # type: ignore[arg-type]
    return WorkerState(spec, CircuitBreaker(BreakerConfig()))


def test_connector_mismatch_from_labels_then_reported_versions() -> None:
    p15, d14 = _worker("p", "prefill", nixl_connector_version="15"), _worker(
        "d", "decode", nixl_connector_version="14")
    assert "NIXL connector version 15" in (connector_mismatch(p15, d14) or "")
    p, d = _worker("p", "prefill"), _worker("d", "decode")
    assert connector_mismatch(p, d) is None  # neither says: not held against them
    p.engine_version, d.engine_version = "0.33.0", "0.32.1"
    assert "vLLM 0.33.0" in (connector_mismatch(p, d) or "")
    d.engine_version = "0.33.0"
    assert connector_mismatch(p, d) is None


async def test_a_streamed_prefill_leg_hands_over_through_its_final_chunk(
    redis_server: RedisServer, index_server: IndexServer, start_sim: StartSim,
    start_gateway: StartGateway, http: aiohttp.ClientSession,
) -> None:
    async with pd_cluster("vllm", redis_server, index_server, start_sim, start_gateway, http,
                          PDConfig(vllm_stream_prefill=True)) as c:
        headers, body = await c.send(chat("streamed prefill"))
        assert headers["x-cortex-pd"] == "disaggregated"
        assert usage_cached(body["usage"]) == 0 and body["usage"]["completion_tokens"] == 6
        headers, usage, text = await c.stream(chat("streamed prefill, streamed answer"))
        assert headers["x-cortex-pd"] == "disaggregated" and text
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    pulls = [sim.engine.stats for sim in c.decode.values()]
    assert sum(s.kv_pulls for s in pulls) == 2 and sum(s.kv_pull_failures for s in pulls) == 0


async def test_workers_of_another_vllm_version_are_not_paired(
    redis_server: RedisServer, index_server: IndexServer, start_sim: StartSim,
    start_gateway: StartGateway, http: aiohttp.ClientSession,
) -> None:
    prefill = await start_sim(engine="vllm", role="prefill")  # 0.33.0: NIXL 15
    old = await start_sim(engine="vllm", role="decode", engine_version="0.26.0")
    specs = [spec_of(prefill, "p0", role="prefill"), spec_of(old, "d-old", role="decode")]
    gw = await start_gateway(
        specs, models=(ModelConfig(name=MODEL, block_size=BLOCK, engine=Engine.VLLM),),
        registry=RegistryConfig(redis_url=redis_server.url, poll_interval_s=0.2),
        index=gateway_index(index_server.target, retry_after_ms=200))

    def versions_known() -> bool:
        pool = gw.gateway.pool
        return all(w is not None and w.engine_version for w in
                   (pool.get("p0"), pool.get("d-old")))

    await wait_until_async(versions_known, timeout=20, what="the engines' versions")
    async with http.post(gw.url + "/v1/chat/completions", json=chat("a mismatched pair")
                         ) as resp:
        assert resp.status == 503
        error = (await resp.json())["error"]
    assert "compatible KV connectors" in error["message"] and "0.26.0" in error["message"]
    assert old.engine.stats.kv_pulls == 0 and prefill.engine.stats.requests_started == 0
    metrics = await (await http.get(gw.url + "/metrics")).text()
    assert ('cortex_gateway_pd_pairs_refused_total{engine="vllm",reason="connector_version"}'
            in metrics)
