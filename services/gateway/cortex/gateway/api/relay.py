"""Passthrough: requests the gateway forwards without tokenizing or KV/PD decisions.

Three kinds: the endpoints it does not route by cache (``/v1/embeddings``, ``/v1/rerank``,
``/v1/score``); the ``/v1/messages`` and ``/v1/responses`` requests :meth:`RelayHandler.by_load`
keeps from exact routing (follow-ups by ``previous_response_id``, prefill/decode fleets, and
what the chat conversion does not model); and every inference request of a model
configured ``passthrough`` (an upstream scheduler places them: single scheduling authority).
Either goes to the least loaded routable worker of the body's ``model`` (the model's
``upstream_url`` when set), retried on the next one while nothing was answered; a 200 that
breaks the endpoint's promise (a JSON answer that is not JSON, a streamed request answered
otherwise than with SSE) is a worker failure like any (``bad_answer``: counted, breaker,
retried; a fixed ``upstream_url`` is counted as worker ``upstream``, without a breaker); the
answer is relayed as it comes, with ``x-cortex-match-mode: passthrough``, a
stream checked event by event: one that breaks off SSE later is a counted failure too, ended
with an ``upstream_stream_error`` event (garbage is never relayed).

The engines keep a ``/v1/responses`` response in process memory, so everything about it goes
where it was produced: :class:`ResponseOwners` learns ``id → worker`` from the answers (JSON
or the stream's first events) and pins follow-ups (``previous_response_id``),
``GET /v1/responses/{id}`` and ``POST /v1/responses/{id}/cancel``. An id this gateway did not
see answered (another replica relayed it, or this one restarted) is looked for: up to
:data:`OWNER_PROBES` routable workers (of the body's model, where known) are asked
``GET /v1/responses/{id}`` at once, and the first that answers it is its owner
(:meth:`RelayHandler.find_owner`); none → the follow-up goes by load, a ``GET`` is a 404.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import urllib.parse
from collections import OrderedDict
from collections.abc import AsyncIterator, Collection, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

from cortex.gateway.api.inference import SentResponse, race_disconnect, request_id_of
from cortex.gateway.config.gateway import ModelConfig, Timeouts
from cortex.gateway.dispatch.attempt import acquire_slot, release_slot
from cortex.gateway.errors import (
    ClientError,
    ErrorCode,
    GatewayError,
    ServiceUnavailable,
    UpstreamError,
    relayed_error,
)
from cortex.gateway.fleet.pool import WorkerState
from cortex.gateway.http.asgi import Send
from cortex.gateway.http.h1 import BodyWriter, body_writer
from cortex.gateway.http.messages import (
    ClientDisconnected,
    Headers,
    Request,
    json_loads,
    send_bytes,
    send_error,
)
from cortex.gateway.request.payload import parse_body
from cortex.gateway.runtime import Runtime
from cortex.gateway.upstream.client import FailureKind, Response, UpstreamFailure
from cortex.gateway.upstream.sse import EventStreamCheck, is_event_stream, sse_error_event
from cortex.registry import WorkerRole
from cortex.telemetry.tracing import Span, SpanKind, trace_headers

__all__ = ["RELAYED_PATHS", "RelayHandler", "ResponseOwners", "least_loaded", "response_id_of"]

log = logging.getLogger(__name__)

RELAYED_PATHS = ("/v1/embeddings", "/v1/rerank", "/v1/score")
_SNIFF_BYTES = 64 * 1024  # a stream's response id is in its first event: look no further
_FORWARDED = ("accept", "anthropic-version", "anthropic-beta")
_MODE = (b"x-cortex-match-mode", b"passthrough")


OWNER_PROBES = 16
"""Workers asked at most for the owner of a response id this gateway has not seen."""
OWNER_PROBE_TIMEOUT_S = 2.0
"""How long those questions may take together."""


class ResponseOwners:
    """Response id → the worker that holds it, the ``capacity`` most recent (LRU)."""

    def __init__(self, capacity: int = 100_000) -> None:
        self.capacity = capacity
        self._owners: OrderedDict[str, str] = OrderedDict()

    def learn(self, response_id: str, worker_id: str) -> None:
        self._owners[response_id] = worker_id
        self._owners.move_to_end(response_id)
        while len(self._owners) > self.capacity:
            self._owners.popitem(last=False)

    def owner(self, response_id: str) -> str | None:
        found = self._owners.get(response_id)
        if found is not None:
            self._owners.move_to_end(response_id)
        return found

    def __len__(self) -> int:
        return len(self._owners)

    def __repr__(self) -> str:
        return f"ResponseOwners({len(self._owners)}/{self.capacity})"


def response_id_of(obj: Any) -> str | None:
    """The response id of a Responses API object or stream event (``response.created``)."""
    if isinstance(obj, dict) and isinstance(obj.get("response"), dict):
        obj = obj["response"]
    found = obj.get("id") if isinstance(obj, dict) else None
    return found if isinstance(found, str) and 0 < len(found) <= 256 else None


def _sniff_stream(data: bytes) -> str | None:
    """The first response id in SSE ``data:`` lines of ``data``."""
    for line in data.split(b"\n"):
        if line.startswith(b"data:"):
            try:
                found = response_id_of(json_loads(line[5:]))
            except ValueError:
                continue
            if found is not None:
                return found
    return None


def least_loaded(workers: Sequence[WorkerState], now: float, stale_after_s: float,
                 rng: random.Random) -> list[WorkerState]:
    """``workers`` by load, least first: running (ours or the engine's, the larger)
    plus waiting; ties in random order."""
    def load(w: WorkerState) -> tuple[int, float]:
        engine = w.fresh_engine_load(now, stale_after_s)
        running = max(w.inflight + w.pending, engine.running if engine else 0)
        return running + (engine.waiting if engine else 0), rng.random()
    return sorted(workers, key=load)


@dataclass(frozen=True, slots=True)
class _Target:
    url: str  # base URL
    worker: WorkerState | None  # None: the model's fixed upstream

    @property
    def name(self) -> str:
        return self.worker.id if self.worker is not None else "upstream"


class RelayHandler:
    """The passthrough endpoints, and inference requests of passthrough models."""

    def __init__(self, gateway: Runtime) -> None:
        self.gw = gateway
        self.metrics = gateway.metrics
        self.owners = ResponseOwners()
        self._rng = random.Random()

    # ---- entry points ----

    async def post(self, request: Request, send: Send) -> None:
        """``POST`` one of :data:`RELAYED_PATHS`: to a worker of the body's model."""
        await self._admitted(request, send, self._post(request, send))

    async def by_load(self, request: Request, passthrough: Collection[str]) -> bool:
        """Whether a ``/v1/messages`` or ``/v1/responses`` request is relayed by load rather
        than routed on its tokens: a follow-up by ``previous_response_id`` (its owner holds
        the history), a model configured ``passthrough``, a prefill/decode fleet (the
        disaggregated legs speak chat, not these APIs). A body that cannot be read or parsed
        is left to the routed path, which answers it."""
        try:
            body = parse_body(await request.body(self.gw.config.server.max_body_bytes))
        except (ClientDisconnected, GatewayError):
            return False
        model = body.get("model")
        if model in passthrough:
            return True
        if self.gw.config.pd.enabled and isinstance(model, str) and self.gw.pool.candidates(
                model, WorkerRole.PREFILL):
            return True
        return request.path == "/v1/responses" and body.get("previous_response_id") is not None

    async def responses_by_id(self, request: Request, send: Send) -> None:
        """``GET /v1/responses/{id}``, ``POST /v1/responses/{id}/cancel``: to its owner."""
        await self._admitted(request, send, self._by_id(request, send))

    async def passthrough(self, request: Request, send: Send) -> None:
        """An inference request (its body already read) of a ``passthrough`` model: relayed
        like the endpoints of :meth:`post`."""
        await self.post(request, send)

    # ---- the work ----

    async def _admitted(self, request: Request, send: Send,
                        work: Coroutine[Any, Any, int]) -> None:
        started = time.perf_counter()
        status = 500
        try:
            await self.gw.admission.acquire()
        except GatewayError as exc:
            work.close()
            self.metrics.child(self.metrics.admission_rejected, exc.code.value).inc()
            await send_error(send, exc, self._base(request))
            status = exc.status
        else:
            try:
                status = await work
            finally:
                self.gw.admission.release()
        finally:
            m = self.metrics
            endpoint = _endpoint_label(request.path)
            model = request.model or "unknown"
            m.child(m.requests, endpoint, str(status), model).inc()
            m.child(m.request_seconds, endpoint, model).observe(time.perf_counter() - started)

    def _base(self, request: Request) -> Headers:
        return [(b"x-request-id", request_id_of(request).encode()), _MODE]

    async def _post(self, request: Request, send: Send) -> int:
        try:
            raw = await request.body(self.gw.config.server.max_body_bytes)
            body = parse_body(raw)
            model = self._model_of(body)
            request.model = model.name
            pinned = None
            previous = body.get("previous_response_id")
            if request.path == "/v1/responses" and isinstance(previous, str):
                pinned = await self.find_owner(previous, model.name)
            targets = self._targets(model, pinned)
        except ClientDisconnected:
            return 499
        except GatewayError as exc:
            await send_error(send, exc, [*self._base(request), *_not_sent()])
            return exc.status
        stream = body.get("stream") is True
        return await self._relay(request, send, "POST", request.path, raw, model, targets,
                                 stream)

    async def _by_id(self, request: Request, send: Send) -> int:
        response_id = request.path.removeprefix("/v1/responses/").removesuffix("/cancel")
        owner = await self.find_owner(response_id, None)
        worker = self.gw.pool.get(owner) if owner is not None else None
        if worker is None:
            error = ClientError(f"no response {response_id!r} known here",
                                code=ErrorCode.NOT_FOUND, status=404)
            await send_error(send, error, [*self._base(request), *_not_sent()])
            return 404
        model = self.gw.config.model(worker.spec.model)
        request.model = model.name if model is not None else None
        return await self._relay(request, send, request.method, request.path,
                                 None if request.method == "GET" else b"{}", model,
                                 [_Target(worker.spec.url, worker)], stream=False)

    async def find_owner(self, response_id: str, model: str | None) -> str | None:
        """The worker holding ``response_id``: learned from its answer, else the first of
        up to :data:`OWNER_PROBES` routable workers (``model``'s, or any) whose
        ``GET /v1/responses/{id}`` answers it (then learned); ``None`` when none does."""
        known = self.owners.owner(response_id)
        if known is not None or not 0 < len(response_id) <= 256:
            return known
        pool = self.gw.pool
        workers = (pool.candidates(model) if model is not None else
                   [w for w in pool if w.spec.role is WorkerRole.REGULAR and w.routable()])
        workers = workers[:OWNER_PROBES]
        if not workers:
            return None
        path = "/v1/responses/" + urllib.parse.quote(response_id, safe="")
        asks = [asyncio.create_task(self._holds(w, path, response_id)) for w in workers]
        found = None
        try:
            for done in asyncio.as_completed(asks, timeout=OWNER_PROBE_TIMEOUT_S):
                worker = await done
                if worker is not None:
                    found = worker.id
                    break
        except TimeoutError:
            pass
        finally:
            for ask in asks:
                ask.cancel()
        m = self.metrics
        m.child(m.response_owner_probes, "found" if found is not None else "none").inc()
        if found is not None:
            self.owners.learn(response_id, found)
        return found

    async def _holds(self, worker: WorkerState, path: str, response_id: str
                     ) -> WorkerState | None:
        """``worker`` if its ``GET path`` answers the response ``response_id``."""
        try:
            response = await self.gw.upstream.request(
                "GET", worker.spec.url.rstrip("/") + path, None,
                {"Accept": "application/json"}, worker.spec)
        except UpstreamFailure:
            return None
        try:
            if response.status != 200:
                return None
            return worker if response_id_of(json_loads(await response.read())) == \
                response_id else None
        except (UpstreamFailure, ValueError):
            return None
        finally:
            response.close()

    def _model_of(self, body: dict[str, Any]) -> ModelConfig:
        name = body.get("model")
        if not isinstance(name, str) or not name:
            raise ClientError("model: required", param="model")
        model = self.gw.config.model(name)
        if model is None:
            raise ClientError(f"the model {name!r} does not exist",
                              code=ErrorCode.MODEL_NOT_FOUND, status=404, param="model")
        return model

    def _targets(self, model: ModelConfig, pinned: str | None) -> list[_Target]:
        if model.upstream_url is not None:
            return [_Target(model.upstream_url, None)]
        if pinned is not None:
            worker = self.gw.pool.get(pinned)
            if worker is not None and worker.routable():
                return [_Target(worker.spec.url, worker)]
        workers = least_loaded(self.gw.pool.candidates(model.name), time.monotonic(),
                               self.gw.config.routing.load_stale_after_s, self._rng)
        if not workers:
            raise ServiceUnavailable(f"no available worker for the model {model.name!r}")
        return [_Target(w.spec.url, w) for w in workers]

    async def _relay(self, request: Request, send: Send, method: str, path: str,
                     body: bytes | None, model: ModelConfig | None, targets: list[_Target],
                     stream: bool) -> int:
        """Open the first target that answers, relay its answer; the status sent."""
        headers = {"Content-Type": "application/json",
                   "X-Request-Id": request_id_of(request)}
        for name in _FORWARDED:
            if name in request.headers:
                headers[name] = request.headers[name]
        tracing = self.gw.tracing
        span = None
        if tracing is not None and request.span is not None:
            span = tracing.start("upstream", parent=request.span, kind=SpanKind.CLIENT)
            headers.update(tracing.headers(span))
        else:
            headers.update(trace_headers(request.headers))
        try:
            return await self._relay_traced(request, send, method, path, body, model,
                                            targets, stream, headers, span)
        finally:
            if span is not None and span.is_recording():  # not ended at the first byte
                span.end()

    async def _relay_traced(self, request: Request, send: Send, method: str, path: str,
                            body: bytes | None, model: ModelConfig | None,
                            targets: list[_Target], stream: bool, headers: dict[str, str],
                            span: Span | None) -> int:
        """:meth:`_relay` once the headers are set (``span``: the upstream span)."""
        upstream_cfg = self.gw.config.upstream
        timeouts = Timeouts.of(model, upstream_cfg) if model is not None else Timeouts(
            upstream_cfg.first_byte_timeout_s, upstream_cfg.response_timeout_s,
            upstream_cfg.stream_idle_timeout_s)
        opened: tuple[_Target, Response, int | None, bytes] | None = None
        last: UpstreamFailure | None = None
        for attempt, target in enumerate(targets[:upstream_cfg.max_attempts]):
            if attempt:
                self.metrics.retries.labels(reason=last.kind.value if last else "unknown").inc()
            result = await self._attempt(target, method, path, body, headers, timeouts,
                                         stream)
            if isinstance(result, UpstreamFailure):
                last = result
                continue
            opened = (target, *result)
            break
        base = [*self._base(request)]
        if opened is None:
            error = (UpstreamError("the worker did not answer in time",
                                   code=ErrorCode.UPSTREAM_TIMEOUT, status=504)
                     if last is not None and last.kind is FailureKind.TIMEOUT
                     else UpstreamError("the worker failed to answer"))
            await send_error(send, error, [*base, *_not_sent()])
            return error.status
        target, response, slot, head = opened
        if span is not None:
            span.set_attributes({"cortex.worker": target.name,
                                 "http.response.status_code": response.status})
            span.end()  # the first byte: what the span times
        base += [(b"x-cortex-assigned-worker", target.name.encode()),
                 (b"x-cortex-cache-hit-tokens", b"0")]
        try:
            answer = SentResponse(send)
            gone = await race_disconnect(request.receive, self._answer(
                answer, target, response, head, base, path, stream, timeouts.stream_idle_s,
                body_writer(request.scope)), ended=lambda: answer.ended)
            return 499 if gone else response.status
        finally:
            response.close()
            if target.worker is not None and slot is not None:
                release_slot(target.worker, self.metrics, slot)

    async def _attempt(self, target: _Target, method: str, path: str, body: bytes | None,
                       headers: dict[str, str], timeouts: Timeouts, stream: bool
                       ) -> tuple[Response, int | None, bytes] | UpstreamFailure:
        """Send to ``target`` and wait for its headers, and for a 200 its first bytes
        (:func:`checked_head`); a retryable status or a broken 200 is a failure."""
        first_byte_s = timeouts.first_byte_s
        worker = target.worker
        slot = None
        if worker is not None:
            worker.breaker.on_attempt()
            slot = acquire_slot(worker, self.metrics)
        response: Response | None = None
        try:
            async with asyncio.timeout(first_byte_s):
                response = await self.gw.upstream.request(
                    method, target.url.rstrip("/") + path, body, headers,
                    worker.spec if worker is not None else None)
            if response.status in self.gw.config.upstream.retry_statuses:
                await response.read()
                raise UpstreamFailure(FailureKind.STATUS, f"status {response.status}",
                                      response.status)
            head = b""
            if response.status == 200:
                async with asyncio.timeout(timeouts.first_byte_s if stream
                                           else timeouts.response_s):
                    head = await checked_head(response, stream)
        except (UpstreamFailure, TimeoutError) as exc:
            failure = exc if isinstance(exc, UpstreamFailure) else UpstreamFailure(
                FailureKind.TIMEOUT, f"no answer in {first_byte_s}s")
            if response is not None:
                response.close()
            if worker is not None and slot is not None:
                release_slot(worker, self.metrics, slot)
                worker.breaker.on_failure()
            # a fixed upstream_url is counted too, as worker "upstream" (it has no breaker)
            self.metrics.worker(self.metrics.upstream_errors, target.name,
                                failure.kind.value).inc()
            log.info("passthrough attempt failed worker=%s: %s", target.name, failure,
                     extra={"worker": target.name})
            return failure
        except BaseException:
            if response is not None:
                response.close()
            if worker is not None and slot is not None:
                release_slot(worker, self.metrics, slot)
                worker.breaker.on_abandon()
            raise
        if worker is not None:
            worker.breaker.on_success()
        return response, slot, head

    async def _answer(self, send: Send, target: _Target, response: Response,
                      head: bytes, base: Headers, path: str, stream: bool, idle_s: float,
                      write: BodyWriter) -> None:
        if response.status >= 500:
            try:
                body = await response.read()
            except UpstreamFailure:  # cut, or over upstream.max_answer_bytes: no message
                body = b""
            status, error = relayed_error(response.status, body)
            await send_bytes(send, status, error, b"application/json", base)
            return
        owner = target.worker if response.status == 200 and path == "/v1/responses" else None
        await send({"type": "http.response.start", "status": response.status,
                    "headers": [(b"content-type", response.content_type.encode("latin-1")),
                                *base]})
        seen = b""
        check = EventStreamCheck() if stream and response.status == 200 else None
        try:
            async for chunk in _chained(head, response, idle_s if stream else None):
                if check is not None and not check.feed(chunk):
                    raise UpstreamFailure(FailureKind.BAD_ANSWER, "a stream that broke off SSE")
                if owner is not None and len(seen) < _SNIFF_BYTES:
                    seen += chunk
                    found = _sniff_stream(seen) if stream else None
                    if found is not None:
                        self.owners.learn(found, owner.id)
                        owner = None
                if not write(chunk):
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except UpstreamFailure as failure:  # after the first byte: the answer is cut short
            log.warning("worker failed mid-answer worker=%s: %s", target.name, failure,
                        extra={"worker": target.name})
            if target.worker is not None:
                target.worker.breaker.on_failure()
            self.metrics.worker(self.metrics.upstream_errors, target.name,
                                failure.kind.value).inc()
            if stream:  # a stream ends with an error event, as on the routed path
                await send({"type": "http.response.body", "more_body": True,
                            "body": sse_error_event("the worker failed while streaming",
                                                    ErrorCode.UPSTREAM_STREAM_ERROR.value)})
        if owner is not None and not stream:
            try:
                found = response_id_of(json_loads(seen))
            except ValueError:
                found = None
            if found is not None:
                self.owners.learn(found, owner.id)
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    def __repr__(self) -> str:
        return f"RelayHandler({self.owners!r})"


async def checked_head(response: Response, stream: bool) -> bytes:
    """The first bytes of a 200, which must keep the endpoint's promise — a streamed
    request's must be the engines' SSE, a JSON answer's must open a JSON object or array
    (what every relayed endpoint answers; the rest is relayed as it comes, unbuffered) —
    else :class:`UpstreamFailure` ``bad_answer`` (retried: nothing was relayed yet). Other
    content types (none of the relayed endpoints promises one) pass unread."""
    if stream and not response.content_type.startswith("text/event-stream"):
        raise UpstreamFailure(FailureKind.BAD_ANSWER,
                              f"a {response.content_type!r} answer to a streamed request")
    if not stream and not response.content_type.startswith("application/json"):
        return b""
    head = b""
    async with contextlib.aclosing(response.chunks()) as chunks:
        async for chunk in chunks:
            head += chunk
            start = head.lstrip()[:1]
            if stream and not is_event_stream(head):
                raise UpstreamFailure(FailureKind.BAD_ANSWER, "a stream that is not SSE")
            if stream or start:
                if not stream and start not in (b"{", b"["):
                    raise UpstreamFailure(FailureKind.BAD_ANSWER,
                                          "a 200 application/json that is not JSON")
                return head
    if stream:
        raise UpstreamFailure(FailureKind.DISCONNECT, "stream ended before any byte")
    raise UpstreamFailure(FailureKind.BAD_ANSWER, "an empty 200 application/json")


async def _chained(head: bytes, response: Response, idle_s: float | None
                   ) -> AsyncIterator[bytes]:
    """``head`` (already read by :func:`checked_head`), then the rest of the answer."""
    if head:
        yield head
    async for chunk in response.chunks(idle_s):
        yield chunk


def _endpoint_label(path: str) -> str:
    if path.startswith("/v1/responses/"):
        return "/v1/responses/{id}/cancel" if path.endswith("/cancel") else "/v1/responses/{id}"
    return path


def _not_sent() -> Headers:
    return [(b"x-cortex-assigned-worker", b"none"), (b"x-cortex-cache-hit-tokens", b"0")]
