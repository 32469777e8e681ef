"""Discovery's pure core: the parsers' fields merged into a spec (explicit values win; a
required field nobody supplied is named; bind addresses reached at the worker's host)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cortex.hashing import Engine
from cortex.registry import Discovery, DiscoveryError, SpecError, default_worker_id
from cortex.registry.engine_spec import HASH_ALGO_LABEL
from cortex.registry.engines import (
    parse_sglang_server_info,
    parse_v1_models,
    parse_vllm_kv_event_sources,
    parse_vllm_metrics,
)

pytestmark = pytest.mark.timeout(10)

DATA = Path(__file__).parent / "data"


def discovered(url: str = "http://10.0.0.5:30000") -> Discovery:
    info = json.loads((DATA / "sglang_0_5_23_server_info.json").read_text())
    return Discovery.merge(url, [("GET /server_info", parse_sglang_server_info(info)),
                                 ("GET /v1/models", {"context_length": 40960})])


def vllm_discovered(url: str = "http://10.0.0.7:8101") -> Discovery:
    """What discovery learns from the real vLLM 0.32 engine's answers."""
    vllm = DATA / "vllm_0_32"
    sources, _ = parse_vllm_kv_event_sources(
        json.loads((vllm / "kv_event_sources.json").read_text()))
    models, ids = parse_v1_models(json.loads((vllm / "v1_models.json").read_text()))
    metrics = parse_vllm_metrics((vllm / "metrics.txt").read_text()).learned
    return Discovery.merge(url, [("GET /v1/models", models),
                                 ("GET /kv_event_sources", sources),
                                 ("GET /metrics", metrics)], models=ids)


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


def test_bind_addresses_are_learned_at_the_worker_host() -> None:
    found = vllm_discovered()
    assert (found.learned["kv_events"], found.learned["replay"]) == (
        "tcp://10.0.0.7:5601", "tcp://10.0.0.7:5701")
    assert "kv_events = tcp://10.0.0.7:5601 (GET /kv_event_sources, bound as tcp://*:5601)" \
        in found.report()
    spec = found.spec()
    assert (spec.kv_events, spec.kv_events_endpoint(0), spec.replay_endpoint(0)) == (
        "tcp://10.0.0.7:5601", "tcp://10.0.0.7:5601", "tcp://10.0.0.7:5701")
    ipv6 = Discovery.merge("http://[fd00::7]:8101", [("x", {"kv_events": "tcp://0.0.0.0:5601"})])
    assert ipv6.learned["kv_events"] == "tcp://[fd00::7]:5601"
    named = Discovery.merge("http://10.0.0.7:8101", [("x", {"kv_events": "tcp://pub-host:5601"})])
    assert named.learned["kv_events"] == "tcp://pub-host:5601"  # a real host is kept


def test_the_engine_hash_algo_becomes_the_ingest_label() -> None:
    spec = vllm_discovered().spec()
    assert (spec.engine, spec.model, spec.block_size, spec.context_length) == (
        Engine.VLLM, "tiny-qwen", 16, 4096)
    assert spec.labels[HASH_ALGO_LABEL] == "sha256"
    mine = vllm_discovered().spec({"labels": {HASH_ALGO_LABEL: "xxhash", "team": "a"}})
    assert dict(mine.labels) == {HASH_ALGO_LABEL: "xxhash", "team": "a"}  # explicit wins
    assert "hash_algo = sha256 (GET /metrics)" in vllm_discovered().report()
