"""The fault suite's misbehaving peers, against real sockets on 127.0.0.1."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from cortex.bench.faults_agents import SlowBodyClients, StallProxy
from cortex.testing import wait_until_async


@pytest.fixture
async def upstream() -> AsyncIterator[int]:
    """A server answering ``/sse`` with three events and ``/json`` with a small body."""

    async def sse(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        for i in range(3):
            await response.write(f"data: {i}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        return response

    async def body(_: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_get("/sse", sse)
    app.router.add_get("/json", body)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    finally:
        await runner.cleanup()


async def lines_of(url: str, timeout_s: float) -> list[bytes]:
    got: list[bytes] = []
    async with aiohttp.ClientSession() as session, session.get(url) as resp:
        try:
            async with asyncio.timeout(timeout_s):
                async for line in resp.content:
                    got.append(line.strip())
        except (TimeoutError, aiohttp.ClientPayloadError):
            pass
    return [line for line in got if line]


@pytest.mark.timeout(20)
async def test_the_stall_proxy_relays_then_holds_a_stream_after_its_first_event(
    upstream: int,
) -> None:
    proxy = StallProxy("127.0.0.1", upstream)
    await proxy.start()
    base = f"http://127.0.0.1:{proxy.port}"
    try:
        assert await lines_of(base + "/sse", 5) == [b"data: 0", b"data: 1", b"data: 2",
                                                    b"data: [DONE]"]
        proxy.stall()
        async with aiohttp.ClientSession() as session, session.get(base + "/json") as resp:
            assert await resp.json() == {"ok": True}  # a body without events is not held
        stalled = asyncio.ensure_future(lines_of(base + "/sse", 10))
        await wait_until_async(lambda: proxy.stalled == 1, timeout=5)
        assert not stalled.done()  # held open: no more data, no end
        await proxy.release()  # the held client sees the connection end
        assert await stalled == [b"data: 0"]
        assert len(await lines_of(base + "/sse", 5)) == 4  # relayed normally again
    finally:
        await proxy.close()


@pytest.mark.timeout(20)
async def test_slow_body_clients_notice_when_the_server_cuts_them() -> None:
    async def cut_after_headers(reader: asyncio.StreamReader,
                                writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.close()

    server = await asyncio.start_server(cut_after_headers, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    clients = SlowBodyClients("127.0.0.1", port, 3)
    clients.start()
    try:
        await wait_until_async(lambda: clients.closed_by_server == 3, timeout=10)
        assert clients.opened == 3 and clients.open == 0
        assert clients.first_closed_after_s is not None
    finally:
        await clients.stop()
        server.close()
