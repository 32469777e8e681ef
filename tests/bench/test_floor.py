"""``cortex.bench.overhead``'s raw floor (asyncio protocols passing bytes, no HTTP library)
relays a worker's chunked streams untouched, request after request on one connection, on
127.0.0.1."""

from __future__ import annotations

import aiohttp
import pytest
from aiohttp import web

from cortex.bench.overhead import start_raw_floor
from cortex.testing import free_port, serve_app

pytestmark = pytest.mark.timeout(30)

EVENTS = [b'data: {"n": %d}\n\n' % i for i in range(5)] + [b"data: [DONE]\n\n"]


async def test_the_raw_floor_relays_each_stream_untouched_on_one_connection() -> None:
    peers: list[object] = []  # where each request came from

    async def stream(request: web.Request) -> web.StreamResponse:
        assert request.transport is not None
        peers.append(request.transport.get_extra_info("peername"))
        body = await request.read()
        response = web.StreamResponse(headers={"content-type": "text/event-stream",
                                               "x-asked": str(len(body))})
        response.enable_chunked_encoding()
        await response.prepare(request)
        for event in EVENTS:
            await response.write(event)
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", stream)
    port = free_port()
    async with serve_app(app) as worker:
        floor = await start_raw_floor(port, worker)
        try:
            async with aiohttp.ClientSession() as session:
                for ask in (b'{"a": 1}', b'{"question": 2}'):
                    async with session.post(f"http://127.0.0.1:{port}/v1/chat/completions",
                                            data=ask) as response:
                        assert response.headers["x-asked"] == str(len(ask))
                        assert await response.read() == b"".join(EVENTS)
            # one connection from the floor, kept alive: so was the client's to the floor
            assert len(peers) == 2 and peers[0] == peers[1]
        finally:
            floor.close()
