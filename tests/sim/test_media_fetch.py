"""The simulated vLLM engine fetches URL images as vLLM does: a real image host on
127.0.0.1; the bytes are inlined as a data URL, an unreadable URL is the request's error."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from cortex.sim.media_fetch import inline_image_urls
from cortex.sim.protocol import RequestError
from cortex.testing import serve_app

pytestmark = pytest.mark.timeout(20)

PNG = b"\x89PNG\r\n\x1a\n" + b"pretend"


@pytest.fixture
async def host() -> AsyncIterator[str]:
    async def image(request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        if name == "pieces.png":  # a slow link: the image's bytes in two pieces
            response = web.StreamResponse(headers={"Content-Type": "image/png"})
            await response.prepare(request)
            await response.write(PNG[:8])
            await asyncio.sleep(0.05)
            await response.write(PNG[8:])
            await response.write_eof()
            return response
        if name != "a.png":
            return web.Response(status=404)
        return web.Response(body=PNG, content_type="image/png")

    app = web.Application()
    app.router.add_get("/{name}", image)
    async with serve_app(app) as url:
        yield url


def _body(*urls: str) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": [
        *({"type": "image_url", "image_url": {"url": u}, "uuid": "kept"} for u in urls),
        {"type": "text", "text": "what?"}]}]}


async def test_url_images_are_inlined_as_their_bytes(host: str) -> None:
    body = _body(host + "/a.png", "data:image/png;base64,AAAA")
    out = await inline_image_urls(body)
    parts = out["messages"][0]["content"]
    assert parts[0]["image_url"]["url"] == "data:image/png;base64," + base64.b64encode(
        PNG).decode()
    assert parts[0]["uuid"] == "kept" and parts[1] == body["messages"][0]["content"][1]
    assert body["messages"][0]["content"][0]["image_url"]["url"] == host + "/a.png"
    pieces = await inline_image_urls(_body(host + "/pieces.png"))
    assert pieces["messages"][0]["content"][0]["image_url"]["url"] == parts[0]["image_url"]["url"]
    plain = _body("data:image/png;base64,AAAA")
    assert await inline_image_urls(plain) is plain


async def test_an_unreadable_url_is_the_requests_error(host: str) -> None:
    with pytest.raises(RequestError, match="HTTP 404"):
        await inline_image_urls(_body(host + "/b.png"))
    with pytest.raises(RequestError, match="failed to fetch"):
        await inline_image_urls(_body("http://127.0.0.1:9/x.png"))
