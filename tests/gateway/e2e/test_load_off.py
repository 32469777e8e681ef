"""``load.poll_interval_s: 0`` turns engine load polling off: the gateway routes and serves
without ever asking an engine for its load (a sim and a gateway on 127.0.0.1)."""

from __future__ import annotations

import aiohttp

from cortex.gateway.config.gateway import LoadConfig
from cortex.testing import metric_sum, wait_until_async

from ..conftest import MODEL, StartGateway, StartSim, spec_of


async def test_a_gateway_with_load_polling_off_never_asks_an_engine_for_its_load(
        start_sim: StartSim, start_gateway: StartGateway, http: aiohttp.ClientSession) -> None:
    sim = await start_sim()
    polled = await start_gateway([spec_of(sim, "w-polled")])
    quiet = await start_gateway([spec_of(sim, "w-quiet")], load=LoadConfig(poll_interval_s=0))

    async def metrics(url: str) -> str:
        async with http.get(url + "/metrics") as resp:
            return await resp.text()

    # the default polls each worker before it is ready; both keep probing health
    assert metric_sum(await metrics(polled.url), "cortex_gateway_load_polls_total") >= 1

    async def probed_twice() -> bool:
        return metric_sum(await metrics(quiet.url), "cortex_gateway_health_probes_total") >= 3

    await wait_until_async(probed_twice, what="three health probes of the quiet gateway")
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    async with http.post(quiet.url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        assert resp.headers["x-cortex-assigned-worker"] == "w-quiet"
    assert metric_sum(await metrics(quiet.url), "cortex_gateway_load_polls_total") == 0
