"""The health monitor against a real sim and a real Redis: how often a gateway writes the
leases its probes vouch for."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis

from cortex.gateway.config.gateway import BreakerConfig, HealthConfig, UpstreamConfig
from cortex.gateway.fleet.health import HealthMonitor
from cortex.gateway.fleet.pool import Health, WorkerPool
from cortex.gateway.metrics import GatewayMetrics
from cortex.gateway.upstream.client import UpstreamClient
from cortex.hashing import Engine
from cortex.registry import RedisRegistry, WorkerSpec
from cortex.testing import RedisServer, wait_until_async

from ..conftest import StartSim

pytestmark = pytest.mark.timeout(30)


def _writes(metrics: GatewayMetrics) -> float:
    """Lease writes this gateway made (every outcome)."""
    return sum(sample.value for family in metrics.lease_renewals.collect()
               for sample in family.samples if sample.name.endswith("_total"))


async def test_a_lease_is_written_every_quarter_ttl_not_every_probe_and_at_once_when_gone(
        start_sim: StartSim, redis_server: RedisServer) -> None:
    sim = await start_sim()
    spec = WorkerSpec(id="w", url=sim.url, engine=Engine.SGLANG, model=sim.config.model)
    pool = WorkerPool(BreakerConfig(), forget_after_s=60)
    pool.sync({"w": spec})
    worker = pool.get("w")
    assert worker is not None
    metrics = GatewayMetrics()
    async with (RedisRegistry(redis_server.url) as registry,
                UpstreamClient(UpstreamConfig()) as upstream):
        await registry.register(spec, ttl_s=60.0)
        monitor = HealthMonitor(pool, upstream, registry, HealthConfig(), lease_ttl_s=60.0,
                                metrics=metrics)
        for _ in range(5):  # five rounds well inside a quarter of the TTL (15 s)
            await monitor.probe_round()
        assert worker.health is Health.HEALTHY
        assert _writes(metrics) == 1
        # the entry vanished (Redis restarted empty): the pool marks it, the next probe
        # writes it again without waiting for the quarter
        await registry.deregister("w")
        pool.sync({})
        assert not worker.registered
        await monitor.probe_round()
        assert _writes(metrics) == 2
        assert await registry.get("w") == spec
        pool.sync({"w": spec})
        # a short lease is kept often enough: written again once a quarter of it passed
        monitor.lease_ttl_s = 0.4
        client = aioredis.Redis.from_url(redis_server.url)
        try:
            async def rewritten() -> bool:
                await monitor.probe_round()
                return _writes(metrics) >= 4

            await wait_until_async(rewritten, timeout=10, what="two more lease writes")
            assert 0 < await client.pttl("cortex:v1:worker:w") <= 400
        finally:
            await client.aclose()
