"""Prefill/decode dispatch: run a :class:`~cortex.gateway.routing.scoring.PairDecision` up to
the first byte (architecture §7, ``shared/spec/engines-and-pd.md`` §3-§4, ``docs/pd.md``).

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

The request's predicted blocks (its :class:`~cortex.gateway.routing.router.Placement`, credited at
the routing decision) sit on the worker that computes the prompt — the prefill worker, or
the decode worker of a local prefill — and follow each attempt; they are withdrawn when
that worker did not compute it (its leg failed, the decode failed before the prefill
completed, the request was refused) and stay when the prefill completed.

The pairs, the failed sets and the verdict are the pure
:class:`~cortex.gateway.dispatch.plan.PairPlan`; one leg's I/O is
:mod:`cortex.gateway.dispatch.pd.legs`; the cold fallback is passed in
(``Dispatcher.open_fallback``), as is ``Router.commit``: nothing here reaches back into its caller.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass

from cortex.gateway.config.gateway import PDConfig
from cortex.gateway.dispatch.attempt import Opened, ProgressWatch
from cortex.gateway.dispatch.pd.handoff import (
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
from cortex.gateway.dispatch.pd.legs import Answer, Leg, Verdict, call
from cortex.gateway.dispatch.plan import Fallback, LegFailure, PairPlan, Side
from cortex.gateway.fleet.pool import WorkerPool, WorkerState
from cortex.gateway.metrics import GatewayMetrics
from cortex.gateway.request.payload import InferenceRequest
from cortex.gateway.routing.router import Routed
from cortex.gateway.routing.scoring import LocalPrefill, PairDecision, PDMode, PDOutcome, Scored
from cortex.gateway.upstream.client import FailureKind, Upstream
from cortex.gateway.upstream.sse import EventRewrite
from cortex.hashing import Engine

__all__ = ["FallbackOpener", "LegFailure", "PairDispatcher", "Side"]

log = logging.getLogger(__name__)

BLAME_GRACE_S = 0.05
"""When the decode leg fails while the prefill leg is still open, how long (s) to wait for
the prefill's own verdict: a prefill crashing mid-transfer fails both legs at once, and the
blame (which worker to skip on the retry) belongs to the prefill."""

FallbackOpener = Callable[[InferenceRequest, Routed, bytes, str], Awaitable[Opened]]
"""Runs a disaggregated request cold on the model's regular workers (its pairs failed):
``(req, routed, body, request_id)`` → the opened answer (``Dispatcher.open_fallback``)."""


@dataclass(eq=False)
class _Request:
    """One request's fixed inputs across attempts."""

    req: InferenceRequest
    routed: Routed
    plan: PairDecision
    body: bytes  # the upstream body of a single-worker request (fallback, local prefill)
    headers: Mapping[str, str]
    path: str

    @property
    def engine(self) -> Engine:
        return self.plan.engine


class PairDispatcher:
    """Opens prefill/decode pairs; runs ``fallback`` (regular workers) when a handoff
    fails. ``commit``: a worker caches the prompt's blocks besides the placement
    (``Router.commit``). Not thread-safe (event loop)."""

    def __init__(self, pool: WorkerPool, upstream: Upstream, metrics: GatewayMetrics,
                 config: PDConfig, *, retry_statuses: Collection[int],
                 commit: Callable[[Routed, str], None], fallback: FallbackOpener,
                 rng: random.Random | None = None, watch: ProgressWatch | None = None) -> None:
        self.pool = pool
        self.upstream = upstream
        self.metrics = metrics
        self.config = config
        self.retry_statuses = frozenset(retry_statuses)
        self._commit = commit
        self._fallback_opener = fallback
        self._rng = rng or random.SystemRandom()
        self._refused_logged: set[tuple[str, str]] = set()  # pairs warned about
        self.watch = watch  # fails legs whose pair makes no progress (dispatch.attempt)

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
        pairs = PairPlan(plan, self.pool.get, self.config, routed.placement)
        while True:
            pair, refusals = pairs.next()
            self._refused(plan, refusals)
            if pair is None:
                break
            last = pairs.last
            if last is not None:
                self.metrics.retries.labels(reason=f"pd_{last.side.value}").inc()
            if pair.local is not None:
                outcome = await self._local_attempt(ctx, pair.decode, pair.local)
            elif plan.engine is Engine.SGLANG:
                outcome = await self._sglang_attempt(ctx, pair.prefill, pair.decode)
            else:
                outcome = await self._vllm_attempt(ctx, pair.prefill, pair.decode)
            if isinstance(outcome, Opened):
                outcome.attempts = pairs.attempts
                served = outcome.pd.mode.value if outcome.pd else "client_error"
                pairs.answered(outcome.response.status)
                if outcome.response.status != 200:
                    served = "client_error"
                self.metrics.child(self.metrics.pd_requests, engine, served).inc()
                return outcome
            pairs.failed(outcome)
            self.metrics.child(self.metrics.pd_handoff_failures, engine, outcome.side.value,
                               outcome.kind).inc()
            self.metrics.worker(self.metrics.upstream_errors, outcome.worker, outcome.kind).inc()
            log.info("pd attempt failed side=%s worker=%s kind=%s request_id=%s: %s",
                     outcome.side.value, outcome.worker, outcome.kind, request_id,
                     outcome.detail, extra={"worker": outcome.worker, "request_id": request_id})
        return await self._fallback(ctx, pairs, request_id)

    def _refused(self, plan: PairDecision, refusals: list[tuple[str, str, str]]) -> None:
        """Pairs whose KV connectors cannot talk: counted, logged once per pair."""
        for prefill_id, decode_id, why in refusals:
            self.metrics.child(self.metrics.pd_pairs_refused, plan.engine.value,
                               "connector_version").inc()
            if (prefill_id, decode_id) not in self._refused_logged:
                if len(self._refused_logged) > 4096:  # workers come and go
                    self._refused_logged.clear()
                self._refused_logged.add((prefill_id, decode_id))
                log.warning("pd pair refused: %s (their KV connectors cannot talk)", why,
                            extra={"worker": prefill_id})

    async def _fallback(self, ctx: _Request, pairs: PairPlan, request_id: str) -> Opened:
        engine = ctx.engine.value
        verdict = pairs.verdict()
        if isinstance(verdict, Fallback):
            self.metrics.child(self.metrics.pd_fallbacks, engine, verdict.reason).inc()
            log.warning("pd handoff failed, running cold on a regular worker reason=%s "
                        "request_id=%s", verdict.reason, request_id,
                        extra={"request_id": request_id})
            try:
                opened = await self._fallback_opener(ctx.req, ctx.routed, ctx.body, request_id)
            except BaseException:
                self.metrics.child(self.metrics.pd_requests, engine, "failed").inc()
                raise
            opened.attempts += pairs.attempts
            opened.pd = PDOutcome(PDMode.FALLBACK, None, None)
            self.metrics.child(self.metrics.pd_requests, engine, PDMode.FALLBACK.value).inc()
            return opened
        self.metrics.child(self.metrics.pd_requests, engine, "failed").inc()
        raise verdict

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
        p_leg = Leg(Side.PREFILL, p_worker, self.metrics)
        d_leg = Leg(Side.DECODE, d_worker, self.metrics)
        p_task = asyncio.create_task(self._call(p_leg, ctx, body, stream, whole=True,
                                                partner=d_worker))
        d_task = asyncio.create_task(self._call(d_leg, ctx, body, stream, whole=False,
                                                partner=p_worker))
        handed_over = False
        try:
            p_answer: Answer | None = None
            pending: set[asyncio.Task[Answer]] = {p_task, d_task}
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

    async def _decode_not_ok(self, ctx: _Request, prefill: Scored, p_task: asyncio.Task[Answer],
                             p_leg: Leg, p_answer: Answer | None, d_answer: Answer
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
            d_answer.leg.settle(Verdict.ABANDONED)
            return self._failed_or_passed(p_answer, ctx, prefill)
        d_answer.leg.settle(Verdict.FAILED)
        return dataclasses.replace(d_answer.failure,
                                   prefill_ok=p_answer is not None and p_answer.ok)

    async def _vllm_attempt(self, ctx: _Request, prefill: Scored, decode: Scored
                            ) -> Opened | LegFailure:
        p_worker, d_worker = self._worker(prefill), self._worker(decode)
        p_leg = Leg(Side.PREFILL, p_worker, self.metrics)
        try:
            streamed = self.config.vllm_stream_prefill
            p_answer = await self._call(p_leg, ctx, vllm_prefill_body(ctx.req.body, streamed),
                                        streamed, whole=True)
        except BaseException:
            p_leg.settle(Verdict.ABANDONED)
            raise
        if not p_answer.ok:
            return self._failed_or_passed(p_answer, ctx, prefill)
        params, usage = vllm_prefill_result(p_answer.data)
        if params is None:
            p_leg.settle(Verdict.FAILED)
            return LegFailure(Side.PREFILL, p_worker.id, FailureKind.PROTOCOL.value,
                              detail="the prefill answered without kv_transfer_params (a"
                                     " stream: in its final chunk)")
        self._prefill_done(p_answer, ctx)
        body = vllm_decode_body(ctx.body, ctx.req.body, params)
        d_leg = Leg(Side.DECODE, d_worker, self.metrics)
        try:
            d_answer = await self._call(d_leg, ctx, body, ctx.req.stream, whole=False,
                                        partner=p_worker)  # it pulls the prefill's KV
        except BaseException:
            d_leg.settle(Verdict.ABANDONED)
            raise
        if d_answer.failure is not None:
            d_leg.settle(Verdict.FAILED)
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
        self._commit(ctx.routed, d_worker.id)  # a vLLM decode caches the pulled blocks
        return opened

    async def _local_attempt(self, ctx: _Request, decode: Scored, why: LocalPrefill
                             ) -> Opened | LegFailure:
        d_worker = self._worker(decode)
        d_leg = Leg(Side.DECODE, d_worker, self.metrics)
        try:
            d_answer = await self._call(d_leg, ctx, ctx.body, ctx.req.stream, whole=False)
        except BaseException:
            d_leg.settle(Verdict.ABANDONED)
            raise
        if d_answer.failure is not None:
            d_leg.settle(Verdict.FAILED)
            return d_answer.failure
        log.debug("local prefill on decode worker=%s reason=%s", d_worker.id, why.value,
                  extra={"worker": d_worker.id})
        return self._opened(ctx, d_leg, d_answer.data, PairDecision.held_tokens(decode),
                            PDOutcome(PDMode.LOCAL_PREFILL, d_worker.id, d_worker.id), None)

    # ---- legs ----

    async def _call(self, leg: Leg, ctx: _Request, body: bytes, stream: bool, *, whole: bool,
                    partner: WorkerState | None = None) -> Answer:
        """Send one leg within its side's timeout (``whole``: a prefill leg, read whole);
        ``partner``: the pair's other worker, which this leg may wait on (the wedge watch
        counts its progress as the leg's)."""
        config = self.config
        return await call(self.upstream, self.metrics, leg, path=ctx.path, headers=ctx.headers,
                          body=body, stream=stream, whole=whole,
                          timeout_s=config.prefill_timeout_s if whole else config.decode_timeout_s,
                          retry_statuses=self.retry_statuses,
                          mode=ctx.routed.decision.mode.value, watch=self.watch,
                          partner=partner)

    def _failed_or_passed(self, answer: Answer, ctx: _Request, prefill: Scored
                          ) -> Opened | LegFailure:
        """A prefill leg that did not succeed: its failure, or its client error passed on."""
        if answer.failure is not None:
            answer.leg.settle(Verdict.FAILED)
            return answer.failure
        return self._passed(answer, ctx, prefill)

    def _passed(self, answer: Answer, ctx: _Request, prefill: Scored) -> Opened:
        """A leg answered the client's error (non-retryable status): the client gets it."""
        leg = answer.leg
        outcome = PDOutcome(PDMode.DISAGGREGATED, prefill.worker_id,
                            leg.worker.id if leg.side is Side.DECODE else None)
        return self._opened(ctx, leg, answer.data, 0, outcome, None)

    def _observe_handoff(self, ctx: _Request, first: Leg) -> None:
        """From ``first`` leg's send to now (the decode's first byte)."""
        self.metrics.child(self.metrics.pd_handoff_seconds, ctx.engine.value).observe(
            time.perf_counter() - first.started)

    def _opened(self, ctx: _Request, leg: Leg, head: bytes, hit_tokens: int,
                outcome: PDOutcome, rewrite: EventRewrite | None) -> Opened:
        response = leg.hand_over()
        return Opened(leg.worker, response, head, 1, self.metrics, leg.slot,
                      hit_tokens=hit_tokens,
                      pd=outcome, rewrite=rewrite)

    def _prefill_done(self, answer: Answer, ctx: _Request) -> None:
        answer.leg.settle(Verdict.OK)
        self.metrics.child(self.metrics.pd_prefill_seconds, ctx.engine.value).observe(
            time.perf_counter() - answer.leg.started)

    def _late_prefill(self, task: asyncio.Task[Answer], leg: Leg, ctx: _Request) -> None:
        """The prefill leg of a pair whose decode already answered ended."""
        if task.cancelled():  # the exchange closed first (client gone, stream over)
            leg.settle(Verdict.ABANDONED)
            return
        error = task.exception()
        if error is not None:  # a bug: never leave the slot taken
            log.error("prefill leg crashed: %r", error)
            leg.settle(Verdict.ABANDONED)
            return
        answer = task.result()
        if answer.ok:
            self._prefill_done(answer, ctx)
            return
        # the decode has the KV already (it answered): count the prefill, keep the stream
        leg.settle(Verdict.FAILED if answer.failure else Verdict.OK)
        kind = answer.failure.kind if answer.failure else FailureKind.STATUS.value
        self.metrics.child(self.metrics.pd_handoff_failures, ctx.engine.value,
                           Side.PREFILL.value, kind).inc()
        log.warning("prefill leg failed after the decode answered worker=%s: %s",
                    leg.worker.id, answer.failure, extra={"worker": leg.worker.id})

    async def _cancel(self, task: asyncio.Task[Answer], leg: Leg, ctx: _Request | None
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
            leg.settle(Verdict.ABANDONED)

    def _worker(self, scored: Scored) -> WorkerState:
        worker = self.pool.get(scored.worker_id)
        assert worker is not None  # the plan only pairs workers of the pool
        return worker

    def __repr__(self) -> str:
        return f"PairDispatcher(max_attempts={self.config.max_attempts})"


def _stop(task: asyncio.Task[Answer]) -> None:
    """Cancel a prefill leg still draining when its pair's exchange ends (its done
    callback then settles it)."""
    task.cancel()
