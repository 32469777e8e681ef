"""The worker address rule (cortex.registry.addresses), pure."""

from __future__ import annotations

import pytest

from cortex.hashing import Engine
from cortex.registry import SpecError, WorkerSpec
from cortex.registry.addresses import AddressPolicy


def spec(url: str, kv_events: str | None = None) -> WorkerSpec:
    return WorkerSpec(id="w", url=url, engine=Engine.SGLANG, model="m", kv_events=kv_events)


@pytest.mark.parametrize("host", [
    "169.254.169.254", "[fe80::1]", "[fd00:ec2::254]", "100.100.100.200",
    "metadata.google.internal", "METADATA.google.internal.", "[::ffff:169.254.169.254]",
])
def test_metadata_and_link_local_addresses_are_denied_by_default(host: str) -> None:
    with pytest.raises(SpecError, match="denied"):
        AddressPolicy.of().check(spec(f"http://{host}:8000"))


@pytest.mark.parametrize("host", ["127.0.0.1", "10.1.2.3", "[::1]", "worker-0.svc"])
def test_ordinary_addresses_pass(host: str) -> None:
    AddressPolicy.of().check(spec(f"http://{host}:8000"))


def test_an_event_endpoint_is_checked_like_the_url() -> None:
    with pytest.raises(SpecError, match="denied"):
        AddressPolicy.of().check(spec("http://10.0.0.1:8000", "tcp://169.254.1.1:5557"))
    AddressPolicy.of().check(spec("http://10.0.0.1:8000", "tcp://*:5557"))


def test_an_allow_list_admits_only_its_networks_and_names() -> None:
    policy = AddressPolicy.of(allowed=("10.0.0.0/8", "worker.local"))
    policy.check(spec("http://10.9.9.9:8000"))
    policy.check(spec("http://worker.local:8000"))
    for host in ("127.0.0.1", "elsewhere.local"):
        with pytest.raises(SpecError, match="not in the allowed"):
            policy.check(spec(f"http://{host}:8000"))


def test_the_defaults_can_be_replaced() -> None:
    AddressPolicy.of(denied=()).check(spec("http://169.254.169.254:80"))
    with pytest.raises(ValueError, match="neither a network"):
        AddressPolicy.of(denied=("10.0.0.0/33",))
