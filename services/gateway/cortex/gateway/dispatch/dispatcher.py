"""Dispatch: run a routing decision against workers, up to the first byte.

The one seam between routing and HTTP. A regular decision runs on one worker per attempt;
a prefill/decode plan (``routed.pd``) goes to
:class:`~cortex.gateway.dispatch.pd.dispatcher.PairDispatcher`, which opens a pair and returns
the decode leg as the :class:`Opened` response, leaving streaming untouched.

Failures before the first byte — connection refused, a retryable status, no first byte
within the model's first-byte timeout (:class:`~cortex.gateway.config.gateway.Timeouts`), a stream
that ends before its first chunk — count against the worker's breaker and move the request
to the next worker of the decision's ranking (at most ``max_attempts`` tries in all), and
its predicted blocks with it (:class:`~cortex.gateway.routing.router.Placement`); a worker that
refuses the request (another non-200 status) loses them too. When every attempt was
answered 429 or 503 (busy), the client gets that status with ``Retry-After``, not a 502.
A worker's in-flight count is held from the attempt until :meth:`Opened.close`, i.e. until
its response stream ended; before the first attempt the routing decision's pending count
stands in for it.

Which worker each attempt goes to and what the failures add up to is the pure
:class:`~cortex.gateway.dispatch.plan.AttemptPlan`; one attempt's I/O is
:func:`~cortex.gateway.attempt.attempt`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping

from cortex.gateway.config.gateway import PDConfig, Timeouts, UpstreamConfig
from cortex.gateway.dispatch.attempt import Opened, ProgressWatch, attempt
from cortex.gateway.dispatch.pd.dispatcher import PairDispatcher
from cortex.gateway.dispatch.plan import AttemptPlan
from cortex.gateway.errors import ErrorCode, UpstreamError
from cortex.gateway.fleet.pool import WorkerPool
from cortex.gateway.http.messages import json_dumps
from cortex.gateway.metrics import GatewayMetrics
from cortex.gateway.request.payload import InferencePath, InferenceRequest
from cortex.gateway.routing.router import Routed, Router, uncached
from cortex.gateway.upstream.client import FailureKind, Upstream, UpstreamFailure
from cortex.hashing import Engine

__all__ = ["Dispatcher", "upstream_body"]

log = logging.getLogger(__name__)


def upstream_body(req: InferenceRequest, raw: bytes) -> bytes:
    """The body to send: the client's bytes, or with ``stream_options.include_usage`` set
    when the gateway needs the usage chunk the client did not ask for, and, for an SGLang
    model addressed by a LoRA adapter's name, ``lora_path`` naming it (SGLang's OpenAI
    server takes the adapter from ``lora_path``; ``model`` it only echoes). A body whose
    media parts got identifiers (``uuid``) is sent as re-serialized."""
    if req.prompt.stamped:
        raw = json_dumps(req.body)
    if (req.adapter is not None and req.model.engine is Engine.SGLANG
            and "lora_path" not in req.body):
        body = {**req.body, "lora_path": req.adapter}
        if req.stream and not req.wants_usage and req.endpoint is not InferencePath.GENERATE:
            body["stream_options"] = {**(body.get("stream_options") or {}),
                                      "include_usage": True}
        return json_dumps(body)
    if not req.stream or req.wants_usage or req.endpoint is InferencePath.GENERATE:
        return raw
    if "stream_options" not in req.body:
        # splice instead of re-serializing a large body: the body is a non-empty object
        end = raw.rstrip()
        if end.endswith(b"}"):
            return end[:-1] + b',"stream_options":{"include_usage":true}}'
    body = dict(req.body)
    options = dict(body.get("stream_options") or {})
    options["include_usage"] = True
    body["stream_options"] = options
    return json_dumps(body)


class Dispatcher:
    """Single-worker dispatch with bounded retries before the first byte; PD plans go to
    its :class:`~cortex.gateway.dispatch.pd.dispatcher.PairDispatcher` (``pairs``), which
    falls back to :meth:`open_fallback`."""

    def __init__(
        self,
        pool: WorkerPool,
        upstream: Upstream,
        router: Router,
        config: UpstreamConfig,
        metrics: GatewayMetrics,
        pd: PDConfig | None = None,
    ) -> None:
        self.pool = pool
        self.upstream = upstream
        self.router = router
        self.config = config
        self.metrics = metrics
        self.watch = ProgressWatch(config.wedge_after_s, config.wedge_probe_timeout_s)
        self.pairs = PairDispatcher(pool, upstream, metrics, pd or PDConfig(),
                                    retry_statuses=config.retry_statuses,
                                    commit=router.commit, fallback=self.open_fallback,
                                    watch=self.watch)

    async def open(self, req: InferenceRequest, routed: Routed, body: bytes, request_id: str,
                   trace: Mapping[str, str] | None = None) -> Opened:
        """Open the request on a worker (or a prefill/decode pair) up to its first byte;
        ``trace``: the W3C trace-context headers to send along.

        Raises :class:`UpstreamError` (502/504) when every attempt failed, and
        :class:`ServiceUnavailable` when no ranked worker is routable any more. The caller's
        deadline (``asyncio.timeout``) bounds the whole loop.
        """
        routed.placement.dispatched()  # the attempts' in-flight slots count it from here
        if routed.pd is not None:
            return await self.pairs.open(req, routed, body, request_id, trace)
        return await self.open_regular(req, routed, body, request_id, trace)

    async def open_regular(self, req: InferenceRequest, routed: Routed, body: bytes,
                           request_id: str, trace: Mapping[str, str] | None = None) -> Opened:
        """Send to ``routed.decision``'s workers in order until one answers; the placement
        (predicted blocks) follows the attempts."""
        headers = {"Content-Type": "application/json", "X-Request-Id": request_id,
                   **(trace or {})}
        path = req.endpoint.value
        mode = routed.decision.mode.value
        timeouts = Timeouts.of(req.model, self.config)
        first_byte_s = timeouts.first_byte_s if req.stream else timeouts.response_s
        plan = AttemptPlan(routed.decision.ranked, self.pool.get, self.config.max_attempts,
                           routed.placement)
        while (step := plan.next()) is not None:
            worker, scored = step
            reason = plan.retry_reason
            if reason is not None:
                self.metrics.retries.labels(reason=reason).inc()
            opened = await attempt(self.upstream, self.metrics, worker, path=path, body=body,
                                   headers=headers, stream=req.stream, attempts=plan.attempts,
                                   mode=mode,
                                   prefill_tokens=uncached(routed.prompt_tokens, scored),
                                   first_byte_s=first_byte_s,
                                   retry_statuses=self.config.retry_statuses,
                                   watch=self.watch)
            if isinstance(opened, Opened):
                plan.answered(opened.response.status)
                opened.hit_tokens = routed.credited_tokens(worker.id)
                return opened
            if opened.kind is FailureKind.TOO_LARGE:  # any worker would answer the same
                raise UpstreamError("the worker's answer is larger than the gateway relays",
                                    code=ErrorCode.UPSTREAM_TOO_LARGE)
            plan.failed(opened)
            log.info("attempt failed worker=%s request_id=%s: %s", worker.id, request_id, opened,
                     extra={"worker": worker.id, "request_id": request_id})
        raise plan.verdict()

    async def open_fallback(self, req: InferenceRequest, routed: Routed, body: bytes,
                            request_id: str) -> Opened:
        """A disaggregated request run cold on the model's regular workers (its pairs
        failed): placed anew on the fallback ranking."""
        assert routed.pd is not None and routed.pd.fallback is not None
        fallback = routed.pd.fallback
        cold = dataclasses.replace(routed, decision=fallback, pd=None,
                                   placement=self.router.placement(routed.keys,
                                                                   routed.keysets))
        opened = await self.open_regular(req, cold, body, request_id)
        opened.decision = fallback
        return opened

    def failed_midstream(self, opened: Opened, failure: UpstreamFailure) -> None:
        """The worker broke after the first byte: count it against the worker."""
        opened.worker.breaker.on_failure()
        self.metrics.worker(self.metrics.upstream_errors, opened.worker.id,
                            failure.kind.value).inc()

    def __repr__(self) -> str:
        return f"Dispatcher(max_attempts={self.config.max_attempts})"
