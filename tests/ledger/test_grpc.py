"""The transport-level message bound of LedgerCodec (cortex.ledger.grpc) on a real grpclib
server on 127.0.0.1: a message over the bound is RESOURCE_EXHAUSTED from its length prefix,
its bytes never decoded, and the connection serves the next call."""

from __future__ import annotations

from typing import Any

import pytest
from grpclib.client import Channel
from grpclib.const import Cardinality, Status
from grpclib.exceptions import GRPCError
from grpclib.health.service import Health
from grpclib.health.v1.health_pb2 import HealthCheckRequest, HealthCheckResponse
from grpclib.server import Server

from cortex.ledger.grpc import LedgerCodec

pytestmark = pytest.mark.timeout(30)

CHECK = "/grpc.health.v1.Health/Check"


class CountingCodec(LedgerCodec):
    def __init__(self, max_message_bytes: int) -> None:
        super().__init__(max_message_bytes)
        self.decoded: list[int] = []

    def decode(self, data: bytes, message_type: Any) -> Any:
        self.decoded.append(len(data))
        return super().decode(data, message_type)


async def test_a_message_over_the_bound_is_refused_before_it_is_read() -> None:
    codec = CountingCodec(1 << 20)
    server = Server([Health()], codec=codec)
    await server.start("127.0.0.1", 0)
    port = server._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        async with Channel("127.0.0.1", port, codec=LedgerCodec()) as channel:
            method = channel.request(CHECK, Cardinality.UNARY_UNARY, HealthCheckRequest,
                                     HealthCheckResponse)
            with pytest.raises(GRPCError) as refused:
                async with method as stream:
                    await stream.send_message(b"\x0a" * (4 << 20), end=True)
                    await stream.recv_message()
            assert refused.value.status is Status.RESOURCE_EXHAUSTED
            assert "exceeds 1048576" in (refused.value.message or "")
            assert all(size <= 1 << 20 for size in codec.decoded)
            async with channel.request(CHECK, Cardinality.UNARY_UNARY, HealthCheckRequest,
                                       HealthCheckResponse) as reply:
                await reply.send_message(HealthCheckRequest(), end=True)
                answer = await reply.recv_message()
            assert answer is not None and answer.status == HealthCheckResponse.SERVING
    finally:
        server.close()
        await server.wait_closed()
