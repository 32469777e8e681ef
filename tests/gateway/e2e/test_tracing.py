"""OpenTelemetry tracing end to end: a real OTLP/HTTP receiver on 127.0.0.1 decodes the
gateway's ``ExportTraceServiceRequest``s; a client's ``traceparent`` is continued, and the
gateway's upstream span is what the worker receives."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from cortex.gateway.config.middleware import TracingConfig
from cortex.testing import wait_until_async

from ..conftest import MODEL, StartGateway, StartSim, spec_of

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


@dataclass
class Receiver:
    """An OTLP/HTTP traces endpoint: every span it was sent, by trace id (hex)."""

    url: str = ""
    spans: dict[str, list[Any]] = field(default_factory=dict)
    services: set[str] = field(default_factory=set)
    exports: int = 0

    async def handle(self, request: web.Request) -> web.Response:
        assert request.content_type == "application/x-protobuf"
        export = ExportTraceServiceRequest.FromString(await request.read())
        self.exports += 1
        for resource_spans in export.resource_spans:
            for attr in resource_spans.resource.attributes:
                if attr.key == "service.name":
                    self.services.add(attr.value.string_value)
            for scope in resource_spans.scope_spans:
                for span in scope.spans:
                    self.spans.setdefault(span.trace_id.hex(), []).append(span)
        return web.Response(body=b"", content_type="application/x-protobuf")


@contextlib.asynccontextmanager
async def otlp_receiver() -> AsyncIterator[Receiver]:
    receiver = Receiver()
    app = web.Application()
    app.router.add_post("/v1/traces", receiver.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    receiver.url = f"http://127.0.0.1:{port}/v1/traces"
    try:
        yield receiver
    finally:
        await runner.cleanup()


def attributes(span: Any) -> dict[str, Any]:
    out = {}
    for attr in span.attributes:
        value = attr.value
        out[attr.key] = value.string_value or value.int_value or value.bool_value
    return out


async def test_spans_of_a_request_reach_the_collector_and_its_context_the_worker(
    start_sim: StartSim, start_gateway: StartGateway, http: aiohttp.ClientSession,
) -> None:
    sim = await start_sim()
    async with otlp_receiver() as receiver:
        gw = await start_gateway([spec_of(sim, "w1")], tracing=TracingConfig(
            enabled=True, endpoint=receiver.url, export_interval_s=0.05,
            service_name="cortex-gateway-test"))
        body = {"model": MODEL, "max_tokens": 4,
                "messages": [{"role": "user", "content": "trace me " * 40}]}
        async with http.post(gw.url + "/v1/chat/completions", json=body, headers={
                "traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"}) as resp:
            assert resp.status == 200

        def arrived() -> bool:
            names = {s.name for s in receiver.spans.get(TRACE_ID, [])}
            return {"POST /v1/chat/completions", "upstream"} <= names

        await wait_until_async(arrived, timeout=10, interval=0.05, what="the request's spans")
        spans = {s.name: s for s in receiver.spans[TRACE_ID]}
        assert {"parse", "tokenize", "hash", "match", "score", "upstream"} <= spans.keys()
        root = spans["POST /v1/chat/completions"]
        assert root.parent_span_id.hex() == CLIENT_SPAN  # the client's trace continued
        for name in ("parse", "tokenize", "match", "score", "upstream"):
            assert spans[name].parent_span_id == root.span_id, name
            assert root.start_time_unix_nano <= spans[name].start_time_unix_nano
            assert spans[name].end_time_unix_nano <= root.end_time_unix_nano
        assert attributes(root)["http.response.status_code"] == 200
        assert attributes(root)["cortex.worker"] == "w1"
        assert attributes(spans["tokenize"])["cortex.prompt_tokens"] > 40
        assert attributes(spans["upstream"])["cortex.worker"] == "w1"
        assert receiver.services == {"cortex-gateway-test"}
        # the worker got the upstream span as its parent, in the same trace
        async with http.get(sim.url + "/sim/state") as resp:
            forwarded = (await resp.json())["traceparent"]
        assert forwarded == f"00-{TRACE_ID}-{spans['upstream'].span_id.hex()}-01"

        # a request without a traceparent starts a trace of its own; probes are not traced
        async with http.post(gw.url + "/v1/embeddings", json={"model": MODEL,
                                                              "input": "x"}) as resp:
            assert resp.status == 200
        async with http.get(gw.url + "/health/ready") as resp:
            assert resp.status == 200

        def embedded() -> bool:
            return any(s.name == "POST /v1/embeddings" for spans in receiver.spans.values()
                       for s in spans)

        await wait_until_async(embedded, timeout=10, interval=0.05, what="the relay's span")
        assert not any(s.name.startswith("GET /health") for spans in receiver.spans.values()
                       for s in spans)


async def test_without_tracing_the_clients_trace_context_is_passed_on(
    start_sim: StartSim, start_gateway: StartGateway, http: aiohttp.ClientSession,
) -> None:
    sim = await start_sim()
    gw = await start_gateway([spec_of(sim, "w1")])
    traceparent = f"00-{TRACE_ID}-{CLIENT_SPAN}-01"
    async with http.post(gw.url + "/v1/chat/completions", headers={"traceparent": traceparent},
                         json={"model": MODEL, "max_tokens": 2,
                               "messages": [{"role": "user", "content": "hi"}]}) as resp:
        assert resp.status == 200
    async with http.get(sim.url + "/sim/state") as resp:
        assert (await resp.json())["traceparent"] == traceparent
