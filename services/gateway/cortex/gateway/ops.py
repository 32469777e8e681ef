"""Operational endpoints: liveness, readiness, metrics, the model list."""

from __future__ import annotations

import time

from cortex.gateway.http import send_bytes, send_json
from cortex.gateway.metrics import CONTENT_TYPE
from cortex.gateway.pool import Health
from cortex.gateway.runtime import Gateway, Readiness
from cortex.gateway.types import Send

__all__ = ["OpsHandler"]


class OpsHandler:
    def __init__(self, gateway: Gateway) -> None:
        self.gw = gateway
        self._created = int(time.time())

    async def live(self, send: Send) -> None:
        await send_json(send, 200, {"status": "live"})

    async def ready(self, send: Send) -> None:
        """200 while some worker is routable (``status`` says ``degraded`` and why), 503
        otherwise."""
        state, reasons = self.gw.readiness()
        workers = list(self.gw.pool)
        index, replica = self.gw.index, self.gw.replica
        watcher = self.gw.watcher
        await send_json(send, 503 if state is Readiness.UNAVAILABLE else 200, {
            "status": state.value,
            "degraded": [r.value for r in reasons],
            "workers": {
                "total": len(workers),
                "healthy": sum(1 for w in workers if w.health is Health.HEALTHY),
                "routable": sum(1 for w in workers if w.routable()),
            },
            "index": ("not_configured" if index is None
                      else "available" if index.available else "unavailable"),
            "replica": ("not_configured" if replica is None else replica.replica.state.value
                        if replica.usable else "unusable"),
            "registry": watcher.health.value if watcher else "unknown",
        })

    async def metrics(self, send: Send) -> None:
        self.gw.readiness()  # refresh the readiness gauges
        await send_bytes(send, 200, self.gw.metrics.render(), CONTENT_TYPE.encode())

    async def models(self, send: Send) -> None:
        """Models with registered workers that this gateway is configured to serve, then
        their LoRA adapters (configured, or listed by a worker) with the model as
        ``parent``, as the engines list them."""
        config = self.gw.config
        served = [name for name in self.gw.pool.models() if config.model(name) is not None]
        cards: list[dict[str, object]] = [
            {"id": name, "object": "model", "created": self._created, "owned_by": "cortex"}
            for name in served]
        for name in served:
            model = config.model(name)
            assert model is not None
            learned = {a for w in self.gw.pool.candidates(name) for a in w.adapters}
            cards.extend({"id": adapter, "object": "model", "created": self._created,
                          "owned_by": "cortex", "parent": name}
                         for adapter in sorted(set(model.adapters) | learned))
        await send_json(send, 200, {"object": "list", "data": cards})
