"""Dispatch: run a routing decision against workers, up to the first byte.

The one seam between routing and HTTP. A regular decision runs on one worker per attempt;
a prefill/decode plan (``routed.pd``) goes to :class:`~cortex.gateway.disagg.PairDispatcher`,
which opens a pair and returns the decode leg as the :class:`Opened` response, leaving
streaming untouched.

Failures before the first byte — connection refused, a retryable status, no first byte
within the model's first-byte timeout (:class:`~cortex.gateway.config.Timeouts`), a stream
that ends before its first chunk — count against the worker's breaker and move the request
to the next worker of the decision's ranking (at most ``max_attempts`` tries in all), and
its predicted blocks with it (:class:`~cortex.gateway.router.Placement`); a worker that
refuses the request (another non-200 status) loses them too. When every attempt was
answered 429 or 503 (busy), the client gets that status with ``Retry-After``, not a 502.
A worker's in-flight count is held from the attempt until :meth:`Opened.close`, i.e. until
its response stream ended; before the first attempt the routing decision's pending count
stands in for it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from cortex.gateway.config import PDConfig, Timeouts, UpstreamConfig
from cortex.gateway.errors import ErrorCode, ServiceUnavailable, UpstreamError
from cortex.gateway.metrics import GatewayMetrics
from cortex.gateway.pairing import PDOutcome
from cortex.gateway.payload import Endpoint, InferenceRequest
from cortex.gateway.pool import WorkerPool, WorkerState
from cortex.gateway.router import Routed, Router, uncached
from cortex.gateway.scoring import Decision
from cortex.gateway.sse import EventRewrite
from cortex.gateway.upstream import FailureKind, UpstreamClient, UpstreamFailure, UpstreamResponse
from cortex.hashing import Engine

__all__ = ["BUSY_STATUSES", "Dispatcher", "Opened", "acquire_slot", "all_busy", "release_slot",
           "upstream_body"]

BUSY_STATUSES = (429, 503)
"""A worker answering these is busy, not broken: when every attempt got one, so does the
client (with ``Retry-After``)."""

log = logging.getLogger(__name__)


def upstream_body(req: InferenceRequest, raw: bytes) -> bytes:
    """The body to send: the client's bytes, or with ``stream_options.include_usage`` set
    when the gateway needs the usage chunk the client did not ask for, and, for an SGLang
    model addressed by a LoRA adapter's name, ``lora_path`` naming it (SGLang's OpenAI
    server takes the adapter from ``lora_path``; ``model`` it only echoes)."""
    if (req.adapter is not None and req.model.engine is Engine.SGLANG
            and "lora_path" not in req.body):
        body = {**req.body, "lora_path": req.adapter}
        if req.stream and not req.wants_usage and req.endpoint is not Endpoint.GENERATE:
            body["stream_options"] = {**(body.get("stream_options") or {}),
                                      "include_usage": True}
        return json.dumps(body, separators=(",", ":")).encode()
    if not req.stream or req.wants_usage or req.endpoint is Endpoint.GENERATE:
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
    return json.dumps(body, separators=(",", ":")).encode()


@dataclass(eq=False)
class Opened:
    """A worker answered: its response, the body bytes already read (the first chunk(s) of
    a stream, or the whole body otherwise) and the in-flight slot to release.

    ``hit_tokens``: prompt tokens predicted cached where the prompt was computed (the
    prefill worker of a pair). ``decision``: the ranking ``worker`` came from (``None``: the
    request's main decision). ``pd``: how a disaggregated model's request was served.
    ``rewrite``: applied to the answer's objects while streaming (PD usage / logprobs).
    ``on_close``: more cleanup (a pair's prefill leg still draining).
    """

    worker: WorkerState
    response: UpstreamResponse
    head: bytes
    attempts: int
    _metrics: GatewayMetrics = field(repr=False)
    _slot: int = field(repr=False)
    hit_tokens: int = 0
    decision: Decision | None = None
    pd: PDOutcome | None = None
    rewrite: EventRewrite | None = field(default=None, repr=False)
    on_close: Callable[[], None] | None = field(default=None, repr=False)
    _closed: bool = field(default=False, repr=False)

    def close(self) -> None:
        """Release the connection and the worker's in-flight slot (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self.response.close()
        release_slot(self.worker, self._metrics, self._slot)
        if self.on_close is not None:
            self.on_close()


def acquire_slot(worker: WorkerState, metrics: GatewayMetrics) -> int:
    """Count one more request open on ``worker``; returns the slot for :func:`release_slot`."""
    slot = worker.open_request()
    metrics.worker(metrics.worker_inflight, worker.id).set(worker.inflight)
    return slot


def release_slot(worker: WorkerState, metrics: GatewayMetrics, slot: int) -> None:
    """A request open on ``worker`` (``slot``: what :func:`acquire_slot` returned) ended."""
    worker.close_request(slot)
    metrics.worker(metrics.worker_inflight, worker.id).set(worker.inflight)


class Dispatcher:
    """Single-worker dispatch with bounded retries before the first byte; PD plans go to
    its :class:`~cortex.gateway.disagg.PairDispatcher` (``pairs``)."""

    def __init__(
        self,
        pool: WorkerPool,
        upstream: UpstreamClient,
        router: Router,
        config: UpstreamConfig,
        metrics: GatewayMetrics,
        pd: PDConfig | None = None,
    ) -> None:
        from cortex.gateway.disagg import PairDispatcher  # it builds on this module

        self.pool = pool
        self.upstream = upstream
        self.router = router
        self.config = config
        self.metrics = metrics
        self.pairs = PairDispatcher(self, pd or PDConfig())

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
        placement = routed.placement
        mode = routed.decision.mode.value
        timeouts = Timeouts.of(req.model, self.config)
        first_byte_s = timeouts.first_byte_s if req.stream else timeouts.response_s
        last: UpstreamFailure | None = None
        busy: list[UpstreamFailure] = []  # attempts answered 429 / 503
        attempts = 0
        for scored in routed.decision.ranked:
            if attempts >= self.config.max_attempts:
                break
            worker = self.pool.get(scored.worker_id)
            if worker is None or not worker.routable():
                continue
            if attempts:
                self.metrics.retries.labels(reason=last.kind.value if last else "unknown").inc()
            attempts += 1
            placement.move(worker.id)
            opened = await self._attempt(worker, path, body, headers, req.stream, attempts,
                                         mode, uncached(routed.prompt_tokens, scored),
                                         first_byte_s)
            if isinstance(opened, Opened):
                if opened.response.status != 200:
                    placement.withdraw()  # refused: the prompt is not computed there
                opened.hit_tokens = routed.credited_tokens(worker.id)
                return opened
            placement.withdraw()
            last = opened
            if opened.status in BUSY_STATUSES:
                busy.append(opened)
            log.info("attempt failed worker=%s request_id=%s: %s", worker.id, request_id, opened,
                     extra={"worker": worker.id, "request_id": request_id})
        if last is None:
            raise ServiceUnavailable("no available worker for this request")
        if len(busy) == attempts:
            raise all_busy([(f.status, f.retry_after_s) for f in busy])
        if last.kind is FailureKind.TIMEOUT:
            raise UpstreamError("the worker did not answer in time",
                                code=ErrorCode.UPSTREAM_TIMEOUT, status=504)
        raise UpstreamError("the worker failed to answer")

    async def _attempt(
        self,
        worker: WorkerState,
        path: str,
        body: bytes,
        headers: dict[str, str],
        stream: bool,
        attempts: int,
        mode: str,
        prefill_tokens: int,
        first_byte_s: float,
    ) -> Opened | UpstreamFailure:
        """One attempt up to its first byte, within ``first_byte_s`` seconds;
        ``prefill_tokens`` count on the worker's prefill queue
        (:attr:`WorkerState.prefilling`) until then."""
        breaker = worker.breaker
        breaker.on_attempt()
        slot = acquire_slot(worker, self.metrics)
        worker.prefilling += prefill_tokens
        response: UpstreamResponse | None = None
        sent = time.perf_counter()
        timer = asyncio.timeout(first_byte_s)
        try:
            try:
                async with timer:
                    response = await self.upstream.post(worker.spec.url.rstrip("/") + path,
                                                        body, headers, worker.spec)
                    head = await self._first_bytes(response, stream)
            except TimeoutError:
                if not timer.expired():
                    raise
                raise UpstreamFailure(FailureKind.TIMEOUT,
                                      f"no first byte in {first_byte_s}s") from None
        except UpstreamFailure as failure:
            if response is not None:
                response.close()
            release_slot(worker, self.metrics, slot)
            self.metrics.worker(self.metrics.upstream_errors, worker.id, failure.kind.value).inc()
            if failure.status == 429:
                breaker.on_abandon()  # busy, not broken
            else:
                breaker.on_failure()
            return failure
        except BaseException:
            # cancelled (client gone, deadline) or a bug: no verdict on the worker
            if response is not None:
                response.close()
            release_slot(worker, self.metrics, slot)
            breaker.on_abandon()
            raise
        finally:
            worker.prefilling -= prefill_tokens
        breaker.on_success()
        if response.status == 200:
            self.metrics.worker(self.metrics.upstream_ttfb, worker.id, mode).observe(
                time.perf_counter() - sent)
        return Opened(worker, response, head, attempts, self.metrics, slot)

    async def _first_bytes(self, response: UpstreamResponse, stream: bool) -> bytes:
        """The whole body, or a stream's first chunk; :class:`UpstreamFailure` for a
        retryable status or a stream that ends before any byte."""
        if response.status in self.config.retry_statuses:
            await response.read()
            raise UpstreamFailure(FailureKind.STATUS, f"status {response.status}",
                                  response.status, response.retry_after_s)
        if response.status != 200 or not stream:
            return await response.read()
        async for chunk in response.chunks():
            return chunk
        raise UpstreamFailure(FailureKind.DISCONNECT, "stream ended before any byte")

    def failed_midstream(self, opened: Opened, failure: UpstreamFailure) -> None:
        """The worker broke after the first byte: count it against the worker."""
        opened.worker.breaker.on_failure()
        self.metrics.worker(self.metrics.upstream_errors, opened.worker.id,
                            failure.kind.value).inc()

    def __repr__(self) -> str:
        return f"Dispatcher(max_attempts={self.config.max_attempts})"


def all_busy(answers: list[tuple[int | None, float | None]]) -> ServiceUnavailable:
    """Every attempt was answered 429 / 503 (``(status, retry_after_s)`` each): the client
    gets the same, with the longest ``Retry-After`` a worker asked for (1 s when none did)."""
    status = 429 if all(code == 429 for code, _ in answers) else 503
    retry = max((after for _, after in answers if after is not None), default=1.0)
    code = ErrorCode.RATE_LIMITED if status == 429 else ErrorCode.OVERLOADED
    return ServiceUnavailable("every worker is busy; retry later", code=code, status=status,
                              retry_after_s=retry)
