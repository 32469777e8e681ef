"""Fixtures of the index tests: a real in-process index on 127.0.0.1 and a grpclib channel."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import pytest
from grpclib.client import Channel

from cortex.index.config import IndexConfig
from cortex.index.server import IndexServer
from cortex.ledger.client import IndexStub
from cortex.ledger.grpc import LedgerCodec


def loopback_config(**overrides: object) -> IndexConfig:
    """Loopback, ephemeral ports, quick heartbeats and retries."""
    base: dict[str, object] = {
        "host": "127.0.0.1",
        "port": 0,
        "metrics_host": "127.0.0.1",
        "metrics_port": 0,
        "changes_heartbeat_s": 0.2,
        "resync_retry_s": 0.0,
        "shutdown_grace_s": 2.0,
    }
    base.update(overrides)
    return IndexConfig(**base)  # type: ignore[arg-type]


@pytest.fixture
def make_config() -> Callable[..., IndexConfig]:
    """``make_config(**overrides)``: a loopback config for servers a test starts itself."""
    return loopback_config


@pytest.fixture
def index_config() -> IndexConfig:
    return loopback_config()


@pytest.fixture
async def index_server(index_config: IndexConfig) -> AsyncIterator[IndexServer]:
    async with IndexServer(index_config) as server:
        yield server


@pytest.fixture
async def channel(index_server: IndexServer) -> AsyncIterator[Channel]:
    ch = Channel("127.0.0.1", index_server.port, codec=LedgerCodec())
    try:
        yield ch
    finally:
        ch.close()


@pytest.fixture
def stub(channel: Channel) -> IndexStub:
    return IndexStub(channel)
