"""LoRA adapters named as ``model`` (pure): resolution to the base model, the LoRA root of
the keys, configuration checks, the engines' ``/v1/models`` adapter lists, and the body
SGLang is sent."""

from __future__ import annotations

import json

import pytest

from cortex.gateway.config.gateway import GatewayConfig
from cortex.gateway.dispatch.dispatcher import upstream_body
from cortex.gateway.errors import ClientError, ConfigError
from cortex.gateway.request.payload import (
    InferencePath,
    InferenceRequest,
    parse_body,
    parse_request,
)
from cortex.registry.engines import adapters_from_models

pytestmark = pytest.mark.timeout(10)

CONFIG = GatewayConfig.from_mapping({"models": [
    {"name": "base", "engine": "sglang", "adapters": ["sql"]},
    {"name": "other", "engine": "vllm"},
]})
LEARNED = {"poem": "other"}


def parse(body: dict[str, object]) -> InferenceRequest:
    raw = json.dumps(body).encode()
    return parse_request(InferencePath.CHAT, parse_body(raw), CONFIG, adapters=LEARNED.get)


def chat(model: str, **extra: object) -> dict[str, object]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], **extra}


def test_an_adapter_resolves_to_its_base_model_and_roots_the_keys() -> None:
    req = parse(chat("sql"))
    assert (req.model.name, req.adapter, req.lora_name) == ("base", "sql", "sql")
    req = parse(chat("poem"))  # listed by a worker of "other"
    assert (req.model.name, req.adapter) == ("other", "poem")
    req = parse(chat("base", lora_path="sql"))  # SGLang's own way stays as it was
    assert (req.adapter, req.lora_name) == (None, "sql")


def test_unknown_names_and_conflicting_adapters_are_client_errors() -> None:
    with pytest.raises(ClientError) as info:
        parse(chat("nobody"))
    assert info.value.status == 404
    with pytest.raises(ClientError) as info:
        parse(chat("sql", lora_path="poem"))
    assert info.value.status == 400 and info.value.param == "lora_path"


def test_adapter_names_are_checked() -> None:
    with pytest.raises(ConfigError, match="adapters"):
        GatewayConfig.from_mapping({"models": [{"name": "a", "adapters": ["x"]},
                                               {"name": "b", "adapters": ["x"]}]})
    with pytest.raises(ConfigError, match="adapters"):
        GatewayConfig.from_mapping({"models": [{"name": "a", "adapters": ["b"]},
                                               {"name": "b"}]})
    with pytest.raises(ConfigError, match="adapters"):
        GatewayConfig.from_mapping({"models": [{"name": "a", "adapters": [""]}]})


def test_models_lists_name_adapters_by_parent() -> None:
    listing = {"object": "list", "data": [
        {"id": "base", "parent": None}, {"id": "sql", "parent": "base"},
        {"id": "elsewhere", "parent": "another"}, {"id": 7, "parent": "base"}, "junk"]}
    assert adapters_from_models(listing, "base") == frozenset({"sql"})
    assert adapters_from_models({"error": "x"}, "base") is None


def test_sglang_is_told_the_adapter_in_lora_path() -> None:
    req = parse(chat("sql", stream=True))
    raw = json.dumps(req.body).encode()
    sent = json.loads(upstream_body(req, raw))
    assert sent["lora_path"] == "sql" and sent["model"] == "sql"
    assert sent["stream_options"] == {"include_usage": True}
    vllm = parse(chat("poem"))
    raw = json.dumps(vllm.body).encode()
    assert upstream_body(vllm, raw) == raw

