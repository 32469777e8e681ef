"""The endpoint picker, played message by message by a grpcio client in Envoy's role (Envoy's
own ext_proc messages from xds-protos), against a real cluster: Redis, index, ingest, sims
and the gateway on 127.0.0.1. The client forwards each request to the endpoint it was
given, as Envoy would, so the engines' KV events make the next pick a cache hit.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_grpc
from grpclib.health.v1.health_pb2 import HealthCheckRequest, HealthCheckResponse

from cortex.gateway.config.gateway import AdmissionConfig
from cortex.gateway.epp.picker import (
    DESTINATION,
    LB_NAMESPACE,
    SERVED,
    SUBSET,
    SUBSET_NAMESPACE,
    address_of,
    metadata_of,
)
from cortex.gateway.epp.server import EppServer
from cortex.gateway.server import GatewayServer
from cortex.index.server import IndexServer
from cortex.testing import RedisServer, wait_until_async

from ..conftest import MODEL, StartGateway, StartSim, spec_of
from .test_cluster import TAIL, Cluster, chat, cluster, wait_index_holds

pytestmark = pytest.mark.timeout(90)

CHAT_PATH = "/v1/chat/completions"
DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED


class Envoy:
    """Envoy's side of one ext_proc stream."""

    def __init__(self, stub: ext_grpc.ExternalProcessorStub) -> None:
        self.call = stub.Process()

    async def send(self, **fields: Any) -> None:
        await self.call.write(ext.ProcessingRequest(**fields))

    async def recv(self) -> ext.ProcessingResponse:
        reply = await self.call.read()
        assert reply is not grpc.aio.EOF, "the picker ended the stream"
        return reply

    async def request(self, body: dict[str, Any], *, subset: list[str] | None = None,
                      duplex: bool = False, path: str = CHAT_PATH,
                      more: dict[str, str] | None = None) -> ext.ProcessingResponse:
        """Headers (``more``: besides the usual ones) then body; the picker's answer that
        carries the destination."""
        raw = json.dumps(body).encode()
        headers = base_pb2.HeaderMap(headers=[
            base_pb2.HeaderValue(key=":method", raw_value=b"POST"),
            base_pb2.HeaderValue(key=":path", raw_value=path.encode()),
            base_pb2.HeaderValue(key="content-type", raw_value=b"application/json"),
            *(base_pb2.HeaderValue(key=k, raw_value=v.encode())
              for k, v in (more or {}).items())])
        extra: dict[str, Any] = {}
        if subset is not None:
            extra["metadata_context"] = metadata_of({SUBSET_NAMESPACE: {SUBSET: subset}})
        if duplex:
            extra["protocol_config"] = ext.ProtocolConfiguration(
                request_body_mode=DUPLEX, response_body_mode=DUPLEX)
        await self.send(request_headers=ext.HttpHeaders(headers=headers), **extra)
        if duplex:  # chunks follow at once; the picker answers when the body is whole
            await self.send(request_body=ext.HttpBody(body=raw[:50]))
            await self.send(request_body=ext.HttpBody(body=raw[50:], end_of_stream=True))
            return await self.recv()
        first = await self.recv()
        if first.HasField("immediate_response"):
            return first
        assert first.WhichOneof("response") == "request_headers"
        assert not first.request_headers.response.header_mutation.set_headers
        await self.send(request_body=ext.HttpBody(body=raw, end_of_stream=True))
        return await self.recv()

    async def served(self, endpoint: str) -> ext.ProcessingResponse:
        await self.send(response_headers=ext.HttpHeaders(headers=base_pb2.HeaderMap()),
                        metadata_context=metadata_of({LB_NAMESPACE: {SERVED: endpoint}}))
        return await self.recv()

    async def close(self) -> None:
        await self.call.done_writing()


def destination(reply: ext.ProcessingResponse) -> list[str]:
    """The endpoints of a reply; header and dynamic metadata must agree."""
    kind = reply.WhichOneof("response")
    common = getattr(reply, kind).response
    (option,) = common.header_mutation.set_headers
    assert option.header.key == DESTINATION
    header = option.header.raw_value.decode()
    meta = reply.dynamic_metadata.fields[LB_NAMESPACE].struct_value.fields[DESTINATION]
    assert meta.string_value == header
    return header.split(",")


def headers_of(reply: ext.ProcessingResponse) -> dict[str, str]:
    kind = reply.WhichOneof("response")
    return {o.header.key: o.header.raw_value.decode()
            for o in getattr(reply, kind).response.header_mutation.set_headers}


@contextlib.asynccontextmanager
async def picker(gateway: GatewayServer) -> AsyncIterator[ext_grpc.ExternalProcessorStub]:
    async with EppServer(gateway.gateway, "127.0.0.1", 0) as epp, \
            grpc.aio.insecure_channel(f"127.0.0.1:{epp.port}") as channel:
        yield ext_grpc.ExternalProcessorStub(channel)


async def forward(http: aiohttp.ClientSession, endpoint: str, body: dict[str, Any]) -> int:
    """What Envoy does with the pick: the request to that endpoint; the engine's cached
    tokens."""
    async with http.post(f"http://{endpoint}{CHAT_PATH}", json=body) as resp:
        assert resp.status == 200, await resp.text()
        payload = await resp.json()
    return int(payload["usage"]["prompt_tokens_details"]["cached_tokens"])


def by_address(c: Cluster) -> dict[str, str]:
    return {address_of(w.spec): w.id for w in c.gateway.gateway.pool}


async def test_the_picker_routes_by_cache_names_fallbacks_and_follows_the_served_endpoint(
    redis_server: RedisServer, index_server: IndexServer, start_sim: StartSim,
    start_gateway: StartGateway, http: aiohttp.ClientSession,
) -> None:
    sims = {f"w{i}": await start_sim() for i in range(3)}
    async with cluster(redis_server, index_server, sims, start_gateway, http) as c, \
            picker(c.gateway) as stub:
        workers = by_address(c)
        body = chat("what does the picker pick?")
        envoy = Envoy(stub)
        first = destination(await envoy.request(body))
        assert len(first) == 3 and set(first) == set(workers)  # the choice, then fallbacks
        assert await forward(http, first[0], body) == 0
        reply = await envoy.served(first[0])
        assert headers_of(reply)["x-cortex-assigned-worker"] == workers[first[0]]
        await envoy.send(response_body=ext.HttpBody(body=b"{}", end_of_stream=True))
        assert (await envoy.recv()).WhichOneof("response") == "response_body"
        await envoy.close()
        holder = workers[first[0]]
        pool = c.gateway.gateway.pool
        await wait_until_async(lambda: pool.get(holder).pending == 0, timeout=5,  # type: ignore[union-attr]
                               what="the finished request's load released")

        # the same prefix, once the index holds it: the holder again, with a cache hit
        again = chat("and a second question on the same prefix")
        await wait_index_holds(c, again, holder)
        envoy = Envoy(stub)
        picked = destination(await envoy.request(again, duplex=True))
        assert picked[0] == first[0]
        echoed = await envoy.recv()  # full duplex: the body comes back through the picker
        streamed = echoed.request_body.response.body_mutation.streamed_response
        assert json.loads(streamed.body) == again and streamed.end_of_stream
        # Envoy's retry served the request on a fallback: the credit follows it there
        fallback = picked[1]
        assert await forward(http, fallback, again) == 0
        reply = await envoy.served(fallback)
        assert headers_of(reply)["x-cortex-assigned-worker"] == workers[fallback]
        await envoy.send(response_body=ext.HttpBody(body=b"data: x\n\n"))
        chunk = (await envoy.recv()).response_body.response.body_mutation.streamed_response
        assert chunk.body == b"data: x\n\n" and not chunk.end_of_stream
        await envoy.close()
        metrics = c.gateway.gateway.metrics
        assert metrics.epp_served.labels("fallback")._value.get() == 1
        assert metrics.epp_picks.labels("picked")._value.get() == 2

        # the subset hint: only its endpoints, even against the cache
        envoy = Envoy(stub)
        other = next(a for a in workers if a != first[0])
        assert destination(await envoy.request(again, subset=[other])) == [other]
        await envoy.close()
        envoy = Envoy(stub)
        refused = await envoy.request(again, subset=["10.9.9.9:8000"])
        assert refused.immediate_response.status.code == 503
        await envoy.close()


async def test_bad_requests_and_a_full_gateway_are_immediate_answers(
    start_sim: StartSim, start_gateway: StartGateway,
) -> None:
    sims = [await start_sim() for _ in range(2)]
    gateway = await start_gateway([spec_of(s, f"w{i}") for i, s in enumerate(sims)],
                                  admission=AdmissionConfig(max_concurrent_requests=1,
                                                            queue_size=0))
    pool = gateway.gateway.pool
    await wait_until_async(lambda: all(w.routable() for w in pool), timeout=10,
                           what="both workers routable")
    async with picker(gateway) as stub:
        envoy = Envoy(stub)
        bad = await envoy.request({"model": MODEL, "messages": "not a list"})
        assert bad.immediate_response.status.code == 400
        error = json.loads(bad.immediate_response.body)["error"]
        assert error["param"] == "messages"
        await envoy.close()
        envoy = Envoy(stub)
        unknown = await envoy.request({"model": "no-such-model", "messages": []})
        assert unknown.immediate_response.status.code in (400, 404)
        await envoy.close()

        holding = Envoy(stub)
        destination(await holding.request(chat("holds the one admission slot" + TAIL)))
        envoy = Envoy(stub)
        full = await envoy.request(chat("one too many"))
        assert full.immediate_response.status.code == 429
        assert json.loads(full.immediate_response.body)["error"]["code"] == "queue_full"
        await envoy.close()
        # Envoy resets the first stream without a response: its slot and load are freed
        holding.call.cancel()
        await wait_until_async(lambda: gateway.gateway.admission.active == 0, timeout=5,
                               what="the reset stream's slot freed")
        assert all(w.pending == 0 for w in pool)
        # a request without a body (GET /v1/models): the least loaded worker, no routing
        envoy = Envoy(stub)
        await envoy.send(request_headers=ext.HttpHeaders(
            headers=base_pb2.HeaderMap(headers=[
                base_pb2.HeaderValue(key=":path", raw_value=b"/v1/models")]),
            end_of_stream=True))
        assert set(destination(await envoy.recv())) == {address_of(w.spec) for w in pool}
        await envoy.close()
        # Envoy configured to send no body: picked on the headers; per-chunk STREAMED: refused
        post = base_pb2.HeaderMap(headers=[
            base_pb2.HeaderValue(key=":path", raw_value=CHAT_PATH.encode())])
        for mode, expected in ((processing_mode_pb2.ProcessingMode.NONE, "request_headers"),
                               (processing_mode_pb2.ProcessingMode.STREAMED,
                                "immediate_response")):
            envoy = Envoy(stub)
            await envoy.send(request_headers=ext.HttpHeaders(headers=post),
                             protocol_config=ext.ProtocolConfiguration(request_body_mode=mode))
            reply = await envoy.recv()
            assert reply.WhichOneof("response") == expected
            if expected == "request_headers":
                assert len(destination(reply)) == 2
            else:
                assert reply.immediate_response.status.code == 500
            await envoy.close()


async def test_grpc_health_names_liveness_readiness_and_the_processor(
    start_sim: StartSim, start_gateway: StartGateway,
) -> None:
    gateway = await start_gateway([spec_of(await start_sim(), "w0")])
    await wait_until_async(lambda: gateway.gateway.pool.servable(), timeout=10,
                           what="a routable worker")
    async with EppServer(gateway.gateway, "127.0.0.1", 0) as epp, \
            grpc.aio.insecure_channel(f"127.0.0.1:{epp.port}") as channel:
        check = channel.unary_unary(
            "/grpc.health.v1.Health/Check",
            request_serializer=HealthCheckRequest.SerializeToString,
            response_deserializer=HealthCheckResponse.FromString)
        for service in ("", "liveness", "readiness",
                        "envoy.service.ext_proc.v3.ExternalProcessor"):
            answer = await check(HealthCheckRequest(service=service))
            assert answer.status == HealthCheckResponse.SERVING, service
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await check(HealthCheckRequest(service="bogus"))
        assert info.value.code() is grpc.StatusCode.NOT_FOUND


async def test_the_picker_admits_an_adapter_the_workers_list_as_inference_does(
    start_sim: StartSim, start_gateway: StartGateway,
) -> None:
    """An adapter no config names, only a worker's ``/v1/models``: the picker resolves it to
    its base model (one ``admit`` with inference and explain) and picks only that worker."""
    plain, serving = await start_sim(), await start_sim(lora_adapters=("sql",))
    gateway = await start_gateway([spec_of(plain, "w0"), spec_of(serving, "w1")])
    pool = gateway.gateway.pool
    await wait_until_async(lambda: pool.adapter_base("sql") == MODEL, timeout=10,
                           what="the adapter learned from /v1/models")
    async with picker(gateway) as stub:
        envoy = Envoy(stub)
        reply = await envoy.request({**chat("list the tables"), "model": "sql"})
        assert not reply.HasField("immediate_response"), reply.immediate_response.body
        assert destination(reply) == [address_of(spec_of(serving, "w1"))]
        await envoy.close()


async def test_the_picker_keeps_a_session_home_and_accounts_its_reuse(
    redis_server: RedisServer, index_server: IndexServer, start_sim: StartSim,
    start_gateway: StartGateway, http: aiohttp.ClientSession,
) -> None:
    sims = {f"w{i}": await start_sim() for i in range(3)}
    async with cluster(redis_server, index_server, sims, start_gateway, http) as c, \
            picker(c.gateway) as stub:
        history = chat("the agent's task")
        homes = []
        for turn in range(3):
            if turn:
                history = {**history, "messages": [
                    *history["messages"], {"role": "assistant", "content": f"tool call {turn}"},
                    {"role": "user", "content": f"tool result {turn}" + TAIL}]}
            envoy = Envoy(stub)
            chosen = destination(await envoy.request(history, more={"session-id": "agent-7"}))
            homes.append(chosen[0])
            async with http.post(f"http://{chosen[0]}{CHAT_PATH}", json=history) as resp:
                answer = await resp.read()
            await envoy.served(chosen[0])
            await envoy.send(response_body=ext.HttpBody(body=answer, end_of_stream=True))
            await envoy.recv()
            await envoy.close()
        assert len(set(homes)) == 1
        metrics = c.gateway.gateway.metrics
        assert metrics.session_hints.labels("kept")._value.get() == 2
        worker = by_address(c)[homes[0]]
        delivered = metrics.reuse_tokens.labels(worker, MODEL, "delivered")._value.get()
        captured = metrics.reuse_tokens.labels(worker, MODEL, "captured")._value.get()
        assert 0 < delivered <= captured
