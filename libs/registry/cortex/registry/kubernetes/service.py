"""``DiscoveryService``: the discovery with its Redis registry, API session and HTTP endpoint
(``/metrics``, ``/health/live``, ``/health/ready``: ready once the pods were listed and the
last reconciliation reached the registry)."""

from __future__ import annotations

import contextlib
from types import TracebackType

import aiohttp
from aiohttp import web

from cortex.edge.http import start_ops_http
from cortex.registry.kubernetes.api import PodApi, ssl_context
from cortex.registry.kubernetes.config import DiscoveryConfig
from cortex.registry.kubernetes.discovery import PodDiscovery
from cortex.registry.kubernetes.metrics import DiscoveryMetrics
from cortex.registry.redis_registry import RedisRegistry

__all__ = ["DiscoveryService"]


class DiscoveryService:
    """Use as ``async with DiscoveryService(config) as service:``."""

    def __init__(self, config: DiscoveryConfig) -> None:
        self.config = config
        self.metrics = DiscoveryMetrics()
        self.metrics_port: int | None = None
        self.discovery: PodDiscovery | None = None
        self._stack = contextlib.AsyncExitStack()

    def __repr__(self) -> str:
        return f"DiscoveryService({self.discovery!r}, metrics_port={self.metrics_port})"

    async def __aenter__(self) -> DiscoveryService:
        c = self.config
        try:
            session = await self._stack.enter_async_context(aiohttp.ClientSession())
            registry = await self._stack.enter_async_context(RedisRegistry(
                c.redis_url, default_ttl_s=c.lease_ttl_s, namespace=c.registry_namespace))
            api = PodApi(session, c.api_url, c.namespace, c.selector, token_file=c.token_file,
                         tls=ssl_context(c.ca_file), watch_timeout_s=c.watch_timeout_s)
            self.discovery = await self._stack.enter_async_context(
                PodDiscovery(api, registry, c, self.metrics))
            if c.metrics_port is not None:
                await self._serve_http(c.metrics_host, c.metrics_port)
        except BaseException:
            await self._stack.aclose()
            raise
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self._stack.aclose()

    async def _serve_http(self, host: str, port: int) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/health/live", self._live)
        app.router.add_get("/health/ready", self._ready)
        runner, self.metrics_port = await start_ops_http(app, host, port)
        self._stack.push_async_callback(runner.cleanup)

    async def _metrics(self, _request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(),
                            content_type="text/plain", charset="utf-8")

    async def _live(self, _request: web.Request) -> web.Response:
        return web.json_response({"status": "live"})

    async def _ready(self, _request: web.Request) -> web.Response:
        d = self.discovery
        ready = d is not None and d.ready
        body = {"status": "ready" if ready else "not ready",
                "listed": d is not None and d.listed,
                "reconciled": d is not None and d.reconciled}
        return web.json_response(body, status=200 if ready else 503)
