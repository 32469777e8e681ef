"""``ClusterSpec`` validation and what the launcher derives from it (no process started)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cortex.devcluster.cluster import ClusterSpec, LocalCluster
from cortex.gateway.config.gateway import GatewayConfig
from cortex.hashing import Engine
from cortex.registry import WorkerRole


def test_defaults_are_a_two_worker_sglang_cluster_on_8080() -> None:
    spec = ClusterSpec()
    assert (spec.workers, spec.engine, spec.gateways, spec.port) == (2, Engine.SGLANG, 1, 8080)
    assert spec.worker_roles() == [("worker-0", WorkerRole.REGULAR),
                                   ("worker-1", WorkerRole.REGULAR)]
    assert spec.poll_interval_s == 1.0
    assert ClusterSpec(lease_ttl_s=2).poll_interval_s == 0.5


def test_a_pd_pool_gets_the_larger_half_as_prefill() -> None:
    roles = ClusterSpec(workers=3, pd=True, engine="vllm").worker_roles()  # type: ignore[arg-type]
    assert roles == [("prefill-0", WorkerRole.PREFILL), ("prefill-1", WorkerRole.PREFILL),
                     ("decode-0", WorkerRole.DECODE)]


@pytest.mark.parametrize(("fields", "message"), [
    ({"workers": -1}, "workers: must be >= 0"),
    ({"pd": True, "workers": 1}, "pd: a prefill/decode pool needs workers >= 2"),
    ({"port": 65535, "gateways": 2}, "port: 65535"),
    ({"services": False}, "gateways need the services"),
    ({"block_size": 0}, "block_size: must be >= 1"),
    ({"lease_ttl_s": 0}, "lease_ttl_s: must be > 0"),
    ({"model": " "}, "model: must be a non-empty name"),
    ({"engine": "tgi"}, "engine: 'tgi' is not one of sglang, vllm"),
])
def test_invalid_specs_name_the_field(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ClusterSpec(**fields)  # type: ignore[arg-type]


def test_gateway_configs_are_valid_and_take_overrides(tmp_path: Path) -> None:
    spec = ClusterSpec(lease_ttl_s=3, gateway_config={
        "routing": {"weights": {"beta": 32}}, "upstream": {"max_attempts": 2}})
    cluster = LocalCluster(spec, tmp_path)
    cluster.index_target, cluster.redis_url = "127.0.0.1:50051", "redis://127.0.0.1:6379/0"
    config = GatewayConfig.from_mapping(cluster._gateway_document(1, 8081))
    assert (config.gateway_id, config.server.port) == ("gateway-1", 8081)
    assert config.routing.weights.beta == 32 and config.routing.weights.alpha == 1.0
    assert config.upstream.max_attempts == 2
    assert config.registry.lease_ttl_s == 3 and config.health.interval_s == 0.75
    assert config.server.admin_token == cluster.admin_token
    assert config.index.targets == ("127.0.0.1:50051",)
    assert [(m.name, m.engine, m.block_size) for m in config.models] == [
        ("cortex-sim", Engine.SGLANG, 16)]
