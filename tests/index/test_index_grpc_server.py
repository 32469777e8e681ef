"""GrpcServer and IndexServer.stop close the connections they accepted: a stopped index
answers nothing, even on connections opened before it stopped, and leaves no open socket
behind (grpclib's own Server.close() keeps serving them until each client hangs up)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

import pytest
from grpclib.client import Channel
from grpclib.exceptions import StreamTerminatedError
from grpclib.health.service import Health

from cortex.index.config import IndexConfig
from cortex.index.server import IndexServer
from cortex.ledger.client import IndexStub
from cortex.ledger.codec import pb
from cortex.ledger.grpc_server import GrpcServer
from cortex.testing import wait_until_async

pytestmark = pytest.mark.timeout(30)
TIMEOUT = 5.0  # s


async def read_to_eof(reader: asyncio.StreamReader) -> bytes:
    """Everything until the peer closes (bounded: a connection left open fails the test)."""
    return await asyncio.wait_for(reader.read(), TIMEOUT)


async def test_stopped_index_closes_connections_opened_before(
    make_config: Callable[..., IndexConfig],
) -> None:
    server = IndexServer(make_config(metrics_port=None))
    await server.start()
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    channel = Channel("127.0.0.1", server.port)
    try:
        stub = IndexStub(channel, timeout=TIMEOUT)
        before = await stub.stats(pb.StatsRequest())  # the channel's connection is open
        await server.stop()
        # a connection that never spoke is closed too (the server waits for a client's first
        # bytes to choose HTTP/2 or frames, so it sent nothing)
        assert await read_to_eof(reader) == b""
        # the channel's connection is gone: it reconnects, to a port nobody listens on
        with pytest.raises((ConnectionError, StreamTerminatedError)):
            await stub.stats(pb.StatsRequest())
    finally:
        writer.close()
        await writer.wait_closed()
        channel.close()
        await server.stop()
    assert before.index_id == server.index_id


async def test_close_connections_aborts_what_does_not_flush() -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = GrpcServer([Health()])
    await server.start(sock=sock)
    clients = [await asyncio.open_connection(*sock.getsockname()) for _ in range(3)]
    try:
        await wait_until_async(lambda: server.connections == 3, timeout=TIMEOUT,
                               what="3 accepted connections")
        assert repr(server) == "GrpcServer(connections=3)"
        await server.close_connections(flush_s=0)  # no time to flush: every one aborted
        assert server.connections == 0
        for reader, _ in clients:
            await read_to_eof(reader)
    finally:
        for _, writer in clients:
            writer.close()
            await writer.wait_closed()
        await server.shutdown()
    assert server.connections == 0
