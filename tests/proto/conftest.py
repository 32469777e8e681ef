"""Fixtures of the contract tests: grpcio's service module built from the committed .proto,
and a real index on 127.0.0.1."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from cortex.index.config import IndexConfig
from cortex.index.server import IndexServer
from cortex.testing.grpcio_stubs import GrpcioStubs, load_grpcio_stubs


@pytest.fixture(scope="session")
def grpcio_modules(tmp_path_factory: pytest.TempPathFactory) -> GrpcioStubs:
    """grpcio's ``index_pb2_grpc`` over the project's ``index_pb2``, loaded once."""
    return load_grpcio_stubs(tmp_path_factory.mktemp("grpcio"))


@pytest.fixture
async def index_port() -> AsyncIterator[int]:
    """A real index on 127.0.0.1, on a port the OS picked, quick heartbeats."""
    config = IndexConfig(host="127.0.0.1", port=0, metrics_port=None,
                         changes_heartbeat_s=0.2, replica_heartbeat_s=0.2, resync_retry_s=0.0)
    async with IndexServer(config) as server:
        yield server.port
