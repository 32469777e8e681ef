"""PD pieces (pure): bootstrap rooms and fields, vLLM leg bodies, usage and logprob merges,
conditional disaggregation, the PD pools and config."""

from __future__ import annotations
import json
import random
from typing import Any
import pytest
from hypothesis import given
from hypothesis import strategies as st
from cortex.gateway.config.gateway import (
    BreakerConfig,
    GatewayConfig,
    PDConfig,
    RoutingWeights,
    load_config,
)
from cortex.gateway.dispatch.pd.handoff import (
    MAX_ROOM,
    bootstrap_host,
    bootstrap_room,
    input_logprobs_rewrite,
    merge_input_logprobs_body,
    prefill_input_logprobs,
    sequence_count,
    sglang_leg_body,
    usage_from_prefill,
    usage_rewrite,
    vllm_decode_body,
    vllm_prefill_body,
    wants_input_logprobs,
)
from cortex.gateway.errors import ConfigError
from cortex.gateway.fleet.breaker import CircuitBreaker
from cortex.gateway.fleet.pool import Health, WorkerPool
from cortex.gateway.request.payload import InferencePath
from cortex.gateway.routing.pairing import LocalPrefill, PairDecision
from cortex.gateway.routing.scoring import Candidate, MatchMode, Reason, decide
from cortex.gateway.upstream.sse import SSEForwarder, first_event_error
from cortex.hashing import Engine
from cortex.ledger.model import LedgerState
from cortex.registry import WorkerSpec
from cortex.registry.spec import WorkerRole

W = RoutingWeights()


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


STREAM = (b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n'
          b'data: {"choices":[],"usage":{"prompt_tokens":40,"completion_tokens":3,'
          b'"total_tokens":43,"prompt_tokens_details":{"cached_tokens":40}}}\n\n'
          b"data: [DONE]\n\n")


def scored(worker: str, **kw: Any) -> Any:
    base: dict[str, Any] = {"engine_running": 0, "engine_waiting": 0,
                            "ledger": LedgerState.READY}
    base.update(kw)
    return decide([Candidate(worker, **base)], W, cache_off=Reason.LOAD_ONLY).chosen


def plan(engine: Engine, prompt: int, sequences: int = 1) -> PairDecision:
    d = decide([Candidate("p")], W)
    return PairDecision(engine, d, d, None, prompt, sequences)


def spec(worker: str, role: str, model: str = "m") -> WorkerSpec:
    return WorkerSpec(id=worker, url=f"http://{worker}:1", engine=Engine.SGLANG, model=model,
                      role=role)  # type: ignore[arg-type]


def test_pd_config_from_file_and_env(tmp_path: Any) -> None:
    file = tmp_path / "gw.toml"
    file.write_text('[[models]]\nname = "m"\n[pd]\nprefill_timeout_s = 20\n'
                    "local_prefill_max_tokens = 2048\n")
    config = load_config(file, {"CORTEX_GATEWAY_PD_LOCAL_PREFILL_MAX_RATIO": "0.7",
                                "CORTEX_GATEWAY_PD_FALLBACK_TO_REGULAR": "false"})
    assert config.pd == PDConfig(prefill_timeout_s=20, local_prefill_max_tokens=2048,
                                 local_prefill_max_ratio=0.7, fallback_to_regular=False)
    for bad, fragment in (({"prefill_timeout_s": 0}, "pd.prefill_timeout_s"),
                          ({"local_prefill_max_ratio": 2}, "pd.local_prefill_max_ratio"),
                          ({"max_attempt": 2}, "unknown key")):
        with pytest.raises(ConfigError, match=fragment):
            GatewayConfig.from_mapping({"models": [{"name": "m"}], "pd": bad})
