"""The gateway process's state, started for real (sims on 127.0.0.1, an in-process
registry): what startup builds, what readiness says, what a drain and the shutdown do."""

from __future__ import annotations

import pytest

from cortex.gateway.runtime import Degradation, Readiness, Runtime
from cortex.registry import WorkerSpec
from cortex.registry.memory import MemoryRegistry
from cortex.testing.procs import free_port

from ..conftest import MODEL, StartSim, gateway_config, spec_of

pytestmark = pytest.mark.timeout(30)


async def test_a_reachable_worker_is_routable_when_startup_ends(start_sim: StartSim) -> None:
    sim = await start_sim()
    registry = MemoryRegistry()
    async with await Runtime.load(gateway_config([spec_of(sim, "w0")]),
                                  registry=registry) as gw:
        assert gw.router is not None and gw.dispatcher is not None
        assert await registry.get("w0") == spec_of(sim, "w0")  # seeded
        worker = gw.pool.get("w0")
        assert worker is not None and worker.routable()
        state, reasons = gw.readiness()
        # no index address: routing runs load-only, and says so
        assert state is Readiness.DEGRADED and Degradation.NO_INDEX in reasons
        assert gw.metrics.ready._value.get() == 1
        gw.drain()
        assert gw.draining and gw.metrics.draining._value.get() == 1
    assert all(task.done() for task in gw._tasks)


async def test_without_a_reachable_worker_it_is_unavailable() -> None:
    dead = WorkerSpec(id="dead", url=f"http://127.0.0.1:{free_port()}", engine="sglang",
                      model=MODEL, block_size=16)  # type: ignore[arg-type]
    async with await Runtime.load(gateway_config([dead]), registry=MemoryRegistry()) as gw:
        state, _ = gw.readiness()
        assert state is Readiness.UNAVAILABLE
        assert gw.metrics.ready._value.get() == 0
