"""SGLang EAGLE workers registered without ``kv_lookahead``: the gateway learns the mode
from their ``/server_info`` and routes repeats ``exact_kv`` with the engine's cached tokens
(real Redis, index, ingest, sims and gateway on 127.0.0.1)."""

from __future__ import annotations

import aiohttp
import pytest

from cortex.index.server import IndexServer
from cortex.testing import RedisServer, wait_until_async

from ..conftest import StartGateway, StartSim
from .test_cluster import chat, cluster, wait_index_holds

pytestmark = pytest.mark.timeout(60)


async def test_sglang_eagle_mode_learned_from_server_info_routes_exact_kv(
    redis_server: RedisServer, index_server: IndexServer, start_sim: StartSim,
    start_gateway: StartGateway, http: aiohttp.ClientSession,
) -> None:
    sims = {f"w{i}": await start_sim(eagle_lookahead=1) for i in range(2)}
    async with cluster(redis_server, index_server, sims, start_gateway, http) as c:
        pool = c.gateway.gateway.pool

        def learned() -> bool:
            return all((w := pool.get(wid)) is not None and w.kv_lookahead == 1
                       for wid in sims)

        await wait_until_async(learned, timeout=20, what="the EAGLE mode from /server_info")
        headers, cached = await c.send(chat("first eagle question"))
        holder = headers["x-cortex-assigned-worker"]
        second = chat("another eagle question")
        await wait_index_holds(c, second, holder)
        for _ in range(3):
            headers, cached = await c.send(second)
            assert headers["x-cortex-assigned-worker"] == holder
            assert headers["x-cortex-match-mode"] == "exact_kv"
            assert 0 < int(headers["x-cortex-cache-hit-tokens"]) <= cached
