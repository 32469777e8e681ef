"""The inference endpoints: validate → route → dispatch → answer or stream back.

Every response carries ``x-request-id`` (the client's, else a fresh one; sent upstream too)
and the decision headers ``x-cortex-cache-hit-tokens``, ``x-cortex-assigned-worker``,
``x-cortex-match-mode`` (``none`` / ``0`` when the request was rejected before routing).
Requests of a disaggregated model add ``x-cortex-pd`` (``disaggregated`` | ``local_prefill``
| ``fallback_regular``), ``x-cortex-prefill-worker`` and ``x-cortex-decode-worker``; the
assigned worker is then the decode worker and the hit tokens are the prefill worker's.

The exchange with the worker runs in its own task raced against ``http.disconnect``: a
client that goes away cancels it, which closes the upstream connection (the engine aborts
the generation) and frees the worker's in-flight slot. The request's deadline
(``upstream.request_timeout_s``) bounds routing (the index Match) and the upstream call.

The decision headers, built in one place for every answer: the gateway's own responses
(served, failed before a worker answered, rejected before routing) and the endpoint
picker's response-header mutation (``docs/api.md`` lists them).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any

from cortex.gateway.config.gateway import Timeouts
from cortex.gateway.dispatch.attempt import Opened
from cortex.gateway.dispatch.dispatcher import Dispatcher, upstream_body
from cortex.gateway.errors import (
    ClientError,
    ErrorCode,
    GatewayError,
    anthropic_error_event,
    relayed_error,
)
from cortex.gateway.http.asgi import Message, Receive, Send
from cortex.gateway.http.h1 import body_writer
from cortex.gateway.http.messages import (
    ClientDisconnected,
    Headers,
    Request,
    json_loads,
    send_bytes,
    send_error,
)
from cortex.gateway.metrics import GatewayMetrics
from cortex.gateway.request.payload import (
    AGENT_PATHS,
    InferencePath,
    InferenceRequest,
    Unmodelled,
    parse_body,
)
from cortex.gateway.routing.placement import session_of
from cortex.gateway.routing.router import Routed
from cortex.gateway.routing.scoring import PDOutcome, Reuse, count_reuse, reuse_of
from cortex.gateway.runtime import Runtime
from cortex.gateway.tokens.service import Tokenization
from cortex.gateway.tracebacks import TracebackLimiter
from cortex.gateway.upstream.client import FailureKind, UpstreamFailure
from cortex.gateway.upstream.named_events import NamedEventStream
from cortex.gateway.upstream.sse import SSEForwarder, cached_tokens_of, sse_error_event
from cortex.telemetry.tracing import Span, SpanKind, StatusCode, trace_headers

__all__ = [
    "NOT_ROUTED",
    "InferenceHandler",
    "SentResponse",
    "check_prediction",
    "decision_headers",
    "race_disconnect",
    "request_id_of",
]

log = logging.getLogger(__name__)


# ---- decision_headers ----


def decision_headers(*, hit_tokens: int | None = None, worker: str | None = None,
                     mode: str | None = None, reason: str | None = None,
                     attempts: int | None = None, pd: PDOutcome | None = None,
                     pd_failed: bool = False, reuse: Reuse | None = None
                     ) -> list[tuple[bytes, bytes]]:
    """The ``x-cortex-*`` headers of the fields given (``None``: the header is left out),
    in the order clients have always seen them. ``pd`` adds how a disaggregated model's
    request was served; ``pd_failed`` says it was not served at all; ``reuse`` adds
    ``x-cortex-reuse`` (the reuse accounting)."""
    headers: list[tuple[bytes, bytes]] = []
    if hit_tokens is not None:
        headers.append((b"x-cortex-cache-hit-tokens", str(hit_tokens).encode()))
    if worker is not None:
        headers.append((b"x-cortex-assigned-worker", worker.encode()))
    if mode is not None:
        headers.append((b"x-cortex-match-mode", mode.encode()))
    if reason is not None:
        headers.append((b"x-cortex-match-reason", reason.encode()))
    if attempts is not None:
        headers.append((b"x-cortex-attempts", str(attempts).encode()))
    if pd is not None:
        headers += [(b"x-cortex-pd", pd.mode.value.encode()),
                    (b"x-cortex-prefill-worker", (pd.prefill or "none").encode()),
                    (b"x-cortex-decode-worker", (pd.decode or "none").encode())]
    elif pd_failed:
        headers += [(b"x-cortex-pd", b"failed"), (b"x-cortex-prefill-worker", b"none"),
                    (b"x-cortex-decode-worker", b"none")]
    if reuse is not None:
        headers.append((b"x-cortex-reuse", reuse.header()))
    return headers


NOT_ROUTED = decision_headers(hit_tokens=0, worker="none", mode="none")
"""The headers of a request rejected before routing."""


# ---- inference ----


_ids = random.Random()  # request ids need to be unique, not unpredictable: no syscall each
_SSE_HEADERS: Headers = [
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


def request_id_of(request: Request) -> str:
    """The client's ``x-request-id`` when sane, else a fresh one (the same for the whole
    request)."""
    if request.request_id is not None:
        return request.request_id
    given = request.headers.get("x-request-id", "")
    if not (0 < len(given) <= 128 and given.isprintable()):
        given = f"{_ids.getrandbits(128):032x}"
    request.request_id = given
    return given


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class SentResponse:
    """Wraps ``send``: remembers the status of the response actually started, and whether
    its last body message went out (``ended``: a client that closes after that is done with
    the answer, not gone from it)."""

    __slots__ = ("ended", "send", "status")

    def __init__(self, send: Send) -> None:
        self.send = send
        self.status: int | None = None
        self.ended = False

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            self.ended = True  # before the send: the client may read it and close in it
        await self.send(message)


_RELAY = -1  # _handle's answer for a request to relay by load (nothing sent yet)

Relay = Callable[[Request, Send], Awaitable[None]]


class InferenceHandler:
    """``POST /v1/chat/completions``, ``/v1/completions``, ``/generate``, and
    ``/v1/messages`` / stateless ``/v1/responses`` (routed on the chat the engine converts
    them to; what that conversion does not model goes to ``relay``, by load).

    ``learn(response_id, worker_id)``: told the owner of every ``/v1/responses`` answer
    (follow-ups by ``previous_response_id`` are pinned to it)."""

    def __init__(self, gateway: Runtime, tracebacks: TracebackLimiter | None = None,
                 relay: Relay | None = None,
                 learn: Callable[[str, str], None] | None = None) -> None:
        self.gw = gateway
        self.metrics = gateway.metrics
        self.config = gateway.config
        self._tracebacks = tracebacks or TracebackLimiter()
        self.relay = relay
        self.learn = learn

    async def __call__(self, request: Request, send: Send, endpoint: InferencePath) -> None:
        started = time.perf_counter()
        request_id = request_id_of(request)
        base: Headers = [(b"x-request-id", request_id.encode())]
        sent = SentResponse(send)
        unanswered = 500  # an exception escapes: the app answers 500
        m = self.metrics
        try:
            if not await self._admitted(sent, base):
                return
            m.inflight.inc()
            try:
                unanswered = await self._handle(request, sent, endpoint, request_id, base,
                                                started)
            finally:
                m.inflight.dec()
                self.gw.admission.release()
        finally:
            status = sent.status if sent.status is not None else unanswered
            model = request.model or "unknown"
            if unanswered != _RELAY:
                m.child(m.requests, endpoint.value, str(status), model).inc()
                m.child(m.request_seconds, endpoint.value, model).observe(
                    time.perf_counter() - started)
        if unanswered == _RELAY and self.relay is not None:
            await self.relay(request, send)

    async def _admitted(self, send: Send, base: Headers) -> bool:
        """Wait for a slot (admission control); ``False`` when refused (answered)."""
        waited = time.perf_counter()
        try:
            await self.gw.admission.acquire()
        except GatewayError as exc:
            m = self.metrics
            m.rejected.labels(code=exc.code.value).inc()
            m.child(m.admission_rejected, exc.code.value).inc()
            await send_error(send, exc, [*base, *NOT_ROUTED])
            return False
        self.metrics.admission_wait_seconds.observe(time.perf_counter() - waited)
        return True

    async def _read_and_route(self, request: Request, endpoint: InferencePath, deadline: float
                     ) -> tuple[InferenceRequest, bytes, Routed]:
        """Read, validate and route the request; raises :class:`GatewayError` for what
        the client must fix (also what only surfaces while tokenizing)."""
        raw = await request.body(self.config.server.max_body_bytes)
        parse_ns = time.time_ns()
        req = self.gw.admit(endpoint, parse_body(raw))
        request.model = req.model.name
        try:
            route_ns = time.time_ns()
            session = session_of(request.headers, req.body, self.config.routing.sessions)
            routed = await self.gw.router.route(req, deadline, session=session)
            if request.span is not None:
                self._trace_routing(request.span, parse_ns, route_ns, routed)
            return req, raw, routed
        except RecursionError:
            raise ClientError("the request is nested too deeply") from None
        except (TypeError, UnicodeError):
            # the tokenizer refuses input validation let through: the client's to fix, but
            # worth a look (a bug would hide here as a 400)
            self._tracebacks.log(log, "prompt not tokenizable request_id=%s",
                                 request_id_of(request))
            raise ClientError("the prompt cannot be tokenized") from None

    def _trace_routing(self, span: Span, parse_ns: int, route_ns: int, routed: Routed) -> None:
        """The parse and routing stages as child spans (timed while they ran)."""
        tracing = self.gw.tracing
        assert tracing is not None
        tracing.record("parse", span, parse_ns, route_ns)
        at = route_ns
        timings = routed.timings
        decision = routed.decision
        for stage, seconds, attributes in (
                ("tokenize", timings.tokenize, {"cortex.prompt_tokens": routed.prompt_tokens}),
                ("hash", timings.hash, {"cortex.blocks": len(routed.keys)}),
                ("match", timings.match, {"cortex.match_source": routed.match_source}),
                ("score", timings.score, {"cortex.worker": decision.chosen.worker_id,
                                          "cortex.match_mode": decision.mode.value,
                                          "cortex.match_reason": decision.reason.value,
                                          "cortex.hit_tokens": decision.hit_tokens})):
            end = at + int(seconds * 1e9)
            tracing.record(stage, span, at, end, attributes)
            at = end

    async def _handle(self, request: Request, send: SentResponse, endpoint: InferencePath,
                      request_id: str, base: Headers, started: float) -> int:
        """Answer the request; returns the status to count when nothing was sent (499: the
        client went away)."""
        deadline = time.monotonic() + self.config.upstream.request_timeout_s
        try:
            req, raw, routed = await self._read_and_route(request, endpoint, deadline)
        except ClientDisconnected:
            self.metrics.client_disconnects.inc()
            return 499
        except GatewayError as exc:
            self.metrics.rejected.labels(code=exc.code.value).inc()
            await send_error(send, exc, [*base, *NOT_ROUTED])
            return exc.status
        except Unmodelled as why:
            if self.relay is None:
                raise
            log.debug("relayed by load request_id=%s: %s", request_id, why,
                      extra={"request_id": request_id})
            return _RELAY
        if log.isEnabledFor(logging.DEBUG):
            decision = routed.decision
            log.debug("routed request_id=%s worker=%s mode=%s reason=%s hit_tokens=%d",
                      request_id, decision.chosen.worker_id, decision.mode.value,
                      decision.reason.value, decision.hit_tokens,
                      extra={"request_id": request_id, "worker": decision.chosen.worker_id,
                             "mode": decision.mode.value})
        try:
            body = upstream_body(req, raw)
            exchange = _Conversation(self.gw, req, routed, body, request_id, base, send, deadline,
                                 started, request, self.learn)
            if await race_disconnect(request.receive, exchange.run(),
                                     ended=lambda: send.ended or exchange.answered):
                self.metrics.client_disconnects.inc()
                log.info("client disconnected request_id=%s worker=%s", request_id,
                         exchange.worker_id, extra={"request_id": request_id,
                                                    "worker": exchange.worker_id})
                return 499
            return exchange.status
        finally:
            routed.placement.dispatched()  # if it never was: the routed load ends here


async def race_disconnect(receive: Receive, work: Coroutine[Any, Any, None],
                          ended: Callable[[], bool] = lambda: False) -> bool:
    """Run ``work`` in this task until done or the client disconnects (then cancel it);
    ``True`` if the client went away first. A disconnect once the answer has ``ended`` (its
    last byte sent: the client read ``[DONE]`` and closed) cancels nothing: ``work`` finishes
    its bookkeeping.

    Only the watcher is a task of its own: ``work`` runs inline, and a disconnect cancels
    this task, which its ``uncancel`` then takes back. A cancellation from elsewhere (the
    server going away) propagates."""
    task = asyncio.current_task()
    assert task is not None
    gone = False

    def on_disconnect(watcher: asyncio.Future[None]) -> None:
        nonlocal gone
        if not watcher.cancelled() and watcher.exception() is None and not ended():
            gone = True
            task.cancel()

    watcher = asyncio.ensure_future(_wait_disconnect(receive))
    watcher.add_done_callback(on_disconnect)
    try:
        await work
    except asyncio.CancelledError:
        if gone and task.uncancel() == 0:
            return True
        raise
    finally:
        watcher.remove_done_callback(on_disconnect)
        watcher.cancel()
    if gone:  # the work swallowed the cancellation: take the request back all the same
        task.uncancel()
    return gone


class _Conversation:
    """One request's conversation with its worker(s), inside the disconnect race."""

    def __init__(self, gw: Runtime, req: InferenceRequest, routed: Routed, body: bytes,
                 request_id: str, base: Headers, send: Send, deadline: float,
                 started: float, request: Request,
                 learn: Callable[[str, str], None] | None = None) -> None:
        self.gw = gw
        self.learn = learn if req.endpoint is InferencePath.RESPONSES else None
        self.request = request
        self.req = req
        self.routed = routed
        self.body = body
        self.request_id = request_id
        self.base = base
        self.send = send
        self.deadline = deadline
        self.started = started  # request arrival, perf_counter seconds
        self.status = 200
        self.worker_id = routed.decision.chosen.worker_id
        self.delivered: int | None = None  # the engine's cached tokens, once read
        # the stream's last event went out: a client that closes now has read its answer
        # (the chunked end and the bookkeeping after it are ours to finish)
        self.answered = False

    def _headers(self, opened: Opened | None) -> Headers:
        decision = self.routed.decision
        if opened is not None:
            worker, hit = opened.worker.id, opened.hit_tokens
            decision = opened.decision or decision
        else:
            worker = decision.chosen.worker_id
            hit = self.routed.credited_tokens(worker)
        return [*self.base, *decision_headers(
            hit_tokens=hit, worker=worker, mode=decision.mode.value,
            reason=decision.reason.value, attempts=opened.attempts if opened else 0,
            pd=opened.pd if opened is not None else None, reuse=self._reuse(opened))]

    def _reuse(self, opened: Opened | None) -> Reuse:
        """The request's reuse accounting where it is served (``opened``; before that: the
        decision's choice), with what the engine delivered once the answer said."""
        decision, hit = self.routed.decision, None
        if opened is not None:
            decision, hit = opened.decision or decision, opened.hit_tokens
        reuse = reuse_of(decision, self._cache_worker(opened), hit)
        return reuse if self.delivered is None else reuse.with_delivered(self.delivered)

    def _cache_worker(self, opened: Opened | None) -> str:
        """The worker whose cache the prompt met: the one that served, or a pair's prefill
        worker (before an answer: the decision's choice)."""
        if opened is None:
            return self.routed.decision.chosen.worker_id
        pd = opened.pd
        return pd.prefill if pd is not None and pd.prefill else opened.worker.id

    async def run(self) -> None:
        dispatcher = self.gw.dispatcher
        opened: Opened | None = None
        streaming = False
        loop_deadline = asyncio.get_running_loop().time() + (self.deadline - time.monotonic())
        try:
            async with asyncio.timeout_at(loop_deadline):
                opened = await self._open(dispatcher)
                self.worker_id = opened.worker.id
                response = opened.response
                if response.status != 200:  # refused: in the gateway's error shape
                    self.status, error = relayed_error(response.status, opened.head)
                    await send_bytes(self.send, self.status, error, b"application/json",
                                     self._headers(opened))
                    return
                if not self.req.stream:
                    answer = (opened.answer if opened.answer is not None
                              else _json_or_none(opened.head))
                    self._truth_check(opened, answer)  # its delivered tokens in the headers
                    await send_bytes(self.send, 200, opened.head,
                                     response.content_type.encode(), self._headers(opened))
                    self._first_byte_sent("false", opened)
                    if self.req.endpoint in AGENT_PATHS:
                        self._learn_owner(_response_id(answer), opened)
                    else:
                        self._tokenization.feed_answer(self.req, obj=answer)
                    return
                streaming = True
                if self.req.endpoint in AGENT_PATHS:
                    await self._stream_named(opened)
                else:
                    await self._stream(opened)
        except TimeoutError:
            self.status = 504
            if streaming:
                await self._end_stream(self._stream_error(
                    504, "the request timed out", ErrorCode.UPSTREAM_TIMEOUT))
            else:
                await send_error(self.send, GatewayError(
                    "the worker did not answer in time", code=ErrorCode.UPSTREAM_TIMEOUT,
                    status=504), self._headers(opened))
        except UpstreamFailure as failure:  # after the first byte: never retried
            assert opened is not None
            self.status = 502
            dispatcher.failed_midstream(opened, failure)
            log.warning("worker failed mid-stream worker=%s request_id=%s: %s", opened.worker.id,
                        self.request_id, failure, extra={"worker": opened.worker.id,
                                                         "request_id": self.request_id})
            if failure.kind is FailureKind.TIMEOUT:  # went silent: the request is cancelled
                event = self._stream_error(504, "the worker stopped sending",
                                           ErrorCode.UPSTREAM_TIMEOUT)
            else:
                event = self._stream_error(502, "the worker failed while streaming",
                                           ErrorCode.UPSTREAM_STREAM_ERROR)
            await self._end_stream(event)
        except GatewayError as exc:
            self.status = exc.status
            await send_error(self.send, exc, self._headers(opened) if opened else
                             [*self.base, *self._not_sent()])
        finally:
            if opened is not None:
                opened.close()

    async def _open(self, dispatcher: Dispatcher) -> Opened:
        """Dispatch up to the first byte, under an ``upstream`` client span when traced
        (its context goes upstream), else passing the client's trace context on."""
        tracing, parent = self.gw.tracing, self.request.span
        if tracing is None or parent is None:
            return await dispatcher.open(self.req, self.routed, self.body, self.request_id,
                                         trace_headers(self.request.headers))
        span = tracing.start("upstream", parent=parent, kind=SpanKind.CLIENT)
        try:
            opened = await dispatcher.open(self.req, self.routed, self.body, self.request_id,
                                           tracing.headers(span))
            span.set_attributes({"cortex.worker": opened.worker.id,
                                 "cortex.attempts": opened.attempts,
                                 "http.response.status_code": opened.response.status})
            return opened
        except BaseException as exc:
            span.set_status(StatusCode.ERROR, type(exc).__name__)
            raise
        finally:
            span.end()  # the first byte (or the failure): what the span times

    def _not_sent(self) -> Headers:
        return decision_headers(hit_tokens=0, worker="none",
                                mode=self.routed.decision.mode.value,
                                pd_failed=self.routed.pd is not None)

    async def _stream(self, opened: Opened) -> None:
        send = self.send
        req = self.req
        tokenization = self._tokenization
        forwarder = SSEForwarder(strip_usage=not req.wants_usage
                                 and req.endpoint is not InferencePath.GENERATE,
                                 rewrite=opened.rewrite,
                                 keep_bytes=tokenization.config.feed_max_bytes
                                 if tokenization.config.feed_answers else 0)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [*_SSE_HEADERS, *self._headers(opened)]})
        write = body_writer(self.request.scope)
        first = True
        out = _checked(forwarder, opened.head)
        if out:
            if not write(out):  # joined to the headers, in one send
                await send({"type": "http.response.body", "body": out, "more_body": True})
            self._first_byte_sent("true", opened)
            first = False
        idle_s = Timeouts.of(req.model, self.gw.config.upstream).stream_idle_s
        progressed = self._dispatcher.watch.progressed
        worker_id = opened.worker.id
        async for chunk in opened.response.chunks(idle_s):
            progressed(worker_id)
            out = _checked(forwarder, chunk)
            if out:
                self.answered = forwarder.done  # before the send: the client may close in it
                if not write(out):
                    await send({"type": "http.response.body", "body": out, "more_body": True})
                if first:
                    self._first_byte_sent("true", opened)
                    first = False
        tail = forwarder.finish()
        if not forwarder.done:
            if tail:
                await send({"type": "http.response.body", "body": tail, "more_body": True})
            raise UpstreamFailure(FailureKind.DISCONNECT, "stream ended without [DONE]")
        await send({"type": "http.response.body", "body": tail, "more_body": False})
        holder = forwarder.usage_holder
        self._truth_check(opened, holder)
        tokenization.feed_answer(req, events=forwarder.kept)

    async def _stream_named(self, opened: Opened) -> None:
        """A Messages / Responses stream: relayed untouched, its usage checked at the end."""
        send = self.send
        events = NamedEventStream()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [*_SSE_HEADERS, *self._headers(opened)]})
        first = True
        idle_s = Timeouts.of(self.req.model, self.gw.config.upstream).stream_idle_s
        progressed = self._dispatcher.watch.progressed
        worker_id = opened.worker.id

        async def chunks() -> AsyncIterator[bytes]:
            if opened.head:
                yield opened.head
            async for chunk in opened.response.chunks(idle_s):
                progressed(worker_id)
                yield chunk

        write = body_writer(self.request.scope)
        async for chunk in chunks():
            out = events.feed(chunk)
            if events.malformed:
                raise UpstreamFailure(FailureKind.BAD_ANSWER,
                                      "an event that is not the engines' SSE")
            self.answered = events.done
            if out and not write(out):
                await send({"type": "http.response.body", "body": out, "more_body": True})
            if first:
                self._first_byte_sent("true", opened)
                first = False
            if events.response_id is not None:
                self._learn_owner(events.response_id, opened)
        if not events.done:
            raise UpstreamFailure(FailureKind.DISCONNECT, "stream ended before its last event")
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        self._truth_check(opened, events.usage_holder)

    def _learn_owner(self, response_id: str | None, opened: Opened) -> None:
        """Remember the worker holding a ``/v1/responses`` answer (once)."""
        if self.learn is not None and response_id is not None:
            self.learn(response_id, opened.worker.id)
            self.learn = None

    @property
    def _dispatcher(self) -> Dispatcher:
        dispatcher = self.gw.dispatcher
        assert dispatcher is not None
        return dispatcher

    @property
    def _tokenization(self) -> Tokenization:
        router = self.gw.router
        return router.tokenization

    def _first_byte_sent(self, stream: str, opened: Opened) -> None:
        """The client has the answer's first bytes (a stream's first event): TTFT."""
        decision = opened.decision or self.routed.decision
        metrics = self.gw.metrics
        metrics.child(metrics.ttft, self.req.model.name, stream, decision.mode.value).observe(
            time.perf_counter() - self.started)

    def _stream_error(self, status: int, message: str, code: ErrorCode) -> bytes:
        """The in-stream error event of this request's API (a Messages stream ends with an
        Anthropic ``error`` event; the others with an OpenAI error chunk and ``[DONE]``)."""
        if self.req.endpoint is InferencePath.MESSAGES:
            return anthropic_error_event(status, message)
        return sse_error_event(message, code.value)

    async def _end_stream(self, data: bytes) -> None:
        await self.send({"type": "http.response.body", "body": data, "more_body": False})

    def _truth_check(self, opened: Opened, obj: Any) -> None:
        """Compare the engine's cached tokens with the hit the gateway predicted; count the
        reuse accounting (and put it in the access log)."""
        predicted = opened.hit_tokens
        outcome, actual = check_prediction(self.gw.metrics, self.req.model.reports_cached_tokens,
                                           predicted, obj)
        self.delivered = actual
        reuse = self._reuse(opened)
        worker = self._cache_worker(opened)
        count_reuse(self.gw.metrics, self.req.model.name, worker, reuse,
                    self.routed.prompt_tokens)
        self.request.log_fields.update(reuse.log_fields())
        agents = self.routed.agents
        if agents is not None and worker != self.routed.decision.chosen.worker_id:
            agents.served_by(worker)  # a fallback: the session lives there now
        if outcome == "over":
            log.info("cache hit over-predicted worker=%s request_id=%s predicted=%d actual=%d",
                     opened.worker.id, self.request_id, predicted, actual,
                     extra={"worker": opened.worker.id, "request_id": self.request_id})


def check_prediction(metrics: GatewayMetrics, reports_cached_tokens: bool, predicted: int,
                     answer: Any) -> tuple[str, int | None]:
    """Count the engine's cached prompt tokens in ``answer`` (a response object) against the
    ``predicted`` hit (tokens): the outcome (``exact``, ``over``, ``under``, ``unknown``)
    and the engine's number."""
    actual = cached_tokens_of(answer)
    if actual is None and isinstance(answer, dict) and isinstance(answer.get("usage"), dict):
        if reports_cached_tokens:
            actual = 0  # engines omit the details when nothing was cached
    if actual is None:
        metrics.child(metrics.prediction, "unknown").inc()
        return "unknown", None
    metrics.predicted_tokens.inc(predicted)
    metrics.actual_tokens.inc(actual)
    if predicted > actual:
        metrics.child(metrics.prediction, "over").inc()
        metrics.overpredicted_tokens.observe(predicted - actual)
        return "over", actual
    if predicted < actual:
        metrics.child(metrics.prediction, "under").inc()
        metrics.underpredicted_tokens.observe(actual - predicted)
        return "under", actual
    metrics.child(metrics.prediction, "exact").inc()
    return "exact", actual


def _checked(forwarder: SSEForwarder, chunk: bytes) -> bytes:
    """``forwarder.feed(chunk)``; :class:`UpstreamFailure` (``bad_answer``) when the worker
    sent something that is not the engines' SSE (the bad event is never relayed)."""
    out = forwarder.feed(chunk)
    if forwarder.malformed:
        raise UpstreamFailure(FailureKind.BAD_ANSWER, "an event that is not the engines' SSE")
    return out


def _response_id(answer: Any) -> str | None:
    found = answer.get("id") if isinstance(answer, dict) else None
    return found if isinstance(found, str) and 0 < len(found) <= 256 else None


def _json_or_none(data: bytes) -> Any:
    try:
        return json_loads(data)
    except ValueError:
        return None
