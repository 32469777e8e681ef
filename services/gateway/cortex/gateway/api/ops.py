"""Operational endpoints: liveness, readiness, metrics, the model list."""

from __future__ import annotations

import time
from typing import Any

from cortex.gateway.errors import ClientError, ErrorCode
from cortex.gateway.fleet.pool import Health
from cortex.gateway.http.asgi import Send
from cortex.gateway.http.messages import send_bytes, send_json
from cortex.gateway.metrics import CONTENT_TYPE
from cortex.gateway.runtime import Runtime
from cortex.ledger import cores

__all__ = ["OpsHandler"]


class OpsHandler:
    def __init__(self, gateway: Runtime) -> None:
        self.gw = gateway
        self._created = int(time.time())

    async def health(self, send: Send) -> None:
        """``GET /health`` (what vLLM, SGLang and their routers serve; load testers probe
        it): 200 while this process can serve, like readiness."""
        await self.ready(send)

    async def live(self, send: Send) -> None:
        await send_json(send, 200, {"status": "live"})

    async def ready(self, send: Send) -> None:
        """Readiness: 200 while this process serves (started, not draining), 503 once it
        drains (SIGTERM). The fleet's state is in the body, not the status code: a
        shared worker outage must not take every gateway out of its load balancer
        (clients then get a JSON 503 instead of a refused connection). ``status``: the
        fleet's state (``ready``, ``degraded`` and why, ``unavailable``: no worker
        routable) or ``draining``."""
        state, reasons = self.gw.readiness()
        workers = list(self.gw.pool)
        index, replica = self.gw.index, self.gw.replica
        watcher = self.gw.watcher
        draining = self.gw.draining
        await send_json(send, 503 if draining else 200, {
            "status": "draining" if draining else state.value,
            "fleet": state.value,
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
            "ledger_core": cores.active().value,
            "registry": watcher.health.value if watcher else "unknown",
        })

    async def metrics(self, send: Send) -> None:
        self.gw.readiness()  # refresh the readiness gauges
        await send_bytes(send, 200, self.gw.metrics.render(), CONTENT_TYPE.encode())

    def _listed(self) -> list[str]:
        """Served models with registered workers (or a fixed upstream), sorted."""
        registered = set(self.gw.pool.models())
        return sorted(m.name for m in self.gw.config.models
                      if m.name in registered or m.upstream_url is not None)

    def _adapters(self, name: str) -> list[str]:
        """The LoRA adapters of a served model: configured, or listed by one of its workers."""
        model = self.gw.config.model(name)
        assert model is not None
        learned = {a for w in self.gw.pool.candidates(name) for a in w.adapters}
        return sorted(set(model.adapters) | learned)

    def _cards(self) -> dict[str, dict[str, Any]]:
        """Every listed model, then its adapters (with the model as ``parent``), by id."""
        cards: dict[str, dict[str, Any]] = {}
        for name in self._listed():
            cards[name] = self._entry(name)
            for adapter in self._adapters(name):
                cards.setdefault(adapter, self._entry(name, adapter))
        return cards

    def _entry(self, name: str, adapter: str | None = None) -> dict[str, Any]:
        """One model (or one of its adapters) as vLLM describes it (``max_model_len``: the
        context length in tokens, configured or learned from the engines; ``None`` while
        unknown)."""
        model = self.gw.config.model(name)
        assert model is not None
        return {"id": adapter or name, "object": "model", "created": self._created,
                "owned_by": "cortex", "root": adapter or model.hash_model or name,
                "parent": name if adapter else None,
                "max_model_len": self.gw.limits(model).context_tokens}

    async def models(self, send: Send) -> None:
        """Models with registered workers (or a fixed upstream) that this gateway is
        configured to serve, each followed by its LoRA adapters, as the engines list them."""
        await send_json(send, 200, {"object": "list", "data": list(self._cards().values())})

    async def model(self, send: Send, model_id: str) -> None:
        """``GET /v1/models/{id}``: that model or adapter, or 404 ``model_not_found``."""
        card = self._cards().get(model_id)
        if card is None:
            raise ClientError(f"the model {model_id!r} does not exist",
                              code=ErrorCode.MODEL_NOT_FOUND, status=404)
        await send_json(send, 200, card)
