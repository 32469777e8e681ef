"""The endpoint picker: one Envoy ``ext_proc`` stream per HTTP request, answered by Cortex's
own routing (the Gateway API Inference Extension's Endpoint Picker protocol).

Envoy sends the request headers, then the body (``BUFFERED``: one message; or
``FULL_DUPLEX_STREAMED``: chunks, which the picker must send back). Once the body is whole
the picker parses it as the gateway would (:func:`parse_request`), routes it with the
gateway's :class:`~cortex.gateway.routing.router.Router` (tokenize, ledger match, score) and answers
with the chosen worker and its fallbacks, best first, as ``ip:port,ip:port,…`` in the
``x-gateway-destination-endpoint`` header and in the ``envoy.lb`` dynamic metadata (the same
string). A subset hint (``envoy.lb.subset_hint`` / ``x-gateway-destination-endpoint-subset``
in the request's metadata) restricts the choice; nothing eligible → 503, a full gateway
(admission) → 429, a bad request → 400, as immediate responses with an OpenAI error body.

On the response, Envoy reports the endpoint that served (``envoy.lb`` /
``x-gateway-destination-endpoint-served``, or Envoy's ``upstream.address`` attribute): the
blocks the decision credited move there when a fallback served. The request counts as load
on its worker (and holds an admission slot) until the response ends or the stream closes.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any
from urllib.parse import urlsplit

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from cortex.gateway.api.inference import check_prediction, decision_headers
from cortex.gateway.errors import ClientError, ErrorCode, GatewayError, ServiceUnavailable
from cortex.gateway.request.payload import InferencePath, parse_body
from cortex.gateway.routing.placement import session_of
from cortex.gateway.routing.router import Routed
from cortex.gateway.routing.scoring import count_reuse, reuse_of
from cortex.gateway.runtime import Runtime
from cortex.registry.spec import WorkerRole, WorkerSpec

__all__ = ["DESTINATION", "LB_NAMESPACE", "SERVED", "SUBSET", "SUBSET_NAMESPACE",
           "PickerStream", "address_of"]

log = logging.getLogger(__name__)

LB_NAMESPACE = "envoy.lb"
DESTINATION = "x-gateway-destination-endpoint"
SERVED = "x-gateway-destination-endpoint-served"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET = "x-gateway-destination-endpoint-subset"
UPSTREAM_ADDRESS = "upstream.address"
MAX_ENDPOINTS = 4
"""Endpoints named per request: the choice and up to three fallbacks (Envoy's retries)."""
ANSWER_BYTES = 1 << 20
"""Answer bytes kept to find the engine's usage (a larger answer counts as ``unknown``)."""

_Mode = processing_mode_pb2.ProcessingMode
_CONTINUE_AND_REPLACE = ext.CommonResponse.CONTINUE_AND_REPLACE


def address_of(spec: WorkerSpec) -> str:
    """The worker's ``ip:port`` as Envoy names an endpoint (``[v6]:port`` for IPv6)."""
    parts = urlsplit(spec.url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    host = parts.hostname or ""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class Phase(StrEnum):
    HEADERS = "headers"  # waiting for the request headers
    BODY = "body"  # reading the request body
    PICKED = "picked"  # routed; the response may follow
    DONE = "done"  # refused, or the response ended


@dataclass(frozen=True, slots=True)
class _Picked:
    routed: Routed | None
    workers: tuple[WorkerSpec, ...]

    @property
    def destination(self) -> str:
        return ",".join(address_of(w) for w in self.workers)


def _header(headers: base_pb2.HeaderMap, name: str) -> str:
    for h in headers.headers:
        if h.key.lower() == name:
            return h.raw_value.decode("utf-8", "replace") if h.raw_value else str(h.value)
    return ""


def _struct_value(metadata: base_pb2.Metadata, namespace: str, key: str) -> Any:
    """A value of the request's filter metadata as plain Python, ``None`` when absent."""
    if namespace not in metadata.filter_metadata:
        return None
    fields = metadata.filter_metadata[namespace].fields
    if key not in fields:
        return None
    value = fields[key]
    kind = value.WhichOneof("kind")
    if kind == "list_value":
        return [v.string_value for v in value.list_value.values]
    return value.string_value if kind == "string_value" else None


def _served_address(req: ext.ProcessingRequest) -> str | None:
    """The endpoint that served, as the data plane reports it: the protocol's
    ``envoy.lb`` / ``x-gateway-destination-endpoint-served`` metadata, else Envoy's own
    ``upstream.address`` attribute (``response_attributes`` of the ext_proc filter)."""
    served = _struct_value(req.metadata_context, LB_NAMESPACE, SERVED)
    if isinstance(served, str) and served:
        return str(served)
    for attributes in req.attributes.values():
        value = attributes.fields.get(UPSTREAM_ADDRESS)
        if value is not None and value.WhichOneof("kind") == "string_value" and value.string_value:
            return str(value.string_value)
    return None


def _set_headers(pairs: Iterable[tuple[str, str]]) -> ext.HeaderMutation:
    return ext.HeaderMutation(set_headers=[
        base_pb2.HeaderValueOption(
            header=base_pb2.HeaderValue(key=k, raw_value=v.encode()),
            append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)
        for k, v in pairs])


def immediate(error: GatewayError) -> ext.ProcessingResponse:
    """The OpenAI error answer Envoy sends the client instead of forwarding the request."""
    headers = [("content-type", "application/json")] + [
        (k.decode(), v.decode()) for k, v in error.headers()]
    return ext.ProcessingResponse(immediate_response=ext.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=error.status),
        headers=_set_headers(headers), body=error.body(), details=error.code.value))


class PickerStream:
    """One ext_proc stream: feed each :class:`ProcessingRequest` to :meth:`handle`, send
    what it returns, in order; call :meth:`close` when the stream ends (idempotent)."""

    def __init__(self, gateway: Runtime, request_timeout_s: float | None = None) -> None:
        self.gw = gateway
        self.phase = Phase.HEADERS
        self.picked: _Picked | None = None
        self.served: str | None = None
        self._timeout_s = request_timeout_s or gateway.config.upstream.request_timeout_s
        self._path = ""
        self._subset: list[str] | None = None
        self._body = bytearray()
        self._duplex_request = False
        self._duplex_response = False
        self._request_mode = _Mode.BUFFERED
        self._admitted = False
        self._hit: int | None = None  # tokens credited to the endpoint that served
        self._worker: str | None = None  # the worker that served, when Cortex knows it
        self._session_headers: dict[str, str] = {}  # the configured session headers sent
        self._answer_seen: bytearray | None = None  # the answer so far (usage is at its end)

    def __repr__(self) -> str:
        chosen = self.picked.destination if self.picked else None
        return f"PickerStream(phase={self.phase.value}, path={self._path!r}, picked={chosen!r})"

    async def handle(self, req: ext.ProcessingRequest) -> list[ext.ProcessingResponse]:
        if req.HasField("protocol_config"):
            config = req.protocol_config
            self._request_mode = config.request_body_mode
            self._duplex_request = config.request_body_mode == _Mode.FULL_DUPLEX_STREAMED
            self._duplex_response = config.response_body_mode == _Mode.FULL_DUPLEX_STREAMED
        kind = req.WhichOneof("request")
        if kind == "request_headers":
            return await self._on_request_headers(req)
        if kind == "request_body":
            return await self._on_request_body(req.request_body)
        if kind == "request_trailers":
            return [ext.ProcessingResponse(request_trailers=ext.TrailersResponse())]
        if kind == "response_headers":
            return self._on_response_headers(req)
        if kind == "response_body":
            return self._on_response_body(req.response_body)
        if kind == "response_trailers":
            self.close()
            return [ext.ProcessingResponse(response_trailers=ext.TrailersResponse())]
        return []

    # ---- the request ----

    async def _on_request_headers(self, req: ext.ProcessingRequest) -> list[
            ext.ProcessingResponse]:
        headers = req.request_headers
        self._path = _header(headers.headers, ":path").split("?", 1)[0]
        self._session_headers = {
            name: value for name in self.gw.config.routing.sessions.headers
            if (value := _header(headers.headers, name))}
        subset = _struct_value(req.metadata_context, SUBSET_NAMESPACE, SUBSET)
        self._subset = subset if isinstance(subset, list) else None
        self.phase = Phase.BODY
        if self._request_mode == _Mode.STREAMED:
            # each chunk would need its answer before the body is whole, and the headers
            # would be gone by then: no way to name the endpoint
            self.close()
            return [immediate(GatewayError(
                "the endpoint picker needs Envoy's request body mode BUFFERED or "
                "FULL_DUPLEX_STREAMED", code=ErrorCode.INTERNAL_ERROR, status=500))]
        if headers.end_of_stream or self._request_mode == _Mode.NONE:
            # no body (GET /v1/models, say), or Envoy sends none: any routable worker
            return await self._answer(headers_reply=True, body_reply=False)
        if self._duplex_request:
            return []  # the headers are answered once the body is whole
        return [ext.ProcessingResponse(request_headers=ext.HeadersResponse())]

    async def _on_request_body(self, body: ext.HttpBody) -> list[ext.ProcessingResponse]:
        self._body += body.body
        if len(self._body) > self.gw.config.server.max_body_bytes:
            self.phase = Phase.DONE
            return [immediate(ClientError("request body too large",
                                          code=ErrorCode.INVALID_REQUEST, status=413))]
        if not (body.end_of_stream or body.end_of_stream_without_message):
            return []  # buffered by the picker (full duplex) or by Envoy
        return await self._answer(headers_reply=self._duplex_request, body_reply=True)

    async def _answer(self, *, headers_reply: bool, body_reply: bool) -> list[
            ext.ProcessingResponse]:
        try:
            picked = await self._pick()
        except GatewayError as exc:
            self.close()
            m = self.gw.metrics
            m.child(m.epp_picks, f"refused_{exc.status}").inc()
            log.info("picker refused path=%s: %r", self._path, exc)
            return [immediate(exc)]
        m = self.gw.metrics
        m.child(m.epp_picks, "picked").inc()
        self.picked, self.phase = picked, Phase.PICKED
        destination = picked.destination
        common = ext.CommonResponse(header_mutation=_set_headers([(DESTINATION, destination)]))
        metadata = struct_pb2.Struct()
        metadata.update({LB_NAMESPACE: {DESTINATION: destination}})
        replies: list[ext.ProcessingResponse] = []
        if headers_reply:
            replies.append(ext.ProcessingResponse(
                request_headers=ext.HeadersResponse(response=common), dynamic_metadata=metadata))
        if body_reply:
            if headers_reply:  # full duplex: the body goes back to Envoy through us
                common = ext.CommonResponse(
                    status=_CONTINUE_AND_REPLACE,
                    body_mutation=ext.BodyMutation(streamed_response=ext.StreamedBodyResponse(
                        body=bytes(self._body), end_of_stream=True)))
                replies.append(ext.ProcessingResponse(request_body=ext.BodyResponse(
                    response=common)))
            else:  # buffered: the headers travel with the body's answer
                replies.append(ext.ProcessingResponse(
                    request_body=ext.BodyResponse(response=common), dynamic_metadata=metadata))
        return replies

    async def _pick(self) -> _Picked:
        gw = self.gw
        allowed = {w.id for w in gw.pool if w.spec.role is WorkerRole.REGULAR}
        if self._subset is not None:
            wanted = set(self._subset)
            allowed = {wid for wid in allowed
                       if (state := gw.pool.get(wid)) and address_of(state.spec) in wanted}
            if not allowed:
                raise ServiceUnavailable("no endpoint of the subset can take the request")
        try:
            endpoint = InferencePath(self._path)
        except ValueError:
            endpoint = None
        if endpoint is None or not self._body:
            return self._any(allowed)
        body = parse_body(bytes(self._body))
        request = gw.admit(endpoint, body)
        session = session_of(self._session_headers, body, gw.config.routing.sessions)
        self._refuse_disaggregated(request.model.name)
        await gw.admission.acquire()  # ServiceUnavailable: 429 queue full, 503 waited
        self._admitted = True
        deadline = time.monotonic() + self._timeout_s
        routed = await gw.router.route(request, deadline, allowed=allowed, session=session)
        specs = [state.spec for scored in routed.decision.ranked[:MAX_ENDPOINTS]
                 if (state := gw.pool.get(scored.worker_id)) is not None]
        return _Picked(routed, tuple(specs))

    def _refuse_disaggregated(self, model: str) -> None:
        """A model served only by prefill/decode pairs: one picked endpoint cannot run both
        legs, so such requests go through ``cortex-gateway`` (docs/kubernetes.md)."""
        workers = [w for w in self.gw.pool if w.spec.model == model]
        if workers and all(w.spec.role is not WorkerRole.REGULAR for w in workers):
            raise ServiceUnavailable(
                f"model {model!r} is served as prefill/decode pairs, which one picked endpoint "
                "cannot express: send its requests through cortex-gateway")

    def _any(self, allowed: set[str]) -> _Picked:
        """A request that is no inference (no body, another path): the least loaded
        routable worker, without credit."""
        workers = sorted((w for w in self.gw.pool if w.id in allowed and w.routable()),
                         key=lambda w: (w.inflight + w.pending, w.id))
        if not workers:
            raise ServiceUnavailable("no routable worker")
        return _Picked(None, tuple(w.spec for w in workers[:MAX_ENDPOINTS]))

    # ---- the response ----

    def _on_response_headers(self, req: ext.ProcessingRequest) -> list[ext.ProcessingResponse]:
        served = _served_address(req)
        extra: list[tuple[str, str]] = []
        hit: int | None = None
        picked = self.picked
        if served is not None and picked is not None:
            self.served = served
            worker = next((w for w in self.gw.pool if address_of(w.spec) == served), None)
            m = self.gw.metrics
            outcome = ("unknown" if worker is None else
                       "chosen" if worker.spec == picked.workers[0] else "fallback")
            m.child(m.epp_served, outcome).inc()
            if picked.routed is not None:
                placement = picked.routed.placement
                if worker is None:
                    placement.withdraw()  # an endpoint Cortex does not know served it
                else:
                    placement.move(worker.id)  # a fallback served: its blocks are there now
                    hit = picked.routed.credited_tokens(worker.id)
            if worker is not None:
                self._worker = worker.id
                extra = [(name.decode(), value.decode()) for name, value in
                         decision_headers(hit_tokens=hit, worker=worker.id)]
                self._hit, self._answer_seen = hit, (bytearray() if hit is not None else None)
        common = ext.CommonResponse(header_mutation=_set_headers(extra)) if extra else None
        reply = ext.ProcessingResponse(response_headers=ext.HeadersResponse(response=common))
        if req.response_headers.end_of_stream:
            self.close()
        return [reply]

    def _on_response_body(self, body: ext.HttpBody) -> list[ext.ProcessingResponse]:
        done = body.end_of_stream or body.end_of_stream_without_message
        answer = self._answer_seen
        if answer is not None:
            answer += body.body
            if len(answer) > ANSWER_BYTES:
                self._answer_seen = None
        if done:
            self._check_prediction()
            self.close()
        if not self._duplex_response:
            return [ext.ProcessingResponse(response_body=ext.BodyResponse())]
        common = ext.CommonResponse(
            status=_CONTINUE_AND_REPLACE,
            body_mutation=ext.BodyMutation(streamed_response=ext.StreamedBodyResponse(
                body=body.body, end_of_stream=body.end_of_stream)))
        return [ext.ProcessingResponse(response_body=ext.BodyResponse(response=common))]

    def _check_prediction(self) -> None:
        """The engine's cached tokens (the answer's usage) against the hit credited to the
        endpoint that served, as the gateway's own path counts them."""
        answer, self._answer_seen = self._answer_seen, None
        picked = self.picked
        if self._hit is None or picked is None or picked.routed is None:
            return
        obj = None if answer is None else answer_object(bytes(answer))
        routed = picked.routed
        _, delivered = check_prediction(self.gw.metrics, routed.model.reports_cached_tokens,
                                        self._hit, obj)
        worker = self._worker
        if worker is not None:
            reuse = reuse_of(routed.decision, worker).with_delivered(delivered)
            count_reuse(self.gw.metrics, routed.model.name, worker, reuse, routed.prompt_tokens)
            if routed.agents is not None and worker != routed.decision.chosen.worker_id:
                routed.agents.served_by(worker)

    def close(self) -> None:
        """The request ended: its load leaves the worker, its admission slot is freed."""
        self.phase = Phase.DONE
        picked, self.picked = self.picked, None
        if picked is not None and picked.routed is not None:
            picked.routed.placement.dispatched()
        if self._admitted:
            self._admitted = False
            self.gw.admission.release()


def answer_object(answer: bytes) -> Any:
    """The response object that carries the usage: a JSON body, or the last data event of
    an SSE stream with a ``usage`` (``None`` when there is none)."""
    if answer.lstrip()[:1] == b"{":
        try:
            return json.loads(answer)
        except ValueError:
            return None
    for line in reversed(answer.splitlines()):
        if line.startswith(b"data: {") and b'"usage"' in line:
            try:
                event = json.loads(line[6:])
            except ValueError:
                continue
            if isinstance(event, dict) and event.get("usage"):
                return event
    return None


def metadata_of(values: Mapping[str, Mapping[str, Any]]) -> base_pb2.Metadata:
    """Filter metadata as Envoy sends it (``namespace -> {key: value}``): for tests and
    tools that play Envoy's side."""
    metadata = base_pb2.Metadata()
    for namespace, fields in values.items():
        metadata.filter_metadata[namespace].update(dict(fields))
    return metadata
