"""The engines' load parsers (pure)."""

from __future__ import annotations

import pytest

from cortex.gateway.fleet.load import (
    LoadFormatError,
    parse_sglang_get_load,
    parse_sglang_loads,
    parse_vllm_metrics,
)


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
