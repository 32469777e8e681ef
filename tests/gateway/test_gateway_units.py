"""Pure pieces: circuit breaker, config loading, request validation, engine load parsers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cortex.gateway.config.gateway import BreakerConfig, GatewayConfig, load_config
from cortex.gateway.errors import ClientError, ConfigError, ErrorCode
from cortex.gateway.fleet.breaker import BreakerState, CircuitBreaker
from cortex.gateway.fleet.load import (
    LoadFormatError,
    parse_sglang_get_load,
    parse_sglang_loads,
    parse_vllm_metrics,
)
from cortex.gateway.request.payload import InferencePath, PromptKind, parse_body, parse_request
from cortex.hashing import Engine


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_breaker_opens_half_opens_and_closes() -> None:
    clock = Clock()
    breaker = CircuitBreaker(BreakerConfig(failures=3, window_s=10, open_s=5,
                                           half_open_successes=2), clock)
    for _ in range(3):
        assert breaker.allows()
        breaker.on_failure()
    assert breaker.state is BreakerState.OPEN and not breaker.allows()
    clock.now = 5.0
    state: BreakerState = breaker.state
    assert state is BreakerState.HALF_OPEN and breaker.allows()
    breaker.on_attempt()
    assert not breaker.allows()  # one trial at a time
    breaker.on_success()
    breaker.on_attempt()
    breaker.on_failure()
    assert breaker.state is BreakerState.OPEN
    clock.now = 10.0
    for _ in range(2):
        breaker.on_attempt()
        breaker.on_success()
    final: BreakerState = breaker.state
    assert final is BreakerState.CLOSED


def test_breaker_forgets_old_failures() -> None:
    clock = Clock()
    breaker = CircuitBreaker(BreakerConfig(failures=2, window_s=1, open_s=5), clock)
    breaker.on_failure()
    clock.now = 2.0
    breaker.on_failure()
    assert breaker.state is BreakerState.CLOSED


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
           "CORTEX_GATEWAY_INDEX_TARGETS": "a:1,b:2", "HOME": "/root"}
    config = load_config(file, env)
    assert config.server.port == 9100
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
])
def test_config_errors_name_the_key(data: dict[str, object], fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        GatewayConfig.from_mapping(data)


def test_config_env_errors() -> None:
    with pytest.raises(ConfigError, match="unknown setting"):
        load_config(None, {"CORTEX_GATEWAY_MODELS": '[{"name": "m"}]',
                           "CORTEX_GATEWAY_NOPE_X": "1"})


CONFIG = GatewayConfig.from_mapping({"models": [{"name": "m"}, {"name": "n"}]})


def parse(endpoint: InferencePath, body: object) -> object:
    return parse_request(endpoint, parse_body(json.dumps(body).encode()), CONFIG)


@pytest.mark.parametrize(("endpoint", "body", "code", "status"), [
    (InferencePath.CHAT, [], ErrorCode.INVALID_JSON, 400),
    (InferencePath.CHAT, {"messages": [{"role": "user", "content": "x"}]},
     ErrorCode.INVALID_REQUEST, 400),
    (InferencePath.CHAT, {"model": "zz", "messages": [{"role": "user", "content": "x"}]},
     ErrorCode.MODEL_NOT_FOUND, 404),
    (InferencePath.CHAT, {"model": "m", "messages": []}, ErrorCode.INVALID_REQUEST, 400),
    (InferencePath.CHAT, {"model": "m", "messages": [{"role": "robot", "content": "x"}]},
     ErrorCode.INVALID_REQUEST, 400),
    (InferencePath.CHAT, {"model": "m", "messages": [{"role": "user", "content": 5}]},
     ErrorCode.INVALID_REQUEST, 400),
    (InferencePath.CHAT, {"model": "m", "messages": [{"role": "user"}], "stream": "yes"},
     ErrorCode.INVALID_REQUEST, 400),
    (InferencePath.CHAT, {"model": "m", "messages": [{"role": "user"}], "max_tokens": -1},
     ErrorCode.INVALID_REQUEST, 400),
    (InferencePath.COMPLETIONS, {"model": "m", "prompt": [1, -2]}, ErrorCode.INVALID_REQUEST, 400),
    (InferencePath.COMPLETIONS, {"model": "m", "prompt": [[1], []]},
     ErrorCode.INVALID_REQUEST, 400),
    (InferencePath.COMPLETIONS, {"model": "m", "prompt": {"a": 1}}, ErrorCode.INVALID_REQUEST, 400),
    (InferencePath.GENERATE, {"sampling_params": {}}, ErrorCode.INVALID_REQUEST, 400),
    (InferencePath.GENERATE, {"input_ids": "abc"}, ErrorCode.INVALID_REQUEST, 400),
])
def test_bad_requests(endpoint: InferencePath, body: object, code: ErrorCode, status: int) -> None:
    with pytest.raises(ClientError) as caught:
        parse(endpoint, body)
    assert (caught.value.code, caught.value.status) == (code, status)


def test_malformed_json() -> None:
    with pytest.raises(ClientError) as caught:
        parse_body(b"{not json")
    assert caught.value.code is ErrorCode.INVALID_JSON
    body = json.loads(caught.value.body())
    assert body["error"]["code"] == "invalid_json"
    assert body["error"]["type"] == "invalid_request_error"


def test_good_requests() -> None:
    tool = {"type": "function", "function": {"name": "f"}}
    chat = parse_request(InferencePath.CHAT, {
        "model": "n", "messages": [{"role": "user", "content": "hi"}], "stream": True,
        "stream_options": {"include_usage": True}, "tools": [tool],
        "continue_final_message": True}, CONFIG)
    assert chat.model.name == "n" and chat.stream and chat.wants_usage
    # the rendering arguments are the model's engine's reading of the body (cortex.chat)
    assert chat.prompt.chat is not None and chat.prompt.chat.engine is Engine.SGLANG
    assert chat.prompt.chat.continue_final_message is True
    assert chat.prompt.chat.tools is not None and chat.prompt.chat.tools[0]["function"][
        "name"] == "f"
    batch = parse_request(InferencePath.COMPLETIONS, {"model": "m", "prompt": [[5, 6], [7]]},
                          CONFIG)
    assert batch.prompt.kind is PromptKind.TOKENS and batch.prompt.token_ids == (5, 6)
    gen = parse_request(InferencePath.GENERATE, {"text": ["a", "b"]}, CONFIG)
    assert gen.model.name == "m" and gen.prompt.text == "a"


def test_engine_load_parsers() -> None:
    assert parse_sglang_loads({"loads": [{"num_running_reqs": 2, "num_waiting_reqs": 1},
                                         {"num_running_reqs": 3, "num_waiting_reqs": 0}]}) == (5, 1)
    assert parse_sglang_get_load([{"num_reqs": 4, "num_waiting_reqs": 2}]) == (4, 2)
    text = ('# HELP x\nvllm:num_requests_running{model_name="m",engine="0"} 3.0\n'
            'vllm:num_requests_running{model_name="m",engine="1"} 1.0\n'
            'vllm:num_requests_waiting{model_name="m",engine="0"} 2.0\n')
    assert parse_vllm_metrics(text) == (4, 2)
    with pytest.raises(LoadFormatError):
        parse_vllm_metrics("# nothing\n")
    with pytest.raises(LoadFormatError):
        parse_sglang_loads({"loads": [{"num_running_reqs": "x"}]})


def test_tier_weights_come_from_the_environment_too() -> None:
    config = load_config(None, {"CORTEX_GATEWAY_MODELS": '[{"name": "m", "adapters": ["a"]}]',
                                "CORTEX_GATEWAY_ROUTING_HOST_HIT": "0.5",
                                "CORTEX_GATEWAY_ROUTING_DISK_HIT": "0"})
    weights = config.routing.weights
    assert (weights.host_hit, weights.disk_hit) == (0.5, 0.0)
    assert config.adapter_base("a") is config.models[0]
