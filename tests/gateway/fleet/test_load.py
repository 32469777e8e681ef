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


CONFIG = GatewayConfig.from_mapping({"models": [{"name": "m"}, {"name": "n"}]})


def parse(endpoint: InferencePath, body: object) -> object:
    return parse_request(endpoint, parse_body(json.dumps(body).encode()), CONFIG)


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
