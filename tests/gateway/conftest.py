"""Fixtures of the gateway tests: in-process sims, index, gateways on 127.0.0.1 port 0."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import aiohttp
import pytest

from cortex.gateway.config.gateway import (
    GatewayConfig,
    HealthConfig,
    IndexConfig,
    LoadConfig,
    ModelConfig,
    RegistryConfig,
    RoutingConfig,
    ServerConfig,
)
from cortex.gateway.server import GatewayServer
from cortex.index.config import IndexConfig as IndexServerConfig
from cortex.index.server import IndexServer
from cortex.registry import WorkerSpec
from cortex.sim.config import SimConfig, TimingConfig
from cortex.sim.server import SimServer

MODEL = "cortex-sim"
BLOCK = 16
DECODE_ONLY = TimingConfig(prefill_ms_per_uncached_token=0.0, prefill_overhead_ms=0.0,
                           decode_ms_per_token=20.0)
"""Sim timing where only answers take time (20 ms a token): requests stay open a while."""
TOKEN = "test-admin-token-0123456789"
ZERO = TimingConfig(zero_cost=True)

StartSim = Callable[..., Awaitable[SimServer]]
StartGateway = Callable[..., Awaitable[GatewayServer]]


def spec_of(sim: SimServer, worker_id: str, **extra: Any) -> WorkerSpec:
    """The registry spec of a running sim."""
    return WorkerSpec(id=worker_id, url=sim.url, engine=sim.config.engine, model=MODEL,
                      kv_events=sim.kv_events_endpoint, replay=sim.replay_endpoint,
                      block_size=sim.config.block_size, **extra)


def gateway_config(workers: Sequence[WorkerSpec], **sections: Any) -> GatewayConfig:
    """A test config: fast probes and polls, the sims' model, admin token set."""
    values: dict[str, Any] = {
        "models": (ModelConfig(name=MODEL, block_size=BLOCK),),
        "server": ServerConfig(host="127.0.0.1", port=0, admin_token=TOKEN,
                               graceful_timeout_s=2.0),
        "health": HealthConfig(interval_s=0.2, timeout_s=1.0),
        "load": LoadConfig(poll_interval_s=0.1),
        "registry": RegistryConfig(poll_interval_s=0.2),
        "routing": RoutingConfig(load_stale_after_s=5.0),
        "index": IndexConfig(),
        "workers": tuple(workers),
    }
    values.update(sections)
    return GatewayConfig(**values)


def gateway_index(*targets: str, **fields: Any) -> IndexConfig:
    """The gateway's index section for ``targets``. The sims, the index and the gateway of a
    test share one event loop on a shared machine, so a replica stream and a Match get more
    time than in production before they read as a dead index (a test of those bounds passes
    its own)."""
    values: dict[str, Any] = {"replica_grace_s": 10.0, "match_timeout_ms": 2000.0}
    values.update(fields)
    return IndexConfig(targets=targets, **values)


@pytest.fixture
async def start_sim() -> AsyncIterator[StartSim]:
    """``await start_sim(**SimConfig overrides)``: a running sim (zero-cost, block 16)."""
    async with contextlib.AsyncExitStack() as stack:

        async def start(**overrides: Any) -> SimServer:
            fields: dict[str, Any] = {"port": 0, "kv_events_port": 0, "replay_port": 0,
                                      "block_size": BLOCK, "model": MODEL, "timing": ZERO}
            fields.update(overrides)
            return await stack.enter_async_context(SimServer(SimConfig(**fields)))

        yield start


@pytest.fixture
async def index_server() -> AsyncIterator[IndexServer]:
    async with IndexServer(IndexServerConfig(host="127.0.0.1", port=0,
                                             metrics_port=None)) as server:
        yield server


@pytest.fixture
async def start_gateway() -> AsyncIterator[StartGateway]:
    """``await start_gateway(workers, environ=None, **GatewayConfig sections)``: a running
    gateway (``environ``: the environment it resolves worker credentials in)."""
    async with contextlib.AsyncExitStack() as stack:

        async def start(workers: Sequence[WorkerSpec] = (), environ: dict[str, str] | None = None,
                        **sections: Any) -> GatewayServer:
            config = gateway_config(workers, **sections)
            return await stack.enter_async_context(GatewayServer(config, environ=environ))

        yield start


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        yield session
