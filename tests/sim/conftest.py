"""Fixtures of the simulated-worker tests: in-process sims and a KV-event subscriber."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest
import zmq.asyncio

from cortex.sim.config import SimConfig, TimingConfig
from cortex.sim.server import SimServer
from cortex.sim.testkit import EventSubscriber, StartSim

ZERO = TimingConfig(zero_cost=True)

@pytest.fixture
async def start_sim() -> AsyncIterator[StartSim]:
    """``await start_sim(engine="vllm", ...)``: a running in-process sim, closed at teardown.

    Defaults: ports 0, replay on, block size 4, zero-cost timing.
    """
    async with contextlib.AsyncExitStack() as stack:

        async def start(**overrides: Any) -> SimServer:
            fields: dict[str, Any] = {"port": 0, "kv_events_port": 0, "replay_port": 0,
                                      "block_size": 4, "kv_capacity_blocks": 256, "timing": ZERO}
            fields.update(overrides)
            return await stack.enter_async_context(SimServer(SimConfig(**fields)))

        yield start


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        yield session


@pytest.fixture
async def subscribe() -> AsyncIterator[Callable[[SimServer], EventSubscriber]]:
    """``subscribe(sim)``: an :class:`EventSubscriber` on the sim's PUB, closed at teardown."""
    ctx = zmq.asyncio.Context()
    subs: list[EventSubscriber] = []

    def make(sim: SimServer) -> EventSubscriber:
        sub = EventSubscriber.connect(ctx, sim.kv_events_endpoint, sim.config.engine)
        subs.append(sub)
        return sub

    try:
        yield make
    finally:
        for sub in subs:
            sub.close()
        ctx.term()
