"""The index process's runner: :class:`IndexServer` owns the ``cortex.index.v1.Index``
service (:class:`~cortex.index.service.IndexService`), the ``grpc.health.v1`` and
server-reflection services and the Prometheus endpoint (``async with IndexServer(config) as
srv``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from types import TracebackType

from aiohttp import web
from grpclib.health.check import ServiceStatus
from grpclib.health.service import Health
from grpclib.reflection.service import ServerReflection

from cortex.edge.http import bound_socket, start_ops_http
from cortex.index.config import IndexConfig
from cortex.index.metrics import CONTENT_TYPE, IndexMetrics
from cortex.index.prefix_index import PrefixIndex
from cortex.index.service import IndexService
from cortex.ledger import cores
from cortex.ledger.grpc import LedgerCodec, TokenCheck, read_token
from cortex.ledger.grpc_server import GrpcServer

__all__ = ["IndexServer", "IndexService"]

log = logging.getLogger(__name__)


class IndexServer:
    """An index process in a box: gRPC (Index + health), Prometheus, graceful stop.

    ``async with IndexServer(IndexConfig(host="127.0.0.1", port=0, metrics_port=None)) as
    srv:`` serves at ``srv.target`` until the block ends (then :meth:`stop`). ``core`` is the
    live :class:`PrefixIndex` (tests may inspect it; mutate it only through gRPC).
    """

    def __init__(self, config: IndexConfig | None = None) -> None:
        self.config = config or IndexConfig()
        self.index_id = uuid.uuid4().hex[:16]
        c = self.config
        self.core = PrefixIndex(
            memory_budget_bytes=c.memory_budget_bytes,
            low_watermark=c.low_watermark,
            max_query_blocks=c.max_query_blocks,
            max_query_tokens=c.max_query_tokens,
            changes_max_keys=c.changes_max_keys,
            changes_max_records=c.changes_max_records,
            resync_retry_s=c.resync_retry_s,
            max_tombstones=c.max_tombstones,
            ingest_grace_s=c.ingest_grace_s,
        )
        self.tokens = TokenCheck(read_token(c.peer_token_file) if c.peer_token_file else None,
                                 read_token(c.query_token_file) if c.query_token_file else None)
        self.metrics = IndexMetrics(lambda: self.core, lambda: self.tokens.refused)
        self._service: IndexService | None = None
        self._serving = ServiceStatus()
        self._grpc: GrpcServer | None = None
        self._http: web.AppRunner | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._port: int | None = None
        self._metrics_port: int | None = None
        self._stopped = asyncio.Event()

    def __repr__(self) -> str:
        state = "serving" if self._grpc is not None and not self._stopped.is_set() else "stopped"
        return (
            f"IndexServer({state}, target={self.config.host}:{self._port}, "
            f"metrics_port={self._metrics_port}, index_id={self.index_id})"
        )

    @property
    def port(self) -> int:
        """The bound gRPC port (after start)."""
        if self._port is None:
            raise RuntimeError("IndexServer is not started")
        return self._port

    @property
    def target(self) -> str:
        """``host:port`` for a client channel."""
        host = self.config.host
        if host in ("0.0.0.0", "::", ""):
            host = "127.0.0.1"
        return f"{host}:{self.port}"

    @property
    def metrics_port(self) -> int | None:
        """The bound metrics port, or None when disabled."""
        return self._metrics_port

    async def start(self) -> None:
        """Bind and serve. Raises ``OSError`` when a port is taken."""
        if self._grpc is not None:
            raise RuntimeError("IndexServer already started")
        c = self.config
        service = self._service = IndexService(self.core, c, self.metrics, self.index_id)
        health = Health({service: [self._serving]})
        server = GrpcServer(ServerReflection.extend([service, health]), codec=LedgerCodec(),
                            on_frames_call=self._frames_call)
        self.tokens.install(server)
        try:
            sock = bound_socket(c.host, c.port)
            self._port = sock.getsockname()[1]
            await server.start(sock=sock)
            self._grpc = server
            if c.metrics_port is not None:
                await self._start_metrics(c.metrics_host, c.metrics_port)
        except BaseException:
            await self._close_transports()
            raise
        self._watcher = asyncio.create_task(service.watch_ingests(), name="index-ingest-watch")
        self._serving.set(True)
        self.metrics.serving.set(1)
        log.info("index serving grpc=%s metrics=%s index_id=%s budget=%d ledger_core=%s",
                 self.target, self._metrics_port, self.index_id, c.memory_budget_bytes,
                 cores.active())

    def _frames_call(self, path: str) -> None:
        self.metrics.frames_calls.labels(method=path.rsplit("/", 1)[-1]).inc()

    async def _start_metrics(self, host: str, port: int) -> None:
        async def metrics(_: web.Request) -> web.Response:
            body = self.metrics.render()
            return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        self._http, self._metrics_port = await start_ops_http(app, host, port)

    async def stop(self, grace_s: float | None = None) -> None:
        """Drain and stop: health NOT_SERVING, streams end with UNAVAILABLE, in-flight
        calls get ``grace_s`` (default ``config.shutdown_grace_s``) seconds, then the rest
        is cancelled and every accepted connection closed (otherwise a stopped index would
        keep answering on connections opened before). Idempotent; completes its cleanup even
        when cancelled.
        """
        if self._stopped.is_set():
            return
        self._stopped.set()
        grace = self.config.shutdown_grace_s if grace_s is None else grace_s
        self._serving.set(False)
        self.metrics.serving.set(0)
        service = self._service
        try:
            if service is not None:
                service.drain()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(grace):  # not wait_for: see grpc_server
                        await service.wait_idle()
        finally:
            await self._close_transports()
        log.info("index stopped index_id=%s version=%d", self.index_id, self.core.version)

    async def _close_transports(self) -> None:
        watcher, self._watcher = self._watcher, None
        if watcher is not None:
            watcher.cancel()  # awaited last: a cancel of stop() must not skip the rest
        grpc, self._grpc = self._grpc, None
        http, self._http = self._http, None
        try:
            if grpc is not None:
                await grpc.shutdown(timeout_s=5.0)  # closes accepted connections too
        finally:
            try:
                if http is not None:
                    await http.cleanup()
            finally:
                if watcher is not None:
                    await asyncio.gather(watcher, return_exceptions=True)

    async def wait_stopped(self) -> None:
        """Until :meth:`stop` has been called."""
        await self._stopped.wait()

    async def __aenter__(self) -> IndexServer:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()
