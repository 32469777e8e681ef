"""Discovery's pure core: the engines' real answer shapes → spec fields, and the spec built
from them (explicit values win; a required field nobody supplied is named)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from cortex.hashing import Engine
from cortex.registry import Discovery, DiscoveryError, SpecError, WorkerRole, default_worker_id
from cortex.registry.discovery import (
    looks_like_sglang,
    parse_sglang_server_info,
    parse_v1_models,
    parse_vllm_kv_event_sources,
    parse_vllm_metrics,
)

pytestmark = pytest.mark.timeout(10)


def sglang_server_info(**changes: Any) -> dict[str, Any]:
    """An SGLang 0.5.23 ``/server_info`` (server args + version + the kv_events block)."""
    info: dict[str, Any] = {
        "model_path": "/models/Qwen3-8B", "tokenizer_path": "/models/Qwen3-8B",
        "served_model_name": "qwen3-8b", "host": "0.0.0.0", "port": 30000,
        "page_size": 32, "context_length": None, "dp_size": 2, "tp_size": 4,
        "disaggregation_mode": "null", "disaggregation_bootstrap_port": 8998,
        "enable_dp_attention": True, "max_running_requests": 256,
        "kv_events_config": json.dumps({"publisher": "zmq", "endpoint": "tcp://*:5557",
                                        "topic": "kv-events", "replay_endpoint": "tcp://*:5558"}),
        "kv_events": {"publisher": "zmq", "endpoint_host": "*", "endpoint_port_base": 5557,
                      "topic": "kv-events", "block_size": 32, "dp_size": 2,
                      "replay_endpoint_port_base": 5558, "load_endpoint_port_base": None,
                      "load_topic": None},
        "version": "0.5.23", "status": "ready",
    }
    info.update(changes)
    return info


VLLM_MODELS = {"object": "list", "data": [
    {"id": "meta-llama/Llama-3.1-8B-Instruct", "object": "model", "created": 1764547200,
     "owned_by": "vllm", "root": "/models/llama-3.1-8b", "parent": None,
     "max_model_len": 32768, "permission": [{"id": "modelperm-1", "object": "model_permission",
                                              "allow_sampling": True}]},
    {"id": "sql-lora", "object": "model", "created": 1764547200, "owned_by": "vllm",
     "root": "/adapters/sql-lora", "parent": "meta-llama/Llama-3.1-8B-Instruct",
     "max_model_len": None, "permission": []},
]}

VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",calculate_kv_scales="False",\
enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.9",num_gpu_blocks="27000",\
prefix_caching_hash_algo="sha256"} 1.0
"""


def test_sglang_server_info_gives_every_field() -> None:
    learned = parse_sglang_server_info(sglang_server_info())
    assert learned == {
        "engine": Engine.SGLANG, "model": "qwen3-8b", "role": WorkerRole.REGULAR,
        "bootstrap_port": None, "dp_size": 2, "block_size": 32,
        "kv_events": "tcp://*:5557", "replay": "tcp://*:5558", "topic": "kv-events",
        "tokenizer": "/models/Qwen3-8B",
    }  # context_length null: SGLang was not told one (it lives in /v1/models)


def test_sglang_without_the_kv_events_block_reads_the_launch_config() -> None:
    info = sglang_server_info(kv_events=None, context_length=8192)
    del info["kv_events"]
    learned = parse_sglang_server_info(info)
    assert (learned["kv_events"], learned["replay"], learned["topic"]) == (
        "tcp://*:5557", "tcp://*:5558", "kv-events")
    assert learned["block_size"] == 32 and learned["dp_size"] == 2  # page_size, dp_size
    assert learned["context_length"] == 8192


def test_sglang_publisher_off_means_no_endpoints_not_unknown() -> None:
    for info in (sglang_server_info(kv_events={"publisher": "null"}),
                 {**sglang_server_info(kv_events_config=None), "kv_events": None},
                 {**sglang_server_info(kv_events_config='{"publisher": "null"}'),
                  "kv_events": None}):
        learned = parse_sglang_server_info(info)
        assert (learned["kv_events"], learned["replay"]) == (None, None)


def test_sglang_prefill_and_its_bootstrap_port() -> None:
    learned = parse_sglang_server_info(sglang_server_info(
        disaggregation_mode="prefill", disaggregation_bootstrap_port=9001))
    assert (learned["role"], learned["bootstrap_port"]) == (WorkerRole.PREFILL, 9001)
    decode = parse_sglang_server_info(sglang_server_info(disaggregation_mode="decode"))
    assert (decode["role"], decode["bootstrap_port"]) == (WorkerRole.DECODE, None)


def test_sglang_replay_from_launch_config_when_the_block_omits_it() -> None:
    block = dict(sglang_server_info()["kv_events"], endpoint_host="10.0.0.5")
    del block["replay_endpoint_port_base"]
    learned = parse_sglang_server_info(sglang_server_info(kv_events=block))
    assert learned["kv_events"] == "tcp://10.0.0.5:5557"
    assert learned["replay"] == "tcp://*:5558"


def test_only_sglang_server_info_looks_like_sglang() -> None:
    assert looks_like_sglang(sglang_server_info())
    assert not looks_like_sglang({"vllm_config": "model='x', ..."})  # vLLM's dev-mode page
    assert not looks_like_sglang(["page_size"])


def test_v1_models_picks_the_base_model_not_an_adapter() -> None:
    learned, ids = parse_v1_models(VLLM_MODELS)
    assert learned == {"model": "meta-llama/Llama-3.1-8B-Instruct", "context_length": 32768,
                       "engine": Engine.VLLM, "tokenizer": "/models/llama-3.1-8b"}
    assert ids == ("meta-llama/Llama-3.1-8B-Instruct", "sql-lora")
    assert parse_v1_models({"object": "list", "data": []}) == ({}, ())
    assert parse_v1_models({"data": "nonsense"}) == ({}, ())


def test_vllm_kv_event_sources_per_rank() -> None:
    body = [{"data_parallel_rank": r, "endpoint": f"tcp://10.0.0.1:{5557 + r}",
             "replay_endpoint": f"tcp://10.0.0.1:{5600 + r}", "topic": "kv"} for r in (1, 0)]
    learned, problem = parse_vllm_kv_event_sources(body)
    assert problem is None
    assert learned == {"dp_size": 2, "kv_events": "tcp://10.0.0.1:5557",
                       "replay": "tcp://10.0.0.1:5600", "topic": "kv"}
    one = [{"data_parallel_rank": 0, "endpoint": "tcp://10.0.0.1:5557",
            "replay_endpoint": None, "topic": ""}]
    assert parse_vllm_kv_event_sources(one) == (
        {"dp_size": 1, "kv_events": "tcp://10.0.0.1:5557", "replay": None, "topic": ""}, None)
    assert parse_vllm_kv_event_sources([]) == (
        {"kv_events": None, "replay": None, "topic": ""}, None)


@pytest.mark.parametrize("body", [
    {"sources": []},
    [{"data_parallel_rank": 0, "endpoint": "tcp://h:5557"},
     {"data_parallel_rank": 1, "endpoint": "tcp://h:6000"}],  # not base + rank
    [{"data_parallel_rank": 0, "endpoint": "tcp://h:5557"},
     {"data_parallel_rank": 0, "endpoint": "tcp://h:5558"}],  # rank twice
    [{"data_parallel_rank": 1, "endpoint": "tcp://h:5558"}],  # rank 0 missing
    [{"data_parallel_rank": 0, "endpoint": None, "replay_endpoint": "tcp://h:5558"}],
])
def test_vllm_kv_event_sources_that_a_spec_cannot_describe(body: Any) -> None:
    learned, problem = parse_vllm_kv_event_sources(body)
    assert learned == {} and problem


def test_vllm_block_size_from_cache_config_info() -> None:
    assert parse_vllm_metrics(VLLM_METRICS) == {"block_size": 16}
    assert parse_vllm_metrics("vllm:num_requests_running 0\n") == {}


def discovered(url: str = "http://10.0.0.5:30000") -> Discovery:
    return Discovery.merge(url, [("GET /server_info", parse_sglang_server_info(
        sglang_server_info())), ("GET /v1/models", {"context_length": 40960})])


def test_spec_from_discovery_and_explicit_values_win() -> None:
    spec = discovered().spec()
    assert (spec.id, spec.engine, spec.model, spec.block_size, spec.dp_size) == (
        "10.0.0.5-30000", Engine.SGLANG, "qwen3-8b", 32, 2)
    assert spec.kv_events_endpoint(1) == "tcp://10.0.0.5:5558"  # wildcard → worker host
    assert spec.replay_endpoint(0) == "tcp://10.0.0.5:5558"
    assert spec.context_length == 40960
    over = discovered().spec({"model": "alias", "block_size": 64, "topic": None},
                             worker_id="w1")
    assert (over.id, over.model, over.block_size, over.topic) == ("w1", "alias", 64, "kv-events")


def test_missing_required_fields_are_named() -> None:
    nothing = Discovery("http://10.0.0.9:8000", problems=(
        "GET /server_info: HTTP 404", "GET /v1/models: HTTP 404"))
    assert nothing.unlearned()[:2] == ("engine", "model")
    with pytest.raises(DiscoveryError) as caught:
        nothing.spec({"model": "m"}, require=("engine", "block_size"))
    assert caught.value.missing == ("engine", "block_size")
    text = str(caught.value)
    assert "could not learn engine, block_size from http://10.0.0.9:8000" in text
    assert "GET /server_info: HTTP 404" in text
    assert isinstance(caught.value, SpecError)  # callers that reject bad specs reject it too
    spec = nothing.spec({"engine": "vllm", "model": "m"})
    assert (spec.engine, spec.kv_events, spec.block_size) == (Engine.VLLM, None, None)


def test_a_learned_value_the_spec_rejects_is_a_spec_error() -> None:
    bad = Discovery.merge("http://h:1", [("x", {"engine": Engine.VLLM, "model": "m",
                                                "replay": "tcp://h:2", "kv_events": None})])
    with pytest.raises(SpecError, match="replay"):
        bad.spec()


def test_report_says_where_each_field_came_from() -> None:
    lines = discovered().report()
    assert "model = qwen3-8b (GET /server_info)" in lines
    assert "context_length = 40960 (GET /v1/models)" in lines
    assert not any(line.startswith("not learned") for line in lines)


@pytest.mark.parametrize(("url", "expected"), [
    ("http://10.0.0.5:30000", "10.0.0.5-30000"), ("https://gpu-a.internal", "gpu-a.internal-443"),
    ("http://[::1]:8000", "ipv6-::1-8000"), ("http://worker_7:80/", "worker_7-80"),
])
def test_default_worker_id(url: str, expected: str) -> None:
    assert default_worker_id(url) == expected
