"""Worker KV capacity as the engines report it, and the ledger bound made of it (pure)."""

from __future__ import annotations

from cortex.ingest.capacity import block_bound, sglang_capacity, vllm_capacity

VLLM_METRICS = (
    "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
    "# TYPE vllm:cache_config_info gauge\n"
    'vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",'
    'gpu_memory_utilization="0.9",num_cpu_blocks="None",num_gpu_blocks="8192",'
    'prefix_caching_hash_algo="sha256"} 1.0\n'
    "vllm:num_requests_running{engine=\"0\"} 0.0\n"
)


def test_vllm_capacity_is_the_gpu_pool_plus_a_cpu_pool_when_there_is_one() -> None:
    assert vllm_capacity(VLLM_METRICS) == 8192
    with_cpu = VLLM_METRICS.replace('num_cpu_blocks="None"', 'num_cpu_blocks="1000"')
    assert vllm_capacity(with_cpu) == 9192
    assert vllm_capacity(VLLM_METRICS.replace('num_gpu_blocks="8192"',
                                              'num_gpu_blocks="None"')) is None
    assert vllm_capacity("vllm:num_requests_running 0.0\n") is None


def test_sglang_capacity_is_the_token_pool_over_the_page_size() -> None:
    assert sglang_capacity({"max_total_num_tokens": 131072, "page_size": 16}) == 8192
    assert sglang_capacity({"max_total_num_tokens": 100, "page_size": 16}) == 7
    assert sglang_capacity({"max_total_num_tokens": 500}) == 500  # page size 1
    assert sglang_capacity({"page_size": 16}) is None
    assert sglang_capacity({"max_total_num_tokens": "many", "page_size": 16}) is None
    assert sglang_capacity(["not", "an", "object"]) is None


def test_the_bound_adds_the_margin_and_the_configured_tiers() -> None:
    assert block_bound(8192, 0.25, 0) == 10240
    assert block_bound(8192, 0.25, 100_000) == 110240
    assert block_bound(None, 0.25, 100_000) == 0  # unknown: no bound
