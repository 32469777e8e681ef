"""WorkerSpec validation, endpoints per DP rank and the JSON round trip."""

from __future__ import annotations

import json
from typing import Any

import pytest

from cortex.hashing import Engine
from cortex.registry import SpecError, WorkerRole, WorkerSpec, parse_endpoint


def spec(**overrides: Any) -> WorkerSpec:
    fields: dict[str, Any] = {
        "id": "w1",
        "url": "http://10.0.0.5:30000",
        "engine": "sglang",
        "model": "qwen",
        "kv_events": "tcp://10.0.0.5:5557",
    }
    fields.update(overrides)
    return WorkerSpec(**fields)


def test_valid_spec_normalises_enums_and_labels() -> None:
    s = spec(role="prefill", bootstrap_port=8998, labels={"zone": "b", "rack": "a"})
    assert s.engine is Engine.SGLANG
    assert s.role is WorkerRole.PREFILL
    assert list(s.labels) == ["rack", "zone"]
    with pytest.raises(TypeError):
        s.labels["x"] = "y"  # type: ignore[index]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"id": ""}, "id:"),
        ({"id": "has space"}, "id:"),
        ({"url": "10.0.0.5:30000"}, "url:"),
        ({"url": "ftp://h:1"}, "url:"),
        ({"url": "http://:80"}, "url:"),
        ({"url": "http://h:99999"}, "url:"),
        ({"url": "http://h:1/?q=1"}, "url:"),
        ({"url": "http://user:secret@h:1"}, "url: must not carry credentials"),
        ({"url": "http://user@h:1"}, "url: must not carry credentials"),
        ({"engine": "tgi"}, "engine: unknown engine 'tgi'"),
        ({"role": "both"}, "role:"),
        ({"model": " "}, "model:"),
        ({"dp_size": 0}, "dp_size:"),
        ({"dp_size": True}, "dp_size:"),
        ({"kv_events": "tcp://h"}, "kv_events: bad endpoint"),
        ({"kv_events": "tcp://h:0"}, "kv_events: port 0"),
        ({"kv_events": "tcp://h:70000"}, "kv_events: port 70000"),
        ({"kv_events": "udp://h:5557"}, "kv_events: bad endpoint"),
        ({"kv_events": "tcp://h:65535", "dp_size": 2}, "runs past 65535"),
        ({"kv_events": "ipc:///tmp/x", "dp_size": 2}, "ipc endpoint"),
        ({"kv_events": None, "replay": "tcp://h:5558"}, "replay: a replay endpoint needs"),
        ({"replay": "tcp://h:-1"}, "replay: bad endpoint"),
        ({"bootstrap_port": 0, "role": "prefill"}, "bootstrap_port:"),
        ({"bootstrap_port": 8998}, "applies only to SGLang prefill"),
        ({"engine": "vllm", "role": "prefill", "bootstrap_port": 8998}, "applies only"),
        ({"block_size": 0}, "block_size:"),
        ({"labels": {"bad key": "v"}}, "labels:"),
        ({"labels": {"k": 1}}, "labels:"),
    ],
)
def test_invalid_fields_are_rejected_with_a_clear_message(
    overrides: dict[str, Any], message: str
) -> None:
    with pytest.raises(SpecError, match=message.replace("(", r"\(")):
        spec(**overrides)


def test_endpoints_per_dp_rank_and_wildcard_host() -> None:
    s = spec(
        url="http://worker-3.local:8000", kv_events="tcp://*:5557", replay="tcp://0.0.0.0:6000",
        dp_size=4,
    )
    assert s.kv_events_endpoint(0) == "tcp://worker-3.local:5557"
    assert s.kv_events_endpoint(3) == "tcp://worker-3.local:5560"
    assert s.replay_endpoint(2) == "tcp://worker-3.local:6002"
    with pytest.raises(ValueError):
        s.kv_events_endpoint(4)
    v6 = spec(url="http://[fd00::5]:8000", kv_events="tcp://*:5557")
    assert v6.kv_events_endpoint(0) == "tcp://[fd00::5]:5557"
    assert spec(kv_events=None).kv_events_endpoint() is None
    assert spec().replay_endpoint() is None


def test_parse_endpoint_forms() -> None:
    assert str(parse_endpoint("tcp://[::1]:5557")) == "tcp://[::1]:5557"
    assert parse_endpoint("ipc:///run/kv.sock").for_rank(0, "h") == "ipc:///run/kv.sock"


def test_json_round_trip_and_forward_compatibility() -> None:
    s = spec(replay="tcp://10.0.0.5:5558", topic="kv", block_size=16, labels={"a": "b"})
    assert WorkerSpec.from_json(s.to_json()) == s
    data = json.loads(s.to_json())
    data["field_from_the_future"] = 1
    data["labels"] = None
    assert WorkerSpec.from_json(json.dumps(data)) == s.with_changes(labels={})


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ("{", "not valid JSON"),
        ("[]", "JSON object"),
        ('{"id": "w"}', "lacks required"),
        ('{"id": "w", "url": "http://h", "engine": "vllm", "model": "m", "dp_size": "2"}',
         "dp_size"),
    ],
)
def test_bad_json_is_a_spec_error(payload: str, message: str) -> None:
    with pytest.raises(SpecError, match=message):
        WorkerSpec.from_json(payload)


def test_with_changes_validates() -> None:
    with pytest.raises(SpecError):
        spec().with_changes(engine="nope")


def test_a_rejected_url_with_credentials_never_echoes_the_password() -> None:
    with pytest.raises(SpecError) as raised:
        spec(url="http://admin:hunter2@10.0.0.5:30000")
    assert "hunter2" not in str(raised.value)
