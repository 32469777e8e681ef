"""One attempt of a regular request on one worker, up to its first byte: the only await of
single-worker dispatch (:mod:`cortex.gateway.dispatch.dispatcher` decides which worker and what a
failure means, :mod:`cortex.gateway.dispatch.plan`).

An attempt holds an in-flight slot on its worker from the send until :meth:`Opened.close`
(the response stream ended), and counts its uncached prompt tokens on the worker's prefill
queue until the first byte. The worker's breaker gets a verdict for every attempt: success
once it answered, failure on a connection error, timeout, retryable status or a stream that
ends before its first chunk, and none (abandoned) when the attempt was cancelled or a worker
answered 429 (busy, not broken).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from cortex.gateway.fleet.pool import ProgressWatch, WorkerState
from cortex.gateway.http.messages import json_loads
from cortex.gateway.metrics import GatewayMetrics
from cortex.gateway.routing.scoring import Decision, PDOutcome
from cortex.gateway.upstream.client import FailureKind, Response, Upstream, UpstreamFailure
from cortex.gateway.upstream.sse import EventRewrite, is_event_stream

__all__ = ["Opened", "acquire_slot", "attempt", "first_bytes", "release_slot"]


@dataclass(eq=False)
class Opened:
    """A worker answered: its response, the body bytes already read (the first chunk(s) of
    a stream, or the whole body otherwise) and the in-flight slot to release.

    ``hit_tokens``: prompt tokens predicted cached where the prompt was computed (the
    prefill worker of a pair). ``decision``: the ranking ``worker`` came from (``None``: the
    request's main decision). ``pd``: how a disaggregated model's request was served.
    ``rewrite``: applied to the answer's objects while streaming (PD usage / logprobs).
    ``on_close``: more cleanup (a pair's prefill leg still draining). ``answer``: the
    non-streamed 200 answer's JSON object, checked before the first byte (``None``
    otherwise).
    """

    worker: WorkerState
    response: Response
    head: bytes
    attempts: int
    _metrics: GatewayMetrics = field(repr=False)
    _slot: int = field(repr=False)
    hit_tokens: int = 0
    decision: Decision | None = None
    pd: PDOutcome | None = None
    rewrite: EventRewrite | None = field(default=None, repr=False)
    on_close: Callable[[], None] | None = field(default=None, repr=False)
    answer: Any = field(default=None, repr=False)
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


async def attempt(upstream: Upstream, metrics: GatewayMetrics, worker: WorkerState, *,
                  path: str, body: bytes, headers: Mapping[str, str], stream: bool,
                  attempts: int, mode: str, prefill_tokens: int, first_byte_s: float,
                  retry_statuses: Collection[int], watch: ProgressWatch | None = None
                  ) -> Opened | UpstreamFailure:
    """One attempt up to its first byte, within ``first_byte_s`` seconds; ``prefill_tokens``
    count on the worker's prefill queue (:attr:`WorkerState.prefilling`) until then.
    ``attempts``: its number among the request's attempts; ``mode``: the decision's (the
    first-byte histogram's label). ``watch``: fails the wait at once when it finds the
    worker wedged (:mod:`cortex.gateway.fleet.pool`)."""
    breaker = worker.breaker
    breaker.on_attempt()
    slot = acquire_slot(worker, metrics)
    worker.queue_prefill(prefill_tokens)
    response: Response | None = None
    sent = time.perf_counter()
    timer = asyncio.timeout(first_byte_s)
    stall = asyncio.timeout(None)  # expires when the watch finds the worker wedged
    waiting = (watch.waiting(worker.id, lambda: stall.reschedule(-1.0))
               if watch is not None else contextlib.nullcontext())
    try:
        try:
            with waiting:
                async with timer, stall:
                    response = await upstream.post(worker.spec.url.rstrip("/") + path, body,
                                                   headers, worker.spec)
                    head, answer = await first_bytes(response, stream, retry_statuses,
                                                     listed=path == "/generate")
        except TimeoutError:
            if stall.expired():
                raise UpstreamFailure(FailureKind.WEDGED,
                                      "no progress and no probe answer") from None
            if not timer.expired():
                raise
            raise UpstreamFailure(FailureKind.TIMEOUT,
                                  f"no first byte in {first_byte_s}s") from None
    except UpstreamFailure as failure:
        if response is not None:
            response.close()
        release_slot(worker, metrics, slot)
        metrics.worker(metrics.upstream_errors, worker.id, failure.kind.value).inc()
        if failure.status == 429 or failure.kind is FailureKind.TOO_LARGE:
            breaker.on_abandon()  # busy, or asked for more than the gateway relays: not broken
        else:
            breaker.on_failure()
        return failure
    except BaseException:
        # cancelled (client gone, deadline) or a bug: no verdict on the worker
        if response is not None:
            response.close()
        release_slot(worker, metrics, slot)
        breaker.on_abandon()
        raise
    finally:
        worker.prefill_started(prefill_tokens)
    breaker.on_success()
    if watch is not None:
        watch.progressed(worker.id)
    if response.status == 200:
        metrics.worker(metrics.upstream_ttfb, worker.id, mode).observe(
            time.perf_counter() - sent)
    return Opened(worker, response, head, attempts, metrics, slot, answer=answer)


async def first_bytes(response: Response, stream: bool, retry_statuses: Collection[int],
                      *, listed: bool = False) -> tuple[bytes, Any]:
    """The whole body (and, for a 200, the JSON object it must be — or with ``listed``, a
    batched SGLang ``/generate``, a list of them), or a stream's first chunk (and
    ``None``); :class:`UpstreamFailure` for a retryable status, a stream that ends before
    any byte, or a 200 that breaks the endpoint's promise (``bad_answer``: a body that is
    not such JSON, a streamed request answered otherwise than with the engines' SSE)."""
    if response.status in retry_statuses:
        await response.read()
        raise UpstreamFailure(FailureKind.STATUS, f"status {response.status}",
                              response.status, response.retry_after_s)
    if response.status != 200:
        return await response.read(), None
    if not stream:
        body = await response.read()
        answer = json_answer(body, listed)
        if answer is None:
            raise UpstreamFailure(FailureKind.BAD_ANSWER, "a 200 that is not a JSON object")
        return body, answer
    if not response.content_type.startswith("text/event-stream"):
        raise UpstreamFailure(FailureKind.BAD_ANSWER,
                              f"a {response.content_type!r} answer to a streamed request")
    async for chunk in response.chunks():
        if not is_event_stream(chunk):
            raise UpstreamFailure(FailureKind.BAD_ANSWER, "a stream that is not SSE")
        return chunk, None
    raise UpstreamFailure(FailureKind.DISCONNECT, "stream ended before any byte")


def json_answer(body: bytes, listed: bool = False) -> Any:
    """``body`` as a JSON object (or, ``listed``, a non-empty list of them: a batched
    ``/generate``); ``None`` when it is not."""
    try:
        obj = json_loads(body)
    except (ValueError, RecursionError):
        return None
    if isinstance(obj, dict) or (listed and isinstance(obj, list) and obj
                                 and all(isinstance(item, dict) for item in obj)):
        return obj
    return None
