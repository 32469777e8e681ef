"""Prefill/decode dispatch: run a :class:`~cortex.gateway.pairing.PDPlan` up to the first
byte (architecture §7, ``shared/spec/engines-and-pd.md`` §3-§4, ``docs/pd.md``).

An attempt takes the best prefill worker not yet failed (cache affinity) and the least
loaded decode worker not yet failed:

* **SGLang** sends the same body, plus fresh bootstrap rooms, to both legs at once. The
  decode leg is what the client gets; the prefill leg is drained (its input logprobs merged
  when asked). If either leg fails before the decode's first byte, the other is cancelled
  at once — closing its connection aborts the request in the engine, so no survivor waits
  out the engine's bootstrap timeout.
* **vLLM** asks the prefill for ``kv_transfer_params``, relays them unchanged to the decode
  and rewrites the decode's usage so the prompt side comes from the prefill.
* **Local prefill** (conditional disaggregation, vLLM): the decode worker alone.

A failed attempt (connection, timeout, retryable status, an error as the stream's first
event) is retried on a fresh pair while ``pd.max_attempts`` allows — except a decode failure
after the prefill succeeded (the KV was handed over and lost): that one goes straight to the
cold fallback on a regular worker, as does an exhausted pair budget. With no regular worker
the client gets a 502 (504 on a timeout) with code ``prefill_server_error`` or
``decode_server_error``. A leg that answers the client's error (a non-retryable status) is
passed through. After the first byte nothing is retried (the exchange ends the stream).

The request's predicted blocks (its :class:`~cortex.gateway.router.Placement`, credited at
the routing decision) sit on the worker that computes the prompt — the prefill worker, or
the decode worker of a local prefill — and follow each attempt; they are withdrawn when
that worker did not compute it (its leg failed, the decode failed before the prefill
completed, the request was refused) and stay when the prefill completed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

from cortex.gateway.config import PDConfig
from cortex.gateway.dispatch import (
    BUSY_STATUSES,
    Dispatcher,
    Opened,
    acquire_slot,
    all_busy,
    release_slot,
)
from cortex.gateway.errors import ErrorCode, ServiceUnavailable, UpstreamError
from cortex.gateway.handoff import (
    bootstrap_host,
    bootstrap_room,
    input_logprobs_rewrite,
    merge_input_logprobs_body,
    prefill_input_logprobs,
    sglang_leg_body,
    usage_rewrite,
    vllm_decode_body,
    vllm_prefill_body,
    vllm_prefill_result,
    wants_input_logprobs,
)
from cortex.gateway.pairing import LocalPrefill, PDMode, PDOutcome, PDPlan, compatible_pair
from cortex.gateway.payload import InferenceRequest
from cortex.gateway.pool import WorkerState
from cortex.gateway.router import Routed
from cortex.gateway.scoring import Scored
from cortex.gateway.sse import EventRewrite, first_event_error, has_complete_event
from cortex.gateway.upstream import FailureKind, UpstreamFailure, UpstreamResponse
from cortex.hashing import Engine

__all__ = ["LegFailure", "PairDispatcher", "Side"]

log = logging.getLogger(__name__)

BLAME_GRACE_S = 0.05
"""When the decode leg fails while the prefill leg is still open, how long (s) to wait for
the prefill's own verdict: a prefill crashing mid-transfer fails both legs at once, and the
blame (which worker to skip on the retry) belongs to the prefill."""

ERROR_EVENT = "error_event"
"""Failure kind of a leg whose answer is an error object (status 200, error in the body)."""


class Side(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True, slots=True)
class LegFailure:
    """A failed attempt: which side failed, how (a :class:`FailureKind` value or
    ``error_event``), and whether the prefill had already succeeded (KV handed over);
    ``status`` / ``retry_after_s``: what a worker that refused it answered."""

    side: Side
    worker: str
    kind: str
    timeout: bool = False
    prefill_ok: bool = False
    detail: str = ""
    status: int | None = None
    retry_after_s: float | None = None


class _Verdict(StrEnum):
    OK = "ok"
    FAILED = "failed"
    ABANDONED = "abandoned"


class _Leg:
    """One worker's part of an attempt: its in-flight slot, response and breaker verdict.

    ``settle`` records the verdict, closes the response and frees the slot, once;
    ``hand_over`` records success and leaves response and slot to an :class:`Opened`.
    """

    def __init__(self, side: Side, worker: WorkerState, owner: PairDispatcher) -> None:
        self.side = side
        self.worker = worker
        self.response: UpstreamResponse | None = None
        self.started = time.perf_counter()
        self._metrics = owner.metrics
        self._settled = False
        worker.breaker.on_attempt()
        self.slot = acquire_slot(worker, self._metrics)

    def settle(self, verdict: _Verdict) -> None:
        if self._settled:
            return
        self._settled = True
        breaker = self.worker.breaker
        if verdict is _Verdict.OK:
            breaker.on_success()
        elif verdict is _Verdict.FAILED:
            breaker.on_failure()
        else:
            breaker.on_abandon()
        if self.response is not None:
            self.response.close()
        release_slot(self.worker, self._metrics, self.slot)

    def hand_over(self) -> UpstreamResponse:
        assert self.response is not None and not self._settled
        self._settled = True
        self.worker.breaker.on_success()
        return self.response

    def __repr__(self) -> str:
        return f"_Leg({self.side.value}, {self.worker.id}, settled={self._settled})"


@dataclass(eq=False)
class _Answer:
    """What a leg got before the first byte: ``status`` and ``data`` (the whole body, or a
    stream's first complete event(s)), or ``failure``."""

    leg: _Leg
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


@dataclass(eq=False)
class _Request:
    """One request's fixed inputs across attempts."""

    req: InferenceRequest
    routed: Routed
    plan: PDPlan
    body: bytes  # the upstream body of a single-worker request (fallback, local prefill)
    headers: Mapping[str, str]
    path: str

    @property
    def engine(self) -> Engine:
        return self.plan.engine


class PairDispatcher:
    """Opens prefill/decode pairs; falls back to ``single`` (regular workers) when a
    handoff fails. Not thread-safe (event loop)."""

    def __init__(self, single: Dispatcher, config: PDConfig,
                 rng: random.Random | None = None) -> None:
        self.single = single
        self.config = config
        self.pool = single.pool
        self.upstream = single.upstream
        self.router = single.router
        self.metrics = single.metrics
        self.retry_statuses = frozenset(single.config.retry_statuses)
        self._rng = rng or random.SystemRandom()
        self._refused_logged: set[tuple[str, str]] = set()  # pairs warned about

    # ---- the attempt loop ----

    async def open(self, req: InferenceRequest, routed: Routed, body: bytes, request_id: str,
                   trace: Mapping[str, str] | None = None) -> Opened:
        """Open the decode leg of a working pair (or the fallback) up to its first byte.

        Raises :class:`UpstreamError` with code ``prefill_server_error`` /
        ``decode_server_error`` (502, or 504 on a timeout) when no attempt worked and no
        regular worker can take the request, :class:`ServiceUnavailable` when no pair and
        no regular worker is routable any more.
        """
        plan = routed.pd
        assert plan is not None
        ctx = _Request(req, routed, plan, body,
                       {"Content-Type": "application/json", "X-Request-Id": request_id,
                        **(trace or {})},
                       req.endpoint.value)
        engine = plan.engine.value
        placement = routed.placement
        failed_prefill: set[str] = set()
        failed_decode: set[str] = set()
        last: LegFailure | None = None
        failures: list[LegFailure] = []
        refused: list[str] = []
        attempts = 0
        while attempts < self.config.max_attempts:
            pair = self._next_pair(plan, failed_prefill, failed_decode, refused)
            if pair is None:
                break
            if last is not None:
                self.metrics.retries.labels(reason=f"pd_{last.side.value}").inc()
            attempts += 1
            prefill, decode = pair
            local = plan.local_prefill(decode, self.config)
            placement.move(decode.worker_id if local is not None else prefill.worker_id)
            if local is not None:
                outcome = await self._local_attempt(ctx, decode, local)
            elif plan.engine is Engine.SGLANG:
                outcome = await self._sglang_attempt(ctx, prefill, decode)
            else:
                outcome = await self._vllm_attempt(ctx, prefill, decode)
            if isinstance(outcome, Opened):
                outcome.attempts = attempts
                served = outcome.pd.mode.value if outcome.pd else "client_error"
                if outcome.response.status != 200:
                    served = "client_error"
                    placement.withdraw()
                self.metrics.child(self.metrics.pd_requests, engine, served).inc()
                return outcome
            if not outcome.prefill_ok:  # the prompt was not computed where it is credited
                placement.withdraw()
            last = outcome
            failures.append(outcome)
            self.metrics.child(self.metrics.pd_handoff_failures, engine, outcome.side.value,
                               outcome.kind).inc()
            self.metrics.worker(self.metrics.upstream_errors, outcome.worker, outcome.kind).inc()
            log.info("pd attempt failed side=%s worker=%s kind=%s request_id=%s: %s",
                     outcome.side.value, outcome.worker, outcome.kind, request_id,
                     outcome.detail, extra={"worker": outcome.worker, "request_id": request_id})
            (failed_prefill if outcome.side is Side.PREFILL else failed_decode).add(
                outcome.worker)
            if outcome.side is Side.DECODE and outcome.prefill_ok:
                break  # the KV was handed over and lost: no second pair, fall back
        return await self._fallback(ctx, failures, attempts, request_id, refused)

    def _next_pair(self, plan: PDPlan, failed_prefill: set[str], failed_decode: set[str],
                   refused: list[str]) -> tuple[Scored, Scored] | None:
        """The best-ranked routable pair not failed yet whose KV connectors can talk; why a
        pair was refused is appended to ``refused`` (counted, logged once per pair)."""
        def usable(ranked: tuple[Scored, ...], failed: set[str]
                   ) -> list[tuple[Scored, WorkerState]]:
            workers = ((scored, self.pool.get(scored.worker_id)) for scored in ranked
                       if scored.worker_id not in failed)
            return [(scored, w) for scored, w in workers if w is not None and w.routable()]

        pair, refusals = compatible_pair(usable(plan.prefill.ranked, failed_prefill),
                                         usable(plan.decode.ranked, failed_decode))
        for prefill_id, decode_id, why in refusals:
            self.metrics.child(self.metrics.pd_pairs_refused, plan.engine.value,
                               "connector_version").inc()
            refused.append(why)
            if (prefill_id, decode_id) not in self._refused_logged:
                if len(self._refused_logged) > 4096:  # workers come and go
                    self._refused_logged.clear()
                self._refused_logged.add((prefill_id, decode_id))
                log.warning("pd pair refused: %s (their KV connectors cannot talk)", why,
                            extra={"worker": prefill_id})
        return pair

    async def _fallback(self, ctx: _Request, failures: list[LegFailure], attempts: int,
                        request_id: str, refused: list[str]) -> Opened:
        plan, engine = ctx.plan, ctx.engine.value
        last = failures[-1] if failures else None
        if plan.fallback is not None and self.config.fallback_to_regular:
            reason = f"{last.side.value}_failed" if last is not None else "no_pair"
            self.metrics.child(self.metrics.pd_fallbacks, engine, reason).inc()
            log.warning("pd handoff failed, running cold on a regular worker reason=%s "
                        "request_id=%s", reason, request_id, extra={"request_id": request_id})
            routed = dataclasses.replace(ctx.routed, decision=plan.fallback, pd=None,
                                         placement=self.router.placement(ctx.routed.keys,
                                                                         ctx.routed.keysets))
            try:
                opened = await self.single.open_regular(ctx.req, routed, ctx.body, request_id)
            except BaseException:
                self.metrics.child(self.metrics.pd_requests, engine, "failed").inc()
                raise
            opened.attempts += attempts
            opened.decision = plan.fallback
            opened.pd = PDOutcome(PDMode.FALLBACK, None, None)
            self.metrics.child(self.metrics.pd_requests, engine, PDMode.FALLBACK.value).inc()
            return opened
        self.metrics.child(self.metrics.pd_requests, engine, "failed").inc()
        if last is None:
            if refused:
                raise ServiceUnavailable("no prefill/decode pair with compatible KV connectors:"
                                         f" {refused[-1]}")
            raise ServiceUnavailable("no available prefill/decode pair for this request")
        if all(f.status in BUSY_STATUSES for f in failures):
            raise all_busy([(f.status, f.retry_after_s) for f in failures])
        if last.side is Side.PREFILL:
            code, message = ErrorCode.PREFILL_SERVER_ERROR, "the prefill worker failed"
        else:
            code, message = ErrorCode.DECODE_SERVER_ERROR, "the decode worker failed"
        if last.timeout:
            message += " to answer in time"
        raise UpstreamError(message, code=code, status=504 if last.timeout else 502)

    # ---- attempts ----

    async def _sglang_attempt(self, ctx: _Request, prefill: Scored, decode: Scored
                              ) -> Opened | LegFailure:
        p_worker, d_worker = self._worker(prefill), self._worker(decode)
        spec = p_worker.spec
        rooms = [bootstrap_room(self._rng, spec.dp_size, prefill.candidate.dp_rank)
                 for _ in range(ctx.plan.sequences)]
        body = sglang_leg_body(ctx.body, ctx.req.body, bootstrap_host(spec), spec.bootstrap_port,
                               rooms)
        stream = ctx.req.stream
        p_leg = _Leg(Side.PREFILL, p_worker, self)
        d_leg = _Leg(Side.DECODE, d_worker, self)
        p_task = asyncio.create_task(self._call(p_leg, ctx, body, stream, whole=True))
        d_task = asyncio.create_task(self._call(d_leg, ctx, body, stream, whole=False))
        handed_over = False
        try:
            p_answer: _Answer | None = None
            pending: set[asyncio.Task[_Answer]] = {p_task, d_task}
            while d_task in pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if p_task in done:
                    p_answer = p_task.result()
                    if not p_answer.ok:
                        await self._cancel(d_task, d_leg, ctx)
                        return self._failed_or_passed(p_answer, ctx, prefill)
                    self._prefill_done(p_answer, ctx)
            d_answer = d_task.result()
            if not d_answer.ok:
                return await self._decode_not_ok(ctx, prefill, p_task, p_leg, p_answer,
                                                 d_answer)
            # the decode's first byte: the KV was handed over
            rewrite: EventRewrite | None = None
            head = d_answer.data
            if wants_input_logprobs(ctx.req.endpoint, ctx.req.body):
                if p_answer is None:
                    p_answer = await p_task  # bounded by the prefill leg's own timeout
                    self._late_prefill(p_task, p_leg, ctx)
                logprobs = prefill_input_logprobs(p_answer.data, stream) if p_answer.ok else {}
                if stream:
                    rewrite = input_logprobs_rewrite(logprobs)
                else:
                    head = merge_input_logprobs_body(head, logprobs)
            self._observe_handoff(ctx, d_leg)
            opened = self._opened(ctx, d_leg, head, prefill.credited_tokens,
                                  PDOutcome(PDMode.DISAGGREGATED, p_worker.id, d_worker.id),
                                  rewrite)
            if p_answer is None:  # still draining: it no longer matters to the decode
                if p_task.done():
                    self._late_prefill(p_task, p_leg, ctx)
                else:
                    p_task.add_done_callback(lambda task: self._late_prefill(task, p_leg, ctx))
                    opened.on_close = lambda: _stop(p_task)
            handed_over = True
            return opened
        finally:
            if not handed_over:
                for task, leg in ((p_task, p_leg), (d_task, d_leg)):
                    await self._cancel(task, leg, None)

    async def _decode_not_ok(self, ctx: _Request, prefill: Scored, p_task: asyncio.Task[_Answer],
                             p_leg: _Leg, p_answer: _Answer | None, d_answer: _Answer
                             ) -> Opened | LegFailure:
        """The SGLang decode leg failed or refused before its first byte."""
        if p_answer is None:  # the prefill's verdict decides who is to blame
            done, _ = await asyncio.wait({p_task}, timeout=BLAME_GRACE_S)
            if p_task in done:
                p_answer = p_task.result()
                if p_answer.ok:
                    self._prefill_done(p_answer, ctx)
            else:
                await self._cancel(p_task, p_leg, ctx)
        if d_answer.failure is None:  # the decode refused the request itself
            return self._passed(d_answer, ctx, prefill)
        if p_answer is not None and not p_answer.ok:  # both failed: the prefill first
            d_answer.leg.settle(_Verdict.ABANDONED)
            return self._failed_or_passed(p_answer, ctx, prefill)
        d_answer.leg.settle(_Verdict.FAILED)
        return dataclasses.replace(d_answer.failure,
                                   prefill_ok=p_answer is not None and p_answer.ok)

    async def _vllm_attempt(self, ctx: _Request, prefill: Scored, decode: Scored
                            ) -> Opened | LegFailure:
        p_worker, d_worker = self._worker(prefill), self._worker(decode)
        p_leg = _Leg(Side.PREFILL, p_worker, self)
        try:
            streamed = self.config.vllm_stream_prefill
            p_answer = await self._call(p_leg, ctx, vllm_prefill_body(ctx.req.body, streamed),
                                        streamed, whole=True)
        except BaseException:
            p_leg.settle(_Verdict.ABANDONED)
            raise
        if not p_answer.ok:
            return self._failed_or_passed(p_answer, ctx, prefill)
        params, usage = vllm_prefill_result(p_answer.data)
        if params is None:
            p_leg.settle(_Verdict.FAILED)
            return LegFailure(Side.PREFILL, p_worker.id, FailureKind.PROTOCOL.value,
                              detail="the prefill answered without kv_transfer_params (a"
                                     " stream: in its final chunk)")
        self._prefill_done(p_answer, ctx)
        body = vllm_decode_body(ctx.body, ctx.req.body, params)
        d_leg = _Leg(Side.DECODE, d_worker, self)
        try:
            d_answer = await self._call(d_leg, ctx, body, ctx.req.stream, whole=False)
        except BaseException:
            d_leg.settle(_Verdict.ABANDONED)
            raise
        if d_answer.failure is not None:
            d_leg.settle(_Verdict.FAILED)
            return dataclasses.replace(d_answer.failure, prefill_ok=True)
        if not d_answer.ok:
            return self._passed(d_answer, ctx, prefill)
        rewrite = usage_rewrite(usage) if usage is not None else None
        head = d_answer.data
        if rewrite is not None and not ctx.req.stream:
            head = rewrite.body(head)
        self._observe_handoff(ctx, p_leg)
        opened = self._opened(ctx, d_leg, head, prefill.credited_tokens,
                              PDOutcome(PDMode.DISAGGREGATED, p_worker.id, d_worker.id),
                              rewrite if ctx.req.stream else None)
        self.router.commit(ctx.routed, d_worker.id)  # a vLLM decode caches the pulled blocks
        return opened

    async def _local_attempt(self, ctx: _Request, decode: Scored, why: LocalPrefill
                             ) -> Opened | LegFailure:
        d_worker = self._worker(decode)
        d_leg = _Leg(Side.DECODE, d_worker, self)
        try:
            d_answer = await self._call(d_leg, ctx, ctx.body, ctx.req.stream, whole=False)
        except BaseException:
            d_leg.settle(_Verdict.ABANDONED)
            raise
        if d_answer.failure is not None:
            d_leg.settle(_Verdict.FAILED)
            return d_answer.failure
        log.debug("local prefill on decode worker=%s reason=%s", d_worker.id, why.value,
                  extra={"worker": d_worker.id})
        return self._opened(ctx, d_leg, d_answer.data, PDPlan.held_tokens(decode),
                            PDOutcome(PDMode.LOCAL_PREFILL, d_worker.id, d_worker.id), None)

    # ---- legs ----

    async def _call(self, leg: _Leg, ctx: _Request, body: bytes, stream: bool, *, whole: bool
                    ) -> _Answer:
        """Send one leg and read its whole answer (``whole``: a prefill leg) or, for a
        streamed decode leg, up to its first complete event. Failures become values; the
        leg's response stays open (for the caller to settle or hand over)."""
        timeout_s = self.config.prefill_timeout_s if whole else self.config.decode_timeout_s
        url = leg.worker.spec.url.rstrip("/") + ctx.path
        answer = _Answer(leg)
        try:
            async with asyncio.timeout(timeout_s):
                response = leg.response = await self.upstream.post(url, body, ctx.headers,
                                                                   leg.worker.spec)
                answer.status = response.status
                if whole or response.status != 200 or not stream:
                    answer.data = await response.read()
                else:
                    async for chunk in response.chunks():
                        answer.data += chunk
                        if has_complete_event(answer.data):
                            break
                    if not has_complete_event(answer.data):
                        raise UpstreamFailure(FailureKind.DISCONNECT,
                                              "stream ended before its first event")
        except TimeoutError:
            answer.failure = LegFailure(leg.side, leg.worker.id, FailureKind.TIMEOUT.value,
                                        timeout=True, detail=f"no answer in {timeout_s}s")
            return answer
        except UpstreamFailure as failure:
            answer.failure = LegFailure(leg.side, leg.worker.id, failure.kind.value,
                                        timeout=failure.kind is FailureKind.TIMEOUT,
                                        detail=str(failure))
            return answer
        if answer.status in self.retry_statuses:
            answer.failure = LegFailure(leg.side, leg.worker.id, FailureKind.STATUS.value,
                                        detail=f"status {answer.status}", status=answer.status,
                                        retry_after_s=response.retry_after_s)
        elif answer.status == 200 and _error_in(answer.data, stream):
            answer.failure = LegFailure(leg.side, leg.worker.id, ERROR_EVENT,
                                        detail="the answer is an error object")
        elif answer.status == 200 and not whole:  # the decode's first byte
            self.metrics.worker(self.metrics.upstream_ttfb, leg.worker.id,
                               ctx.routed.decision.mode.value).observe(
                time.perf_counter() - leg.started)
        return answer

    def _failed_or_passed(self, answer: _Answer, ctx: _Request, prefill: Scored
                          ) -> Opened | LegFailure:
        """A prefill leg that did not succeed: its failure, or its client error passed on."""
        if answer.failure is not None:
            answer.leg.settle(_Verdict.FAILED)
            return answer.failure
        return self._passed(answer, ctx, prefill)

    def _passed(self, answer: _Answer, ctx: _Request, prefill: Scored) -> Opened:
        """A leg answered the client's error (non-retryable status): the client gets it."""
        leg = answer.leg
        outcome = PDOutcome(PDMode.DISAGGREGATED, prefill.worker_id,
                            leg.worker.id if leg.side is Side.DECODE else None)
        return self._opened(ctx, leg, answer.data, 0, outcome, None)

    def _observe_handoff(self, ctx: _Request, first: _Leg) -> None:
        """From ``first`` leg's send to now (the decode's first byte)."""
        self.metrics.child(self.metrics.pd_handoff_seconds, ctx.engine.value).observe(
            time.perf_counter() - first.started)

    def _opened(self, ctx: _Request, leg: _Leg, head: bytes, hit_tokens: int,
                outcome: PDOutcome, rewrite: EventRewrite | None) -> Opened:
        response = leg.hand_over()
        return Opened(leg.worker, response, head, 1, self.metrics, leg.slot,
                      hit_tokens=hit_tokens,
                      pd=outcome, rewrite=rewrite)

    def _prefill_done(self, answer: _Answer, ctx: _Request) -> None:
        answer.leg.settle(_Verdict.OK)
        self.metrics.child(self.metrics.pd_prefill_seconds, ctx.engine.value).observe(
            time.perf_counter() - answer.leg.started)

    def _late_prefill(self, task: asyncio.Task[_Answer], leg: _Leg, ctx: _Request) -> None:
        """The prefill leg of a pair whose decode already answered ended."""
        if task.cancelled():  # the exchange closed first (client gone, stream over)
            leg.settle(_Verdict.ABANDONED)
            return
        error = task.exception()
        if error is not None:  # a bug: never leave the slot taken
            log.error("prefill leg crashed: %r", error)
            leg.settle(_Verdict.ABANDONED)
            return
        answer = task.result()
        if answer.ok:
            self._prefill_done(answer, ctx)
            return
        # the decode has the KV already (it answered): count the prefill, keep the stream
        leg.settle(_Verdict.FAILED if answer.failure else _Verdict.OK)
        kind = answer.failure.kind if answer.failure else FailureKind.STATUS.value
        self.metrics.child(self.metrics.pd_handoff_failures, ctx.engine.value,
                           Side.PREFILL.value, kind).inc()
        log.warning("prefill leg failed after the decode answered worker=%s: %s",
                    leg.worker.id, answer.failure, extra={"worker": leg.worker.id})

    async def _cancel(self, task: asyncio.Task[_Answer], leg: _Leg, ctx: _Request | None
                      ) -> None:
        """Cancel a leg still open (the other one failed: ``ctx`` given, counted) and wait
        until its connection is closed, which makes the engine abort the request."""
        if not task.done():
            task.cancel()
            if ctx is not None:
                self.metrics.child(self.metrics.pd_cancelled_legs, ctx.engine.value,
                                   leg.side.value).inc()
        try:
            await asyncio.wait({task})
        finally:
            leg.settle(_Verdict.ABANDONED)

    def _worker(self, scored: Scored) -> WorkerState:
        worker = self.pool.get(scored.worker_id)
        assert worker is not None  # _next_pair checked it
        return worker

    def __repr__(self) -> str:
        return f"PairDispatcher(max_attempts={self.config.max_attempts})"


def _stop(task: asyncio.Task[_Answer]) -> None:
    """Cancel a prefill leg still draining when its pair's exchange ends (its done
    callback then settles it)."""
    task.cancel()


def _error_in(data: bytes, stream: bool) -> bool:
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
