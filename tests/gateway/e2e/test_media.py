"""Vision-language requests end to end: real Redis, index, ingest, vLLM sims serving a
Qwen2.5-VL-shaped model (the Qwen3.5 tokenizer and template, Qwen-VL processor settings) and
the gateway on 127.0.0.1. Media parts are relayed, never refused; an image given as bytes is
keyed exactly (its identifier is the part's ``uuid``, which the gateway writes), so a repeat is
``exact_kv`` with the credited tokens equal to the engine's cached tokens; nothing is ever
credited past what the engine holds."""

from __future__ import annotations

import base64
import gzip
import json
import random
import shutil
import struct
import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from cortex.gateway.config.gateway import ModelConfig
from cortex.hashing import Engine
from cortex.index.server import IndexServer
from cortex.testing import RedisServer, serve_app

from ..conftest import BLOCK, MODEL, StartGateway, StartSim
from .test_cluster import cluster, wait_index_holds

pytestmark = pytest.mark.timeout(120)

QWEN = Path(__file__).parents[2] / "chat" / "data" / "qwen3.5"
PAD = 248056


@pytest.fixture
def redis(redis_server: RedisServer) -> RedisServer:
    return redis_server


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Qwen3.5 tokenizer beside a Qwen2.5-VL config and processor config."""
    out = tmp_path_factory.mktemp("qwen-vl")
    for name in ("tokenizer.json.gz", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(QWEN / name, out / name)
    (out / "config.json").write_text(json.dumps({
        "model_type": "qwen2_5_vl", "image_token_id": PAD, "video_token_id": PAD + 1,
        "vision_config": {"patch_size": 14, "spatial_merge_size": 2}}))
    (out / "preprocessor_config.json").write_text(json.dumps(
        {"min_pixels": 3136, "max_pixels": 1003520, "patch_size": 14, "merge_size": 2}))
    assert gzip.decompress((out / "tokenizer.json.gz").read_bytes())
    return out


def png(width: int, height: int, shade: int) -> str:
    """A data URL of a ``width`` x ``height`` PNG of one colour."""
    raw = b"".join(b"\x00" + bytes([shade, 40, 90]) * width for _ in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data)))

    data = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2,
                                                              0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))
    return "data:image/png;base64," + base64.b64encode(data).decode()


@dataclass
class ImageServer:
    """An image host on 127.0.0.1: ``/<shade>.png`` is a 300 x 200 PNG of that shade;
    ``seen`` lists each request's path and ``Range`` header (the gateway's header reads send
    one, the engine's fetches do not)."""

    url: str
    seen: list[tuple[str, str | None]] = field(default_factory=list)


@pytest.fixture
async def images() -> AsyncIterator[ImageServer]:
    server = ImageServer("")

    async def image(request: web.Request) -> web.Response:
        server.seen.append((request.path, request.headers.get("Range")))
        name = request.match_info["name"]
        if not name.removesuffix(".png").isdigit():
            return web.Response(status=404)
        data = base64.b64decode(png(300, 200, int(name.removesuffix(".png"))).partition(",")[2])
        return web.Response(body=data, content_type="image/png")

    app = web.Application()
    app.router.add_get("/{name}", image)
    async with serve_app(app) as server.url:
        yield server


def ask(system: str, image: str, question: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 4, "messages": [
        {"role": "system", "content": system},
        {"role": "user", "content": [{"type": "text", "text": question},
                                     {"type": "image_url", "image_url": {"url": image}},
                                     {"type": "text", "text": "Answer briefly."}]}], **extra}


SYSTEM = "You are a careful visual assistant. " * 6


async def start_cluster(start_sim: StartSim, model_dir: Path, count: int) -> dict[str, Any]:
    return {f"w{i}": await start_sim(engine=Engine.VLLM, engine_version="0.33.0",
                                     tokenizer=str(model_dir)) for i in range(count)}


async def test_a_repeated_image_is_exact_kv_and_credited_as_the_engine_caches(
    redis: RedisServer, index_server: IndexServer, start_sim: StartSim,
    start_gateway: StartGateway, http: aiohttp.ClientSession, model_dir: Path,
) -> None:
    sims = await start_cluster(start_sim, model_dir, 3)
    models = (ModelConfig(name=MODEL, block_size=BLOCK, engine=Engine.VLLM,
                          tokenizer=model_dir),)
    async with cluster(redis, index_server, sims, start_gateway, http, models=models) as c:
        body = ask(SYSTEM, png(300, 200, 7), "What is in this picture?")
        headers, cached = await c.send(body)
        holder = headers["x-cortex-assigned-worker"]
        assert cached == 0
        await wait_index_holds(c, body, holder)
        explained = await c.candidate(body, holder)
        # 77 placeholder tokens: every full block of the prompt is keyed and held
        assert explained["index_tokens"] > 77
        headers, cached = await c.send(body)
        assert headers["x-cortex-assigned-worker"] == holder
        assert headers["x-cortex-match-mode"] == "exact_kv"
        assert int(headers["x-cortex-cache-hit-tokens"]) == cached > 77
        # another image after the same text: only the blocks before it are credited
        other = ask(SYSTEM, png(300, 200, 8), "What is in this picture?")
        headers, cached = await c.send(other)
        hit = int(headers["x-cortex-cache-hit-tokens"])
        assert headers["x-cortex-assigned-worker"] == holder and 0 < hit == cached
        metrics = await (await http.get(c.gateway.url + "/metrics")).text()
        assert 'cortex_gateway_cache_prediction_total{outcome="over"}' not in metrics


async def test_a_random_media_workload_is_never_over_credited(
    redis: RedisServer, index_server: IndexServer, start_sim: StartSim,
    start_gateway: StartGateway, http: aiohttp.ClientSession, model_dir: Path,
    images: ImageServer,
) -> None:
    """Repeated images, the same image in new conversations, different images after a
    shared text prefix, URL images (not keyed): the gateway's credit never exceeds the
    engine's cached tokens, and is equal to it for every repeat of a keyed image."""
    sims = await start_cluster(start_sim, model_dir, 3)
    models = (ModelConfig(name=MODEL, block_size=BLOCK, engine=Engine.VLLM,
                          tokenizer=model_dir),)
    rng = random.Random(31)
    pictures = [png(rng.choice((60, 100, 200, 300)), rng.choice((40, 90, 200)), shade)
                for shade in range(6)]
    systems = [SYSTEM, "Describe images for a blind reader. " * 5, "Be terse. " * 9]
    sent: list[dict[str, Any]] = []
    over = exact = hits = 0
    async with cluster(redis, index_server, sims, start_gateway, http, models=models) as c:
        for i in range(36):
            roll = rng.random()
            if sent and roll < 0.35:
                body = rng.choice(sent)  # a repeat
            elif roll < 0.55:
                body = ask(rng.choice(systems), rng.choice(pictures), "What is this?")
            elif roll < 0.65:
                body = ask(rng.choice(systems), f"{images.url}/{i % 3}.png", "What is this?")
            else:
                body = ask(SYSTEM, rng.choice(pictures), f"Question {rng.randrange(4)}?")
            headers, cached = await c.send(body)
            hit = int(headers["x-cortex-cache-hit-tokens"])
            over += hit > cached
            exact += hit == cached
            hits += hit > 0
            sent.append(body)
        metrics = await (await http.get(c.gateway.url + "/metrics")).text()
    assert over == 0
    assert hits >= 10 and exact >= 30
    assert 'cortex_gateway_cache_prediction_total{outcome="over"}' not in metrics




@pytest.mark.parametrize("immutable", [False, True])
async def test_without_header_reads_an_image_url_is_read_by_the_engine_only(
    redis: RedisServer, index_server: IndexServer, start_sim: StartSim,
    start_gateway: StartGateway, http: aiohttp.ClientSession, model_dir: Path,
    images: ImageServer, immutable: bool,
) -> None:
    """Without ``image_headers`` the gateway does no I/O for an image URL: the image host
    sees only the engine's whole-file fetches, and a repeat is credited only the text before
    the image — with ``immutable_urls`` too (the URL's hash then names the item)."""
    sims = await start_cluster(start_sim, model_dir, 2)
    models = (ModelConfig(name=MODEL, block_size=BLOCK, engine=Engine.VLLM,
                          tokenizer=model_dir, immutable_urls=immutable),)
    async with cluster(redis, index_server, sims, start_gateway, http, models=models) as c:
        body = ask(SYSTEM, images.url + "/3.png", "What is in this picture?")
        headers, cached = await c.send(body)
        holder = headers["x-cortex-assigned-worker"]
        await wait_index_holds(c, body, holder)
        headers, cached = await c.send(body)
        hit = int(headers["x-cortex-cache-hit-tokens"])
        assert headers["x-cortex-assigned-worker"] == holder
        assert 0 < hit < cached and cached > 77  # the text before the image only
    assert images.seen == [("/3.png", None)] * 2  # one engine fetch per request


async def test_header_reads_key_an_immutable_url_image_exactly(
    redis: RedisServer, index_server: IndexServer, start_sim: StartSim,
    start_gateway: StartGateway, http: aiohttp.ClientSession, model_dir: Path,
    images: ImageServer,
) -> None:
    """With ``immutable_urls`` and ``image_headers`` the gateway reads the first bytes of a
    URL image (a ranged GET) for its size: a repeat is ``exact_kv`` with the credit equal to
    the engine's cached tokens, as for an image given as bytes. A URL that answers an error
    is refused with a 400 before any worker sees it."""
    sims = await start_cluster(start_sim, model_dir, 2)
    models = (ModelConfig(name=MODEL, block_size=BLOCK, engine=Engine.VLLM,
                          tokenizer=model_dir, immutable_urls=True, image_headers=True,
                          image_header_bytes=1024),)
    async with cluster(redis, index_server, sims, start_gateway, http, models=models) as c:
        body = ask(SYSTEM, images.url + "/4.png", "What is in this picture?")
        headers, cached = await c.send(body)
        holder = headers["x-cortex-assigned-worker"]
        await wait_index_holds(c, body, holder)
        headers, cached = await c.send(body)
        assert headers["x-cortex-assigned-worker"] == holder
        assert headers["x-cortex-match-mode"] == "exact_kv"
        assert int(headers["x-cortex-cache-hit-tokens"]) == cached > 77
        ranged = [r for _, r in images.seen if r is not None]
        assert ranged == ["bytes=0-1023"]  # one header read: an immutable URL's size is kept
        async with http.post(c.gateway.url + "/v1/chat/completions",
                             json=ask(SYSTEM, images.url + "/gone.png", "And this?")) as resp:
            assert resp.status == 400
            error = (await resp.json())["error"]
        assert "HTTP 404" in error["message"] and error["param"] == "messages"
    assert ("/gone.png", None) not in images.seen  # refused before any engine fetched it
