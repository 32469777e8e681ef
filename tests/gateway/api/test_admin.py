"""Worker addresses at the admin API and in the registry view (cortex.gateway.api.admin,
cortex.gateway.runtime): a denied address is a 400 that registers nothing, and a spec on
one written to the registry directly never enters the pool."""

from __future__ import annotations

import aiohttp
import pytest

from cortex.gateway.config.gateway import DiscoveryConfig, GatewayConfig, ModelConfig
from cortex.gateway.errors import ConfigError
from cortex.gateway.fleet.pool import Health
from cortex.registry import WorkerSpec
from cortex.testing import wait_until_async

from ..conftest import MODEL, TOKEN, StartGateway, StartSim, spec_of

pytestmark = pytest.mark.timeout(30)

AUTH = {"authorization": f"Bearer {TOKEN}"}


@pytest.mark.parametrize("body", [
    {"url": "http://169.254.169.254:80"},  # refused before the discovery connects
    {"id": "meta", "url": "http://169.254.169.254:80", "engine": "sglang", "model": MODEL},
    {"id": "meta", "url": "http://10.0.0.1:80", "engine": "sglang", "model": MODEL,
     "kv_events": "tcp://[fe80::1]:5557"},
])
async def test_the_admin_api_refuses_a_denied_worker_address(
    start_gateway: StartGateway, http: aiohttp.ClientSession, body: dict[str, str],
) -> None:
    gw = await start_gateway([])
    async with http.post(gw.url + "/admin/workers", json=body, headers=AUTH) as resp:
        assert resp.status == 400
        assert "denied" in (await resp.json())["error"]["message"]
    assert (await gw.gateway.registry.list()).workers == {}


async def test_a_denied_spec_in_the_registry_never_enters_the_pool(
    start_sim: StartSim, start_gateway: StartGateway,
) -> None:
    sim = await start_sim()
    gw = await start_gateway([spec_of(sim, "good")])
    bad = WorkerSpec.from_dict({**spec_of(sim, "bad").to_dict(),
                                "url": "http://169.254.169.254:80"})
    await gw.gateway.registry.register(bad, 30)
    await gw.gateway.registry.register(spec_of(sim, "later"), 30)
    await wait_until_async(lambda: gw.gateway.pool.get("later") is not None, timeout=10,
                           what="the registry read")
    assert gw.gateway.pool.get("bad") is None
    # a worker let in before is checked again when its entry changes; a healthy one stays in
    # the pool with its last allowed spec (an unprobed one would leave it at once)
    later = gw.gateway.pool.get("later")
    assert later is not None
    await wait_until_async(lambda: later.health is Health.HEALTHY, timeout=10,
                           what="the first probe of later")
    moved = WorkerSpec.from_dict({**spec_of(sim, "later").to_dict(),
                                  "url": "http://169.254.169.254:80"})
    await gw.gateway.registry.register(moved, 30)
    await wait_until_async(lambda: not later.registered, timeout=10,
                           what="the moved entry left out of the view")
    assert gw.gateway.pool.get("later") is later
    assert later.spec == spec_of(sim, "later")


def test_a_denied_seed_url_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"discovery\.worker_urls"):
        GatewayConfig(models=(ModelConfig(name="m"),),
                      discovery=DiscoveryConfig(worker_urls=("http://169.254.169.254:80",)))
