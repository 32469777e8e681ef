"""Bounded image header reads against a real aiohttp image server on 127.0.0.1: ranged and
range-ignoring servers, endless and stalled bodies, error statuses, oversize images,
redirects, unreachable and invalid URLs."""

from __future__ import annotations

import asyncio
import base64
import struct
import zlib
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from cortex.chat.imagesize import image_size
from cortex.gateway.errors import ClientError
from cortex.gateway.upstream.images import MAX_REDIRECTS, ImageHeaders
from cortex.testing.procs import free_port, serve_app

pytestmark = pytest.mark.timeout(20)


def png(width: int, height: int) -> bytes:
    raw = b"".join(b"\x00" + bytes([9, 40, 90]) * width for _ in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data)))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2,
                                                              0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw, 0)) + chunk(b"IEND", b""))


IMAGE = png(300, 200)  # stored uncompressed: ~180 kB


class Images:
    """The image server's routes; ``sent`` counts body bytes written per path."""

    def __init__(self) -> None:
        self.sent: dict[str, int] = {}
        self.ranges: list[str | None] = []
        self.stop = asyncio.Event()
        self.ended = asyncio.Event()  # the endless body's writer saw the client leave

    async def ranged(self, request: web.Request) -> web.Response:
        self.ranges.append(request.headers.get("Range"))
        first, last = request.http_range.start or 0, (request.http_range.stop or 0) - 1
        body = IMAGE[first:last + 1]
        self.sent[request.path] = len(body)
        return web.Response(status=206, body=body, headers={
            "Content-Range": f"bytes {first}-{last}/{len(IMAGE)}",
            "Content-Type": "image/png"})

    async def whole(self, request: web.Request) -> web.Response:  # ignores Range
        self.sent[request.path] = len(IMAGE)
        return web.Response(body=IMAGE, content_type="image/png")

    async def endless(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "image/png"})
        await response.prepare(request)
        await response.write(IMAGE[:4096])
        self.sent[request.path] = 4096
        try:
            while not self.stop.is_set():  # a body with no end, until the client leaves
                await response.write(b"\0" * 4096)
                self.sent[request.path] += 4096
        finally:
            self.ended.set()
        return response

    async def stalled(self, request: web.Request) -> web.StreamResponse:
        await self.stop.wait()
        return web.Response(body=IMAGE)

    async def huge(self, request: web.Request) -> web.Response:
        return web.Response(status=206, body=IMAGE[:1024], headers={
            "Content-Range": f"bytes 0-1023/{50 << 20}"})

    async def missing(self, request: web.Request) -> web.Response:
        return web.Response(status=404)

    async def loop(self, request: web.Request) -> web.Response:
        raise web.HTTPFound("/loop")


@pytest.fixture
async def server() -> AsyncIterator[tuple[str, Images]]:
    images = Images()
    app = web.Application()
    for name in ("ranged", "whole", "endless", "stalled", "huge", "missing", "loop"):
        app.router.add_get(f"/{name}", getattr(images, name))
    async with serve_app(app) as url:
        try:
            yield url, images
        finally:
            images.stop.set()


@pytest.fixture
async def headers() -> AsyncIterator[ImageHeaders]:
    async with ImageHeaders() as reader:
        yield reader


LIMITS = {"max_bytes": 1 << 20, "header_bytes": 2048, "timeout_s": 2.0}


async def test_a_ranged_read_gives_the_size_from_the_first_bytes(
        server: tuple[str, Images], headers: ImageHeaders) -> None:
    url, images = server
    got = await headers.read(url + "/ranged", **LIMITS)
    assert got is not None and not got.complete and len(got.data) == 2048
    assert images.ranges == ["bytes=0-2047"] and images.sent["/ranged"] == 2048
    assert image_size(got.data, complete=False) == (300, 200)


async def test_a_server_ignoring_the_range_is_cut_off_after_the_header(
        server: tuple[str, Images], headers: ImageHeaders) -> None:
    url, images = server
    got = await headers.read(url + "/whole", **LIMITS)
    assert got is not None and got.data == IMAGE[:2048] and not got.complete
    small = await headers.read(url + "/whole", **{**LIMITS, "header_bytes": 1 << 20})
    assert small is not None and small.complete and small.data == IMAGE
    endless = await headers.read(url + "/endless", **LIMITS)
    assert endless is not None and len(endless.data) == 2048 and not endless.complete
    await asyncio.wait_for(images.ended.wait(), 5)  # the connection was closed, not drained
    assert not images.stop.is_set()


async def test_a_stalled_server_is_a_timeout_not_an_error(
        server: tuple[str, Images], headers: ImageHeaders) -> None:
    url, _ = server
    loop = asyncio.get_running_loop()
    started = loop.time()
    assert await headers.read(url + "/stalled", **{**LIMITS, "timeout_s": 0.3}) is None
    assert loop.time() - started < 5  # bounded by the read's timeout, not the server
    assert await headers.read(url + "/stalled", **LIMITS, deadline=0.0) is None  # past it


async def test_bad_urls_and_oversize_images_are_client_errors(
        server: tuple[str, Images], headers: ImageHeaders) -> None:
    url, _ = server
    cases = {url + "/missing": (400, "HTTP 404"), url + "/huge": (413, "52,428,800 bytes"),
             url + "/loop": (400, f"more than {MAX_REDIRECTS} times"),
             f"http://127.0.0.1:{free_port()}/x.png": (400, "cannot be read"),
             "ftp://127.0.0.1/x.png": (400, "not an http(s) URL"),
             "http://[::1/x.png": (400, "not a valid URL")}
    for bad, (status, why) in cases.items():
        with pytest.raises(ClientError) as caught:
            await headers.read(bad, **LIMITS)
        assert caught.value.status == status and why in caught.value.message, bad
        assert caught.value.param == "messages"


async def test_a_closed_reader_refuses() -> None:
    reader = ImageHeaders()
    with pytest.raises(RuntimeError):
        await reader.read("http://127.0.0.1/x", **LIMITS)
    async with reader:
        pass
    assert "open=False" in repr(reader)
    with pytest.raises(RuntimeError):
        await reader.read("http://127.0.0.1/x", **LIMITS)


def test_the_test_image_is_a_png_of_its_size() -> None:
    assert image_size(IMAGE) == (300, 200)
    assert base64.b64encode(IMAGE[:8]) == b"iVBORw0KGgo="


async def test_sizes_are_read_once_per_url_and_timeouts_are_not_remembered(
        server: tuple[str, Images], headers: ImageHeaders) -> None:
    url, images = server
    for _ in range(3):
        assert await headers.size(url + "/ranged", **LIMITS) == (300, 200)
    assert images.ranges == ["bytes=0-2047"] and headers.reads == 1
    assert await headers.size(url + "/stalled", **{**LIMITS, "timeout_s": 0.2}) is None
    assert await headers.size(url + "/stalled", **{**LIMITS, "timeout_s": 0.2}) is None
    assert headers.reads == 3  # a timeout is tried again next time
    with pytest.raises(ClientError):
        await headers.size(url + "/missing", **LIMITS)
