"""The answer-size bound of UpstreamResponse.read (cortex.gateway.upstream.client) against
a real HTTP server on 127.0.0.1: an answer announcing or reaching more than
``upstream.max_answer_bytes`` is a ``too_large`` failure and is not read further."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from cortex.gateway.config.gateway import UpstreamConfig
from cortex.gateway.upstream.client import FailureKind, UpstreamClient, UpstreamFailure

pytestmark = pytest.mark.timeout(30)

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
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield f"http://127.0.0.1:{port}"
    await runner.cleanup()


@pytest.mark.parametrize("path", ["sized", "chunked"])
@pytest.mark.parametrize("size", [LIMIT, LIMIT + 4096])
async def test_an_answer_is_read_up_to_the_bound_and_no_further(
    server: str, path: str, size: int,
) -> None:
    url = server
    async with UpstreamClient(UpstreamConfig(max_answer_bytes=LIMIT)) as upstream:
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
