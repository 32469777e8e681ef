"""URL seeds against real sims on 127.0.0.1: a seed is handed over once its engine says
what it is, and a URL nobody answers stays pending until it does."""

from __future__ import annotations

import pytest

from cortex.gateway.config.gateway import DiscoveryConfig
from cortex.gateway.fleet.seeding import UrlSeeder
from cortex.registry import WorkerSpec
from cortex.testing.procs import free_port

from ..conftest import StartSim

pytestmark = pytest.mark.timeout(30)


async def test_a_running_engine_is_seeded_once_a_silent_url_stays_pending(
        start_sim: StartSim) -> None:
    sim = await start_sim()
    silent = f"http://127.0.0.1:{free_port()}"
    seeded: list[WorkerSpec] = []

    async def seed(spec: WorkerSpec) -> None:
        seeded.append(spec)

    seeder = UrlSeeder(DiscoveryConfig(worker_urls=(sim.url + "/", silent), timeout_s=1.0),
                       seed)
    found = await seeder.round()
    assert found == seeded and len(seeded) == 1
    spec = seeded[0]
    assert (spec.engine, spec.block_size) == (sim.config.engine, sim.config.block_size)
    assert seeder.pending == [silent]
    assert await seeder.round() == [] and len(seeded) == 1  # never handed over twice
