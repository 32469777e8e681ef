"""``cortex.bench.overhead``'s raw floor (asyncio protocols passing bytes, no HTTP library)
relays a worker's chunked streams untouched, request after request on one connection, on
127.0.0.1."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web

from cortex.bench.overhead import _raw_floor
from cortex.testing import free_port, serve_app, wait_until_async

pytestmark = pytest.mark.timeout(30)

EVENTS = [b'data: {"n": %d}\n\n' % i for i in range(5)] + [b"data: [DONE]\n\n"]


PEERS: list[object] = []  # where each request came from


async def _stream(request: web.Request) -> web.StreamResponse:
    assert request.transport is not None
    PEERS.append(request.transport.get_extra_info("peername"))
    body = await request.read()
    response = web.StreamResponse(headers={"content-type": "text/event-stream",
                                           "x-asked": str(len(body))})
    response.enable_chunked_encoding()
    await response.prepare(request)
    for event in EVENTS:
        await response.write(event)
    await response.write_eof()
    return response


async def _listening(port: int) -> bool:
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return False
    writer.close()
    return True


async def test_the_raw_floor_relays_each_stream_untouched_on_one_connection() -> None:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", _stream)
    port = free_port()
    async with serve_app(app) as worker:
        floor = asyncio.create_task(_raw_floor(port, worker))
        try:
            await wait_until_async(lambda: _listening(port), timeout=10, what="the floor")
            async with aiohttp.ClientSession() as session:
                for ask in (b'{"a": 1}', b'{"question": 2}'):
                    async with session.post(f"http://127.0.0.1:{port}/v1/chat/completions",
                                            data=ask) as response:
                        assert response.headers["x-asked"] == str(len(ask))
                        assert await response.read() == b"".join(EVENTS)
            # one connection from the floor, kept alive: so was the client's to the floor
            assert len(PEERS) == 2 and PEERS[0] == PEERS[1]
        finally:
            floor.cancel()
