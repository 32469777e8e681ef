"""``EppServer``: the endpoint picker on gRPC (grpclib), beside a running gateway.

Serves ``envoy.service.ext_proc.v3.ExternalProcessor/Process`` (Envoy's messages from
``xds-protos``; the handler table is written here because ``xds-protos`` ships grpcio stubs
only, and the gateway's event loop, like the index, speaks grpclib) and the gRPC health
service: ``""`` and ``liveness`` serve while the process does; ``readiness`` and
``envoy.service.ext_proc.v3.ExternalProcessor`` while the gateway can route.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from types import TracebackType
from typing import TypeAlias

from envoy.service.ext_proc.v3 import external_processor_pb2 as ext
from grpclib.const import Cardinality, Handler, Status
from grpclib.exceptions import GRPCError
from grpclib.health.v1.health_grpc import HealthBase
from grpclib.health.v1.health_pb2 import HealthCheckRequest, HealthCheckResponse
from grpclib.server import Stream

from cortex.gateway.epp.picker import PickerStream
from cortex.gateway.runtime import Readiness, Runtime
from cortex.ledger.grpc_server import GrpcServer

__all__ = ["PROCESS", "SERVICE", "EppServer"]

log = logging.getLogger(__name__)

SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
PROCESS = f"/{SERVICE}/Process"
_WATCH_INTERVAL_S = 1.0
_Status: TypeAlias = "HealthCheckResponse.ServingStatus.ValueType"


class ExternalProcessor:
    """One :class:`PickerStream` per ext_proc stream (one per HTTP request)."""

    def __init__(self, gateway: Runtime) -> None:
        self.gw = gateway

    async def process(self, stream: Stream[ext.ProcessingRequest, ext.ProcessingResponse]
                      ) -> None:
        picker = PickerStream(self.gw)
        self.gw.metrics.epp_streams.inc()
        try:
            async for request in stream:
                for reply in await picker.handle(request):
                    await stream.send_message(reply)
        finally:  # the stream ended or broke (Envoy gone, request reset): free its load
            picker.close()
            self.gw.metrics.epp_streams.dec()

    def __mapping__(self) -> dict[str, Handler]:
        return {PROCESS: Handler(self.process, Cardinality.STREAM_STREAM,
                                 ext.ProcessingRequest, ext.ProcessingResponse)}


class PickerHealth(HealthBase):
    """gRPC health by service name; unknown names are ``NOT_FOUND`` (the protocol's rule)."""

    def __init__(self, ready: Callable[[], bool]) -> None:
        self._ready = ready

    def status(self, service: str) -> _Status | None:
        if service in ("", "liveness"):
            return HealthCheckResponse.SERVING
        if service in ("readiness", SERVICE):
            return HealthCheckResponse.SERVING if self._ready() else \
                HealthCheckResponse.NOT_SERVING
        return None

    async def Check(self, stream: Stream[HealthCheckRequest, HealthCheckResponse]) -> None:
        request = await stream.recv_message()
        assert request is not None
        status = self.status(request.service)
        if status is None:
            raise GRPCError(Status.NOT_FOUND, f"unknown service {request.service!r}")
        await stream.send_message(HealthCheckResponse(status=status))

    async def Watch(self, stream: Stream[HealthCheckRequest, HealthCheckResponse]) -> None:
        request = await stream.recv_message()
        assert request is not None
        last: _Status | None = None
        while True:
            status = self.status(request.service)
            status = HealthCheckResponse.SERVICE_UNKNOWN if status is None else status
            if status != last:
                await stream.send_message(HealthCheckResponse(status=status))
                last = status
            await asyncio.sleep(_WATCH_INTERVAL_S)


class EppServer:
    """``async with EppServer(gateway, host, port) as epp:`` (port 0: a free port, see
    :attr:`port`); on exit, open streams and connections are closed."""

    def __init__(self, gateway: Runtime, host: str = "0.0.0.0", port: int = 9002) -> None:
        self.gw = gateway
        self.host = host
        self.port = port
        self._server: GrpcServer | None = None

    def __repr__(self) -> str:
        running = self._server is not None
        return f"EppServer(host={self.host!r}, port={self.port}, running={running})"

    def ready(self) -> bool:
        return self.gw.readiness()[0] is not Readiness.UNAVAILABLE

    async def __aenter__(self) -> EppServer:
        server = GrpcServer([ExternalProcessor(self.gw), PickerHealth(self.ready)])
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        # proto TCP, not 0: asyncio turns Nagle off only on accepted sockets of proto TCP,
        # and with Nagle each small reply waits ~40 ms for the client's delayed ACK
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.bind((self.host, self.port))
            sock.setblocking(False)
            self.port = sock.getsockname()[1]
            await server.start(sock=sock)
        except BaseException:
            sock.close()
            raise
        self._server = server
        log.info("endpoint picker (ext_proc) listening on %s:%d", self.host, self.port)
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        server, self._server = self._server, None
        if server is not None:
            await server.shutdown()  # also closes the connections Envoy holds open
