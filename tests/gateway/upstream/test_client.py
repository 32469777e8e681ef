"""The worker client against a real aiohttp server on 127.0.0.1: what a worker's answer
becomes (status, ``Retry-After``, chunks) and how each way of failing is named — through the
lean HTTP/1.1 pool and through aiohttp alike (``upstream.http_client``)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from cortex.gateway.config.gateway import UpstreamConfig
from cortex.gateway.http.auth import WorkerCredentials
from cortex.gateway.upstream.client import FailureKind, UpstreamClient, UpstreamFailure
from cortex.hashing import Engine
from cortex.registry import WorkerSpec
from cortex.testing.procs import free_port, serve_app

pytestmark = pytest.mark.timeout(20)


@pytest.fixture(params=["lean", "aiohttp"])
def kind(request: pytest.FixtureRequest) -> str:
    """Which HTTP client calls the workers."""
    return str(request.param)


class Worker:
    """Routes of a fake worker; ``release`` lets the stalled stream go on."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.authorization: str | None = None

    async def busy(self, request: web.Request) -> web.Response:
        return web.Response(status=429, headers={"Retry-After": request.query["after"]})

    async def answer(self, request: web.Request) -> web.Response:
        self.authorization = request.headers.get("Authorization")
        return web.Response(body=await request.read(), content_type="application/json")

    async def stalled(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b"data: 1\n\n")
        await self.release.wait()
        await response.write(b"data: 2\n\n")
        return response

    async def dropped(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Length": "1000"})
        await response.prepare(request)
        await response.write(b"partial")
        assert request.transport is not None
        request.transport.close()  # the worker died mid-answer
        return response


@contextlib.asynccontextmanager
async def serving(kind: str) -> AsyncIterator[tuple[Worker, str, UpstreamClient]]:
    worker = Worker()
    app = web.Application()
    app.router.add_post("/busy", worker.busy)
    app.router.add_post("/answer", worker.answer)
    app.router.add_post("/stalled", worker.stalled)
    app.router.add_post("/dropped", worker.dropped)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        credentials = WorkerCredentials({"WORKER_KEY": "secret-key"})
        async with UpstreamClient(UpstreamConfig(connect_timeout_s=2.0, http_client=kind),
                                  credentials) as client:
            yield worker, f"http://127.0.0.1:{port}", client
    finally:
        worker.release.set()
        await runner.cleanup()


async def test_status_retry_after_and_the_body_come_through(kind: str) -> None:
    async with serving(kind) as (_, url, client):
        response = await client.post(url + "/busy?after=7", b"", {})
        assert (response.status, response.retry_after_s) == (429, 7.0)
        await response.read()
        response.close()
        dated = await client.post(url + "/busy?after=Wed,%2021%20Oct%202015", b"", {})
        assert dated.retry_after_s is None  # the HTTP-date form is ignored
        dated.close()
        answer = await client.post(url + "/answer", b'{"a":1}', {})
        assert (answer.status, answer.content_type) == (200, "application/json")
        assert await answer.read() == b'{"a":1}'
        answer.close()


async def test_a_worker_credential_is_sent_as_a_bearer_token(kind: str) -> None:
    async with serving(kind) as (worker, url, client):
        spec = WorkerSpec(id="w", url=url, engine=Engine.SGLANG, model="m",
                          credential="env:WORKER_KEY")
        response = await client.post(url + "/answer", b"{}", {}, spec)
        await response.read()
        response.close()
        assert worker.authorization == "Bearer secret-key"


async def test_a_refused_connection_is_a_connect_failure(kind: str) -> None:
    async with serving(kind) as (_, _url, client):
        with pytest.raises(UpstreamFailure) as caught:
            await client.post(f"http://127.0.0.1:{free_port()}/answer", b"{}", {})
        assert caught.value.kind is FailureKind.CONNECT


async def test_a_silent_stream_times_out_and_closes_the_connection(kind: str) -> None:
    async with serving(kind) as (_, url, client):
        response = await client.post(url + "/stalled", b"{}", {})
        got: list[bytes] = []
        with pytest.raises(UpstreamFailure) as caught:
            async for chunk in response.chunks(idle_timeout_s=0.2):
                got.append(chunk)
        assert caught.value.kind is FailureKind.TIMEOUT
        assert got == [b"data: 1\n\n"]
        response.close()


async def test_a_worker_dying_mid_answer_is_a_disconnect(kind: str) -> None:
    async with serving(kind) as (_, url, client):
        response = await client.post(url + "/dropped", b"{}", {})
        with pytest.raises(UpstreamFailure) as caught:
            await response.read()
        assert caught.value.kind is FailureKind.DISCONNECT
        response.close()


async def test_the_client_outside_its_block_says_so() -> None:
    client = UpstreamClient(UpstreamConfig())
    with pytest.raises(RuntimeError, match="outside its async with"):
        await client.post("http://127.0.0.1:1/", b"", {})


# ---- the answer-size bound (upstream.max_answer_bytes) ----

LIMIT = 64 * 1024


@pytest.fixture
async def server() -> AsyncIterator[str]:
    """A server whose ``/sized/N`` answers N bytes with a length and ``/chunked/N`` without
    one."""

    async def sized(request: web.Request) -> web.Response:
        return web.Response(body=b"a" * int(request.match_info["n"]))

    async def chunked(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        response.enable_chunked_encoding()
        await response.prepare(request)
        for _ in range(int(request.match_info["n"]) // 4096):
            await response.write(b"a" * 4096)
        return response

    app = web.Application()
    app.router.add_post("/sized/{n}", sized)
    app.router.add_post("/chunked/{n}", chunked)
    async with serve_app(app) as url:
        yield url


@pytest.mark.parametrize("path", ["sized", "chunked"])
@pytest.mark.parametrize("size", [LIMIT, LIMIT + 4096])
async def test_an_answer_is_read_up_to_the_bound_and_no_further(
    server: str, path: str, size: int, kind: str,
) -> None:
    url = server
    async with UpstreamClient(UpstreamConfig(max_answer_bytes=LIMIT,
                                             http_client=kind)) as upstream:
        response = await upstream.post(f"{url}/{path}/{size}", b"", {})
        try:
            if size <= LIMIT:
                assert await response.read() == b"a" * size
                return
            with pytest.raises(UpstreamFailure) as failure:
                await response.read()
        finally:
            response.close()
    assert failure.value.kind is FailureKind.TOO_LARGE
