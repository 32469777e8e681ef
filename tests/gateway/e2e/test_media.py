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
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from cortex.gateway.config.gateway import ModelConfig
from cortex.hashing import Engine
from cortex.index.server import IndexServer
from cortex.testing import RedisServer

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
) -> None:
    """Repeated images, the same image in new conversations, different images after a
    shared text prefix, URL images (not keyed): the gateway's credit never exceeds the
    engine's cached tokens, and is equal to it for every repeat of a keyed image."""
    sims = await start_cluster(start_sim, model_dir, 3)
    models = (ModelConfig(name=MODEL, block_size=BLOCK, engine=Engine.VLLM,
                          tokenizer=model_dir),)
    rng = random.Random(31)
    images = [png(rng.choice((60, 100, 200, 300)), rng.choice((40, 90, 200)), shade)
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
                body = ask(rng.choice(systems), rng.choice(images), "What is this?")
            elif roll < 0.65:
                body = ask(rng.choice(systems), f"https://img.example/{i % 3}.png",
                           "What is this?")
            else:
                body = ask(SYSTEM, rng.choice(images), f"Question {rng.randrange(4)}?")
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
async def test_an_image_url_is_never_read_by_the_gateway(
    redis: RedisServer, index_server: IndexServer, start_sim: StartSim,
    start_gateway: StartGateway, http: aiohttp.ClientSession, model_dir: Path,
    immutable: bool,
) -> None:
    """The gateway does no I/O for an image URL (so none to bound): a real image server on
    127.0.0.1 sees no request from it, the request is relayed, and only the blocks before
    the image are credited — with ``immutable_urls`` too (the URL's hash names the item)."""
    from aiohttp import web

    seen: list[str] = []

    async def image(request: web.Request) -> web.Response:
        seen.append(request.path)
        return web.Response(body=base64.b64decode(png(300, 200, 5).partition(",")[2]),
                            content_type="image/png")

    app = web.Application()
    app.router.add_get("/{name}", image)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    url = f"http://127.0.0.1:{port}/cat.png"
    try:
        sims = await start_cluster(start_sim, model_dir, 2)
        models = (ModelConfig(name=MODEL, block_size=BLOCK, engine=Engine.VLLM,
                              tokenizer=model_dir, immutable_urls=immutable),)
        async with cluster(redis, index_server, sims, start_gateway, http,
                           models=models) as c:
            body = ask(SYSTEM, url, "What is in this picture?")
            headers, cached = await c.send(body)
            holder = headers["x-cortex-assigned-worker"]
            await wait_index_holds(c, body, holder)
            headers, cached = await c.send(body)
            hit = int(headers["x-cortex-cache-hit-tokens"])
            plain = len(SYSTEM.split()) // 2  # the system prompt alone is well past a block
            assert headers["x-cortex-assigned-worker"] == holder
            assert plain < hit < cached  # the text before the image only, never past it
    finally:
        await runner.cleanup()
    assert seen == []
