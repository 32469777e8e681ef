"""The gateway's config: from a file with environment overrides, errors that name the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from cortex.gateway.config.gateway import GatewayConfig, load_config
from cortex.gateway.errors import ConfigError
from cortex.hashing import Engine


def test_config_from_toml_with_env_overrides(tmp_path: Path) -> None:
    file = tmp_path / "gw.toml"
    file.write_text("""
[server]
port = 9000
admin_token = "0123456789abcdef"
[routing]
high_watermark = 8
[routing.weights]
alpha = 2.0
[index]
targets = ["127.0.0.1:50051"]
[[models]]
name = "m"
engine = "vllm"
block_size = 32
[[workers]]
id = "w1"
url = "http://127.0.0.1:8001"
engine = "vllm"
model = "m"
""")
    env = {"CORTEX_GATEWAY_SERVER_PORT": "9100", "CORTEX_GATEWAY_ROUTING_BETA": "3.5",
           "CORTEX_GATEWAY_INDEX_TARGETS": "a:1,b:2", "HOME": "/root",
           "CORTEX_GATEWAY_UPSTREAM_HTTP_CLIENT": "aiohttp"}
    config = load_config(file, env)
    assert config.server.port == 9100
    assert config.upstream.http_client == "aiohttp"
    assert load_config(file, {}).upstream.http_client == "lean"
    assert config.routing.weights.alpha == 2.0 and config.routing.weights.beta == 3.5
    assert config.routing.high_watermark == 8
    assert config.index.targets == ("a:1", "b:2")
    assert config.models[0].engine is Engine.VLLM and config.models[0].block_size == 32
    assert config.models[0].domain.block_size == 32
    assert config.workers[0].id == "w1"


@pytest.mark.parametrize(("data", "fragment"), [
    ({"models": []}, "at least one"),
    ({"models": [{"name": "m", "block_size": 0}]}, "block_size"),
    ({"models": [{"name": "m", "engin": "vllm"}]}, "unknown key"),
    ({"models": [{"name": "m"}], "server": {"port": "x"}}, "server.port"),
    ({"models": [{"name": "m"}], "index": {"targets": ["nohost"]}}, "index.targets"),
    ({"models": [{"name": "m"}], "workers": [{"id": "w"}]}, r"workers\[0\]: worker spec lacks"),
    ({"models": [{"name": "m", "tokenizer": "/nonexistent"}]}, "does not exist"),
    ({"models": [{"name": "m"}], "load": {"poll_interval_s": 2}}, r"load\.poll_interval_s"),
    ({"models": [{"name": "m"}], "upstream": {"http_client": "curl"}},
     r"upstream\.http_client: must be lean or aiohttp"),
])
def test_config_errors_name_the_key(data: dict[str, object], fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        GatewayConfig.from_mapping(data)


def test_load_polling_can_be_off_but_not_negative() -> None:
    config = GatewayConfig.from_mapping({"models": [{"name": "m"}], "load": {"poll_interval_s": 0}})
    assert config.load.poll_interval_s == 0
    with pytest.raises(ConfigError, match=r"load\.poll_interval_s: must be >= 0"):
        GatewayConfig.from_mapping({"models": [{"name": "m"}], "load": {"poll_interval_s": -1}})


def test_a_load_poll_slower_than_the_staleness_bound_is_allowed_once_the_bound_moves() -> None:
    config = GatewayConfig.from_mapping({"models": [{"name": "m"}],
                                         "load": {"poll_interval_s": 2},
                                         "routing": {"load_stale_after_s": 5}})
    assert (config.load.poll_interval_s, config.routing.load_stale_after_s) == (2, 5)


def test_config_env_errors() -> None:
    with pytest.raises(ConfigError, match="unknown setting"):
        load_config(None, {"CORTEX_GATEWAY_MODELS": '[{"name": "m"}]',
                           "CORTEX_GATEWAY_NOPE_X": "1"})


def test_tier_weights_come_from_the_environment_too() -> None:
    config = load_config(None, {"CORTEX_GATEWAY_MODELS": '[{"name": "m", "adapters": ["a"]}]',
                                "CORTEX_GATEWAY_ROUTING_HOST_HIT": "0.5",
                                "CORTEX_GATEWAY_ROUTING_DISK_HIT": "0"})
    weights = config.routing.weights
    assert (weights.host_hit, weights.disk_hit) == (0.5, 0.0)
    assert config.adapter_base("a") is config.models[0]
