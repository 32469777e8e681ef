"""The legs of a prefill/decode attempt: one worker's part each (its in-flight slot, its
response, its breaker verdict) and the one call that sends a leg up to what the pair needs
before the first byte (:mod:`cortex.gateway.dispatch.pd.dispatcher` runs the pair).

A leg's failure is a value (:class:`~cortex.gateway.dispatch.plan.LegFailure`), not an exception: a
connection error, a timeout, a retryable status, a 200 that is not what the endpoint promises
(``bad_answer``, as on the regular path), or a 200 whose answer is an error object (an error
as the stream's first event, or an error body).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from enum import StrEnum

from cortex.gateway.dispatch.attempt import ProgressWatch, acquire_slot, json_answer, release_slot
from cortex.gateway.dispatch.plan import LegFailure, Side
from cortex.gateway.fleet.pool import WorkerState
from cortex.gateway.metrics import GatewayMetrics
from cortex.gateway.upstream.client import FailureKind, Response, Upstream, UpstreamFailure
from cortex.gateway.upstream.sse import first_event_error, has_complete_event, is_event_stream

__all__ = ["ERROR_EVENT", "Answer", "Leg", "Verdict", "bad_answer", "call", "error_in"]

ERROR_EVENT = "error_event"
"""Failure kind of a leg whose answer is an error object (status 200, error in the body)."""


class Verdict(StrEnum):
    OK = "ok"
    FAILED = "failed"
    ABANDONED = "abandoned"


class Leg:
    """One worker's part of an attempt: its in-flight slot, response and breaker verdict.

    ``settle`` records the verdict, closes the response and frees the slot, once;
    ``hand_over`` records success and leaves response and slot to an
    :class:`~cortex.gateway.dispatch.attempt.Opened`.
    """

    def __init__(self, side: Side, worker: WorkerState, metrics: GatewayMetrics) -> None:
        self.side = side
        self.worker = worker
        self.response: Response | None = None
        self.started = time.perf_counter()
        self._metrics = metrics
        self._settled = False
        worker.breaker.on_attempt()
        self.slot = acquire_slot(worker, metrics)

    def settle(self, verdict: Verdict) -> None:
        if self._settled:
            return
        self._settled = True
        breaker = self.worker.breaker
        if verdict is Verdict.OK:
            breaker.on_success()
        elif verdict is Verdict.FAILED:
            breaker.on_failure()
        else:
            breaker.on_abandon()
        if self.response is not None:
            self.response.close()
        release_slot(self.worker, self._metrics, self.slot)

    def hand_over(self) -> Response:
        assert self.response is not None and not self._settled
        self._settled = True
        self.worker.breaker.on_success()
        return self.response

    def __repr__(self) -> str:
        return f"Leg({self.side.value}, {self.worker.id}, settled={self._settled})"


@dataclass(eq=False)
class Answer:
    """What a leg got before the first byte: ``status`` and ``data`` (the whole body, or a
    stream's first complete event(s)), or ``failure``."""

    leg: Leg
    status: int = 0
    data: bytes = b""
    failure: LegFailure | None = None

    @property
    def ok(self) -> bool:
        return self.failure is None and self.status == 200

    @property
    def client_error(self) -> bool:
        """The worker rejected the request itself (a non-retryable status): pass it on."""
        return self.failure is None and self.status != 200


async def call(upstream: Upstream, metrics: GatewayMetrics, leg: Leg, *, path: str,
               headers: Mapping[str, str], body: bytes, stream: bool, whole: bool,
               timeout_s: float, retry_statuses: Collection[int], mode: str,
               watch: ProgressWatch | None = None, partner: WorkerState | None = None
               ) -> Answer:
    """Send one leg and read its whole answer (``whole``: a prefill leg) or, for a streamed
    decode leg, up to its first complete event, within ``timeout_s``. Failures become
    values; the leg's response stays open (for the caller to settle or hand over).
    ``mode``: the decision's (the first-byte histogram's label). ``watch``: fails the leg
    as ``wedged`` when neither its worker's engine nor its ``partner``'s (the pair's other
    worker) made progress for the watch's PD window (:mod:`cortex.gateway.dispatch.attempt`)."""
    url = leg.worker.spec.url.rstrip("/") + path
    answer = Answer(leg)
    stall = asyncio.timeout(None)  # expires when the watch finds the leg wedged
    waiting = (watch.waiting(leg.worker.id, lambda: stall.reschedule(-1.0), probe=False,
                             partner=partner.id if partner is not None else None)
               if watch is not None else contextlib.nullcontext())
    try:
        with waiting:
            async with asyncio.timeout(timeout_s), stall:
                response = leg.response = await upstream.post(url, body, headers,
                                                              leg.worker.spec)
                answer.status = response.status
                if whole or response.status != 200 or not stream:
                    answer.data = await response.read()
                else:
                    async with contextlib.aclosing(response.chunks()) as chunks:
                        async for chunk in chunks:
                            answer.data += chunk
                            if has_complete_event(answer.data):
                                break
                    if not has_complete_event(answer.data):
                        raise UpstreamFailure(FailureKind.DISCONNECT,
                                              "stream ended before its first event")
    except TimeoutError:
        if stall.expired():
            answer.failure = LegFailure(leg.side, leg.worker.id, FailureKind.WEDGED.value,
                                        detail="no engine progress on either side of the pair")
            return answer
        answer.failure = LegFailure(leg.side, leg.worker.id, FailureKind.TIMEOUT.value,
                                    timeout=True, detail=f"no answer in {timeout_s}s")
        return answer
    except UpstreamFailure as failure:
        answer.failure = LegFailure(leg.side, leg.worker.id, failure.kind.value,
                                    timeout=failure.kind is FailureKind.TIMEOUT,
                                    detail=str(failure))
        return answer
    if watch is not None:
        watch.progressed(leg.worker.id)
    if answer.status in retry_statuses:
        answer.failure = LegFailure(leg.side, leg.worker.id, FailureKind.STATUS.value,
                                    detail=f"status {answer.status}", status=answer.status,
                                    retry_after_s=response.retry_after_s)
    elif answer.status == 200 and (broken := bad_answer(
            response.content_type, answer.data, stream, listed=path == "/generate")):
        answer.failure = LegFailure(leg.side, leg.worker.id, FailureKind.BAD_ANSWER.value,
                                    detail=broken)
    elif answer.status == 200 and error_in(answer.data, stream):
        answer.failure = LegFailure(leg.side, leg.worker.id, ERROR_EVENT,
                                    detail="the answer is an error object")
    elif answer.status == 200 and not whole:  # the decode's first byte
        metrics.worker(metrics.upstream_ttfb, leg.worker.id, mode).observe(
            time.perf_counter() - leg.started)
    return answer


def bad_answer(content_type: str, data: bytes, stream: bool, *, listed: bool = False
               ) -> str | None:
    """Why a leg's 200 is not what its endpoint promises (None: it is): a body that is not a
    JSON object (``listed``: nor a list of them, a batched ``/generate``), a streamed leg
    answered otherwise than with the engines' SSE (``data``: its first event, or the whole
    of a prefill leg) — what the regular path calls ``bad_answer``
    (:func:`cortex.gateway.dispatch.attempt.first_bytes`)."""
    if stream:
        if not content_type.startswith("text/event-stream"):
            return f"a {content_type!r} answer to a streamed request"
        return None if is_event_stream(data) else "a stream that is not SSE"
    return None if json_answer(data, listed) is not None else "a 200 that is not a JSON object"


def error_in(data: bytes, stream: bool) -> bool:
    """Whether a 200 answer is an error object (a stream's first event, or the body)."""
    if stream:
        return first_event_error(data) is not None
    if b'"error"' not in data[:256] and b'"object":"error"' not in data[:256]:
        return False
    try:
        obj = json.loads(data)
    except ValueError:
        return False
    return isinstance(obj, dict) and (isinstance(obj.get("error"), dict)
                                      or obj.get("object") == "error")
