"""The admin API, behind ``Authorization: Bearer <server.admin_token>``.

* ``GET /admin/workers`` — every worker in the pool with health, breaker, load and ledger;
* ``POST /admin/workers`` — register a worker (a registry spec object), ``201``; clears
  its tombstone if it had one. A body without ``engine`` or ``model`` (``{"url": ...}``
  alone, or with some fields) is completed from the worker's own endpoints (discovery;
  given fields win), and a field neither supplied is a 400 naming it;
* ``DELETE /admin/workers/{id}[?for_s=S][&tombstone=false]`` — remove it for good: its lease
  goes and a tombstone (permanent, or for ``S`` seconds) stops every gateway from bringing
  it back; ``tombstone=false`` only drops the lease (a reachable worker then returns);
* ``POST /admin/explain`` — the routing decision for a request body, without sending it.
"""

from __future__ import annotations

import hmac
import time
from dataclasses import astuple
from typing import Any
from urllib.parse import urlsplit

from cortex.gateway.errors import ClientError, ErrorCode, GatewayError, ServiceUnavailable
from cortex.gateway.fleet.pool import WorkerState
from cortex.gateway.http.asgi import Send
from cortex.gateway.http.messages import Request, send_json
from cortex.gateway.request.payload import InferencePath, Unmodelled, parse_body
from cortex.gateway.routing.placement import session_of
from cortex.gateway.routing.scoring import PairDecision, PDMode, reuse_of
from cortex.gateway.runtime import Runtime
from cortex.registry import RegistryUnavailable, SpecError, WorkerSpec, discover

__all__ = ["AdminHandler"]

_ENDPOINTS = {"chat": InferencePath.CHAT, "completions": InferencePath.COMPLETIONS,
              "generate": InferencePath.GENERATE, "messages": InferencePath.MESSAGES,
              "responses": InferencePath.RESPONSES}


def _worker_json(w: WorkerState, now: float, stale_after_s: float) -> dict[str, Any]:
    load = w.fresh_engine_load(now, stale_after_s)
    return {
        "id": w.id,
        "url": w.spec.url,
        "engine": w.spec.engine.value,
        "role": w.spec.role.value,
        "model": w.spec.model,
        "health": w.health.value,
        "last_probe_error": w.last_probe_error,
        "breaker": w.breaker.state.value,
        "routable": w.routable(),
        "inflight": w.inflight,
        "prefilling_tokens": w.prefilling,
        "engine_running": load.running if load else None,
        "engine_waiting": load.waiting if load else None,
        "ledger": w.ledger.label,
        "spec": w.spec.to_dict(),
    }


def _seconds(text: str | None, name: str) -> float | None:
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise ClientError(f"'{name}' must be a positive number of seconds", param=name)
    return value


def _flag(text: str, name: str) -> bool:
    if text.lower() not in ("true", "false", "1", "0"):
        raise ClientError(f"'{name}' must be true or false", param=name)
    return text.lower() in ("true", "1")


class AdminHandler:
    def __init__(self, gateway: Runtime) -> None:
        self.gw = gateway
        self._token = (gateway.config.server.admin_token or "").encode()

    def _authorize(self, request: Request) -> None:
        if not self._token:
            raise GatewayError("the admin API is disabled (no admin token configured)",
                               code=ErrorCode.ADMIN_DISABLED, status=403)
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(),
                                                                 self._token):
            raise GatewayError("missing or wrong admin bearer token",
                               code=ErrorCode.UNAUTHORIZED, status=401)

    async def __call__(self, request: Request, send: Send) -> None:
        self._authorize(request)
        path, method = request.path, request.method
        if path == "/admin/workers" and method == "GET":
            await self.list_workers(send)
        elif path == "/admin/workers" and method == "POST":
            await self.add_worker(request, send)
        elif path.startswith("/admin/workers/") and method == "DELETE":
            await self.remove_worker(path.removeprefix("/admin/workers/"), request.query_params,
                                     send)
        elif path == "/admin/explain" and method == "POST":
            await self.explain(request, send)
        elif path == "/admin/models" and method == "GET":
            await self.list_models(send)
        elif (path in ("/admin/workers", "/admin/explain", "/admin/models")
              or path.startswith("/admin/workers/")):
            raise GatewayError(f"method {method} not allowed here",
                               code=ErrorCode.METHOD_NOT_ALLOWED, status=405)
        else:
            raise GatewayError("no such admin endpoint", code=ErrorCode.NOT_FOUND, status=404)

    async def list_workers(self, send: Send) -> None:
        now = time.monotonic()
        stale = self.gw.config.routing.load_stale_after_s
        watcher = self.gw.watcher
        await send_json(send, 200, {
            "registry": watcher.health.value if watcher else "unknown",
            "workers": [_worker_json(w, now, stale) for w in self.gw.pool],
        })

    async def list_models(self, send: Send) -> None:
        """Each served model's tokenizer: its source, the encoder and why it was chosen, and
        how the segment cache splits prompts."""
        models = []
        for name, tok in sorted(self.gw.tokenizers.items()):
            models.append({"model": name, "tokenizer": tok.chat.source,
                           "encoder": tok.encoder.name, "encoder_reason": tok.encoder.reason,
                           "segmented": tok.segmented, "chunk_chars": tok.chunk_chars})
        await send_json(send, 200, {"models": models})

    async def add_worker(self, request: Request, send: Send) -> None:
        body = parse_body(await request.body(self.gw.config.server.max_body_bytes))
        addresses = self.gw.addresses
        try:
            if ("engine" in body and "model" in body) or not isinstance(body.get("url"), str):
                spec = WorkerSpec.from_dict(body)
            else:  # checked before the discovery connects to it
                addresses.check_host(urlsplit(body["url"]).hostname or "")
                found = await discover(body["url"], timeout_s=self.gw.config.discovery.timeout_s)
                spec = found.spec({k: v for k, v in body.items() if k != "url"},
                                  worker_id=body.get("id"))
            addresses.check(spec)
        except SpecError as exc:  # DiscoveryError too: it names the missing fields
            raise ClientError(f"invalid worker spec: {exc}") from None
        try:
            await self.gw.registry.register(spec, self.gw.config.registry.lease_ttl_s)
        except RegistryUnavailable:
            raise ServiceUnavailable("the worker registry is unreachable",
                                     code=ErrorCode.REGISTRY_UNAVAILABLE) from None
        if self.gw.watcher is not None:
            self.gw.watcher.poke()
        await send_json(send, 201, {"worker": spec.to_dict()})

    async def remove_worker(self, worker_id: str, query: dict[str, str], send: Send) -> None:
        """404 for an id neither registered nor known to this gateway (nothing written)."""
        gw = self.gw
        for_s = _seconds(query.get("for_s"), "for_s")
        tombstone = _flag(query.get("tombstone", "true"), "tombstone")
        known = gw.pool.get(worker_id) is not None or worker_id in gw.pool.remembered
        try:
            if not known and await gw.registry.get(worker_id) is None:
                raise GatewayError(f"no worker '{worker_id}'", code=ErrorCode.WORKER_NOT_FOUND,
                                   status=404)
            if tombstone:
                had_lease = await gw.registry.remove(worker_id, tombstone_ttl_s=for_s,
                                                     reason="admin API")
            else:
                had_lease = await gw.registry.deregister(worker_id)
        except RegistryUnavailable:
            raise ServiceUnavailable("the worker registry is unreachable",
                                     code=ErrorCode.REGISTRY_UNAVAILABLE) from None
        if tombstone:
            gw.pool.mark_tombstoned(worker_id)  # out of this replica's pool at once
            gw.sync_pool()
        if gw.watcher is not None:
            gw.watcher.poke()
        await send_json(send, 200, {"removed": worker_id, "had_lease": had_lease,
                                    "tombstone": {"ttl_s": for_s} if tombstone else None})

    async def explain(self, request: Request, send: Send) -> None:
        """Body: the inference request; endpoint from
        ``?endpoint=chat|completions|generate|messages|responses``, else inferred
        (``messages`` → chat, ``prompt`` → completions, else generate)."""
        body = parse_body(await request.body(self.gw.config.server.max_body_bytes))
        name = request.query_params.get("endpoint")
        if name is not None:
            if name not in _ENDPOINTS:
                raise ClientError(f"endpoint must be one of {sorted(_ENDPOINTS)}",
                                  param="endpoint")
            endpoint = _ENDPOINTS[name]
        else:
            endpoint = (InferencePath.CHAT if "messages" in body
                        else InferencePath.COMPLETIONS if "prompt" in body
                        else InferencePath.GENERATE)
        try:
            req = self.gw.admit(endpoint, body)
        except Unmodelled as exc:
            raise ClientError(f"relayed by load, not routed on tokens: {exc}") from None
        router = self.gw.router
        deadline = time.monotonic() + self.gw.config.upstream.request_timeout_s
        session = session_of(request.headers, body, self.gw.config.routing.sessions)
        routed = await router.route(req, deadline, record=False, session=session)
        decision = routed.decision
        t = routed.timings
        explained: dict[str, Any] = {
            "model": req.model.name,
            "endpoint": endpoint.value,
            "prompt_tokens": routed.prompt_tokens,
            "block_size": req.model.block_size,
            "block_keys": len(routed.keys),
            "query_blocks": routed.query_blocks,
            "match_source": routed.match_source,
            "index_version": routed.index_version,
            "decision": {
                "mode": decision.mode.value,
                "reason": decision.reason.value,
                "worker": (decision.chosen.worker_id if routed.pd is None
                           else routed.pd.decode.chosen.worker_id),
                "hit_tokens": decision.hit_tokens,
            },
            "reuse": dict(zip(("available", "captured", "given_up"),
                              astuple(reuse_of(decision, decision.chosen.worker_id))[:3],
                              strict=True)),
            "candidates": [
                {
                    "worker": s.worker_id,
                    "rank": rank,
                    "ledger": s.candidate.ledger.label,
                    "index_tokens": s.candidate.index_tokens,
                    "predicted_tokens": s.candidate.predicted_tokens,
                    "host_tokens": s.candidate.host_tokens,
                    "disk_tokens": s.candidate.disk_tokens,
                    "matched_tokens": s.credited_tokens,
                    "credit": s.credit,
                    "credit_note": s.note or None,
                    "active": s.candidate.active,
                    "inflight": s.candidate.inflight,
                    "prefilling_tokens": s.candidate.prefilling,
                    "engine_running": s.candidate.engine_running,
                    "engine_waiting": s.candidate.engine_waiting,
                    "high_watermark": s.candidate.high_watermark,
                    "session": s.candidate.session,
                    "session_tokens": s.candidate.session_tokens,
                    "live_sessions": s.candidate.sessions,
                    "kv_pressure": s.candidate.kv_pressure,
                    "score": s.score,
                }
                for rank, s in enumerate(decision.ranked)
            ],
            "timings_ms": {"tokenize": t.tokenize * 1e3, "hash": t.hash * 1e3,
                           "match": t.match * 1e3, "score": t.score * 1e3,
                           "total": t.total * 1e3, "cpu": t.cpu * 1e3},
        }
        if routed.pd is not None:
            explained["pd"] = self._explain_pd(routed.pd)
        await send_json(send, 200, explained)

    def _explain_pd(self, plan: PairDecision) -> dict[str, Any]:
        """The pair a disaggregated request would get (``candidates`` are the prefill pool,
        ranked by cache affinity; the decode pool is ranked by load only)."""
        decode = plan.decode.chosen
        local = plan.local_prefill(decode, self.gw.config.pd)
        fallback = plan.fallback
        return {
            "engine": plan.engine.value,
            "mode": (PDMode.LOCAL_PREFILL if local else PDMode.DISAGGREGATED).value,
            "local_prefill_reason": local.value if local else None,
            "prefill_worker": decode.worker_id if local else plan.prefill.chosen.worker_id,
            "decode_worker": decode.worker_id,
            "hit_tokens": (PairDecision.held_tokens(decode) if local
                           else plan.prefill.hit_tokens),
            "sequences": plan.sequences,
            "decode_decision": {"mode": plan.decode.mode.value,
                                "reason": plan.decode.reason.value},
            "decode_candidates": [
                {"worker": s.worker_id, "rank": rank, "active": s.candidate.active,
                 "inflight": s.candidate.inflight, "engine_running": s.candidate.engine_running,
                 "engine_waiting": s.candidate.engine_waiting,
                 "held_tokens": PairDecision.held_tokens(s), "score": s.score}
                for rank, s in enumerate(plan.decode.ranked)
            ],
            "fallback_worker": fallback.chosen.worker_id if fallback else None,
        }
