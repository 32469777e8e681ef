"""Broken and oversized worker answers (cortex.gateway.dispatch.attempt) end to end: a
real sim behind an AnswerProxy that answers 200s the endpoint never promises. Each is a
worker failure — counted, retried before the first byte, a 502 (or an SSE error event
after it) — and never a 200 carrying the garbage. And first_bytes closes the stream it
leaves after the first chunk (not left to the event loop's finalizer)."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import aiohttp
import pytest

from cortex.bench.answer_proxy import AnswerProxy, Shape
from cortex.gateway.config.gateway import UpstreamConfig
from cortex.gateway.dispatch.attempt import first_bytes
from cortex.gateway.server import GatewayServer
from cortex.gateway.upstream.memory import EVENT, MemoryResponse
from cortex.registry import WorkerSpec

from ..conftest import MODEL, StartGateway, StartSim, spec_of

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def proxy(start_sim: StartSim) -> AsyncIterator[AnswerProxy]:
    sim = await start_sim()
    async with AnswerProxy(sim.url, huge_bytes=8 << 20) as running:
        running.sim = sim  # type: ignore[attr-defined]
        yield running


def proxied_spec(proxy: AnswerProxy) -> WorkerSpec:
    spec = spec_of(proxy.sim, "broken")  # type: ignore[attr-defined]
    return WorkerSpec.from_dict({**spec.to_dict(), "url": proxy.url})


def chat(text: str, stream: bool) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 4, "stream": stream,
            "messages": [{"role": "user", "content": text}]}


def errors(gw: GatewayServer, kind: str) -> float:
    value = gw.gateway.metrics.registry.get_sample_value(
        "cortex_gateway_upstream_errors_total", {"worker": "broken", "kind": kind})
    return 0.0 if value is None else value


@pytest.mark.parametrize(("shape", "stream"), [
    (Shape.NOT_JSON, False), (Shape.JSON_FOR_STREAM, True), (Shape.GARBAGE_SSE, True),
])
async def test_a_broken_200_is_a_counted_502(
    proxy: AnswerProxy, start_gateway: StartGateway, http: aiohttp.ClientSession,
    shape: Shape, stream: bool,
) -> None:
    gw = await start_gateway([proxied_spec(proxy)])
    proxy.shape = shape
    async with http.post(gw.url + "/v1/chat/completions", json=chat("hi", stream)) as resp:
        assert resp.status == 502
        assert (await resp.json())["error"]["code"] == "upstream_error"
    assert proxy.answered == 1
    assert errors(gw, "bad_answer") == 1


@pytest.mark.parametrize(("shape", "stream"), [
    (Shape.NOT_JSON, False), (Shape.JSON_FOR_STREAM, True), (Shape.GARBAGE_SSE, True),
])
async def test_a_broken_200_is_retried_on_another_worker(
    proxy: AnswerProxy, start_sim: StartSim, start_gateway: StartGateway,
    http: aiohttp.ClientSession, shape: Shape, stream: bool,
) -> None:
    live = await start_sim()
    gw = await start_gateway([proxied_spec(proxy), spec_of(live, "live")])
    proxy.shape = shape
    for i in range(8):  # distinct prompts: no cache affinity keeps them off the proxy
        async with http.post(gw.url + "/v1/chat/completions",
                             json=chat(f"question {i} " * (i + 1), stream)) as resp:
            assert resp.status == 200
            assert resp.headers["x-cortex-assigned-worker"] == "live"
            body = await resp.read()
            assert b"not an event stream" not in body and b"<html>" not in body
    assert proxy.answered >= 1
    assert errors(gw, "bad_answer") == proxy.answered


async def test_garbage_after_the_first_event_ends_the_stream_with_an_error(
    proxy: AnswerProxy, start_gateway: StartGateway, http: aiohttp.ClientSession,
) -> None:
    gw = await start_gateway([proxied_spec(proxy)])
    proxy.shape = Shape.LATE_GARBAGE_SSE
    async with http.post(gw.url + "/v1/chat/completions", json=chat("hi", True)) as resp:
        body = await resp.read()
    assert b"not an event stream" not in body
    if resp.status == 200:  # the first event went out (the usual case: it came alone)
        assert b'"content":"ok"' in body
        assert b"upstream_stream_error" in body and body.endswith(b"data: [DONE]\n\n")
    else:  # both came in one read: caught before the first byte
        assert resp.status == 502
    assert errors(gw, "bad_answer") == 1


async def test_an_answer_over_the_bound_is_a_502_not_retried(
    proxy: AnswerProxy, start_sim: StartSim, start_gateway: StartGateway,
    http: aiohttp.ClientSession,
) -> None:
    gw = await start_gateway([proxied_spec(proxy)],
                             upstream=UpstreamConfig(max_answer_bytes=1 << 20))
    proxy.shape = Shape.HUGE
    async with http.post(gw.url + "/v1/chat/completions", json=chat("hi", False)) as resp:
        assert resp.status == 502
        assert (await resp.json())["error"]["code"] == "upstream_too_large"
    assert proxy.answered == 1
    assert errors(gw, "too_large") == 1
    assert gw.gateway.pool.get("broken").breaker.state.value == "closed"  # type: ignore[union-attr]


class _Watched(MemoryResponse):
    """A scripted stream that says whether its reader closed it."""

    ended = False

    async def chunks(self, idle_timeout_s: float | None = None) -> AsyncGenerator[bytes, None]:
        try:
            for part in self.parts:
                yield part
        finally:
            self.ended = True


async def test_first_bytes_closes_the_stream_it_leaves() -> None:
    response = _Watched(200, (EVENT, b"data: [DONE]\n\n"), None)
    head, answer = await first_bytes(response, True, ())
    assert (head, answer) == (EVENT, None)
    assert response.ended  # closed here, not by a finalizer task later
