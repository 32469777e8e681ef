"""cortex.edge.http: an ops endpoint on 127.0.0.1, port 0 or a port already taken."""

from __future__ import annotations

import aiohttp
import pytest
from aiohttp import web

from cortex.edge.http import start_ops_http

pytestmark = pytest.mark.timeout(10)


def app() -> web.Application:
    async def live(_: web.Request) -> web.Response:
        return web.json_response({"status": "live"})

    application = web.Application()
    application.router.add_get("/health/live", live)
    return application


async def test_port_0_serves_on_the_port_it_reports() -> None:
    runner, port = await start_ops_http(app(), "127.0.0.1", 0)
    try:
        assert port > 0
        async with aiohttp.ClientSession() as session, \
                session.get(f"http://127.0.0.1:{port}/health/live") as response:
            assert response.status == 200 and await response.json() == {"status": "live"}
    finally:
        await runner.cleanup()


async def test_a_port_taken_is_an_os_error() -> None:
    runner, port = await start_ops_http(app(), "127.0.0.1", 0)
    try:
        with pytest.raises(OSError):
            await start_ops_http(app(), "127.0.0.1", port)
    finally:
        await runner.cleanup()
