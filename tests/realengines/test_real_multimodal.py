"""Vision-language requests against a REAL vLLM 0.32 serving a tiny Qwen2.5-VL-shaped model.

The model (``make_models.py --qwen-vl``: the tiny Qwen3 text body, a 2-block vision tower,
patch 14, merge 2, the Qwen3.5 tokenizer and template) is built into the install if absent;
vLLM loads it only with ``tools/realengines/torchvision_shim.sh`` on its ``PYTHONPATH`` (see
docs/chat.md, "Media parts"), installed here into a temporary directory. Without either the
tests skip, saying why.

- ``tools/realengines/media_check.py`` against the engine: for five requests with images
  given as bytes, the prompt length, the stored blocks' tokens, ``extra_keys`` and engine
  hashes, the ingest's keys and the credit all equal what the gateway computes.
- Through the gateway (one engine, the ingest on its events): an image given as bytes and an
  immutable URL image sized by a bounded header read (``image_headers``; the engine fetches
  the URL itself from an image host on 127.0.0.1) are each ``exact_kv`` on their repeat, with
  the credit equal to the engine's ``cached_tokens``; a URL answering 404 is the gateway's 400.
"""

from __future__ import annotations

import asyncio
import base64
import http.server
import json
import os
import struct
import subprocess
import sys
import threading
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cortex.devcluster.cluster import ClusterSpec, LocalCluster
from cortex.hashing import Engine
from cortex.registry import discover
from cortex.testing.vllm_engines import BLOCK_SIZE, VllmEngine, VllmInstall

from .workload import post, report

pytestmark = [pytest.mark.realengine, pytest.mark.timeout(900)]

ROOT = Path(__file__).parents[2]
MODEL = "model-qwen-vl"


def png(width: int, height: int, shade: int) -> bytes:
    raw = b"".join(b"\x00" + bytes([shade, 90, 200 - shade]) * width for _ in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data)))

    return (b"\x89PNG\r\n\x1a\n"
            + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))


def data_url(image: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(image).decode()


@pytest.fixture(scope="module")
def vl_engine(install: VllmInstall, tmp_path_factory: pytest.TempPathFactory
              ) -> Iterator[VllmEngine]:
    if not (install.model_dir(MODEL) / "config.json").exists():
        built = subprocess.run(
            [str(install.python), str(ROOT / "tools" / "realengines" / "make_models.py"),
             str(install.root), "--qwen-tokenizer", str(ROOT / "tests" / "chat" / "data" /
                                                        "qwen3.5"), "--qwen-vl"],
            capture_output=True, text=True, timeout=600, check=False)
        if built.returncode != 0:
            pytest.skip(f"cannot build {MODEL}: {built.stderr[-500:]}")
    shim = tmp_path_factory.mktemp("torchvision")
    shimmed = subprocess.run(
        ["bash", str(ROOT / "tools" / "realengines" / "torchvision_shim.sh"), str(shim)],
        capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "CORTEX_REALVLLM": str(install.root)})
    if shimmed.returncode != 0:
        pytest.skip(f"no torchvision shim: {shimmed.stderr[-500:]}")
    engine = VllmEngine(install, tmp_path_factory.mktemp("vllm-vl"), model=MODEL,
                        env={"PYTHONPATH": str(shim)})
    try:
        engine.start()
        yield engine
    finally:
        engine.stop()


def test_the_engines_media_keys_are_the_gateways(install: VllmInstall, vl_engine: VllmEngine,
                                                 tmp_path: Path) -> None:
    out = tmp_path / "media_check.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "realengines" / "media_check.py"),
         "--url", vl_engine.url, "--events", f"tcp://127.0.0.1:{vl_engine.events_port}",
         "--model-dir", str(install.model_dir(MODEL)), "--model", vl_engine.served_name,
         "--out", str(out)], capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    report("media_check_vllm", {"rows": rows})
    repeat = rows[1]
    assert repeat["gateway_credit_tokens"] == repeat["cached_tokens"] > sum(
        repeat["image_tokens"])
    assert all(r["prompt_tokens"] == r["gateway_prompt_tokens"] for r in rows)


class _Images(http.server.BaseHTTPRequestHandler):
    """``/<shade>.png``: a 300 x 200 PNG; every request's path and Range header recorded."""

    seen: list[tuple[str, str | None]] = []

    def do_GET(self) -> None:
        self.seen.append((self.path, self.headers.get("Range")))
        name = self.path.strip("/").removesuffix(".png")
        if not name.isdigit():
            self.send_error(404)
            return
        body = png(300, 200, int(name))
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def image_host() -> Iterator[str]:
    _Images.seen = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def gateway(install: VllmInstall, vl_engine: VllmEngine,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    found = asyncio.run(discover(vl_engine.url))
    spec = found.spec(worker_id="vllm-vl")
    config = {"models": [{"name": spec.model, "engine": "vllm", "block_size": BLOCK_SIZE,
                          "tokenizer": str(install.model_dir(MODEL)), "immutable_urls": True,
                          "image_headers": True, "image_header_bytes": 4096}]}
    cluster_spec = ClusterSpec(workers=0, port=0, external=(spec,), model=spec.model,
                               engine=Engine.VLLM, block_size=BLOCK_SIZE, lease_ttl_s=3,
                               gateway_config=config, ready_timeout_s=120)
    with LocalCluster(cluster_spec, tmp_path_factory.mktemp("cluster")) as started:
        yield started


def _ask(model: str, system: str, image: str) -> dict[str, Any]:
    return {"model": model, "max_tokens": 1, "temperature": 0, "messages": [
        {"role": "system", "content": system},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                     {"type": "text", "text": "What is in this picture?"}]}]}


def _repeat_until_exact(url: str, body: dict[str, Any]) -> list[tuple[str, int, int]]:
    """Send ``body`` until the gateway credits exactly what the engine reports cached (the
    engine's KV events reach the ledger within moments); every answer's (mode, credit,
    cached). Never a credit over the engine's."""
    status, _, raw = post(url, body)
    assert status == 200, raw[:300]
    seen = []
    for _ in range(20):
        status, headers, raw = post(url, body)
        assert status == 200, raw[:300]
        cached = json.loads(raw)["usage"]["prompt_tokens_details"]["cached_tokens"]
        hit = int(headers["x-cortex-cache-hit-tokens"])
        assert hit <= cached
        seen.append((headers["x-cortex-match-mode"], hit, cached))
        if seen[-1][0] == "exact_kv" and hit == cached:
            break
    return seen


def test_images_as_bytes_and_by_url_are_exact_through_the_gateway(
        gateway: LocalCluster, vl_engine: VllmEngine, image_host: str) -> None:
    url = gateway.gateway_urls[0] + "/v1/chat/completions"
    model = vl_engine.served_name
    as_bytes = _repeat_until_exact(url, _ask(model, "Look closely. " * 12,
                                             data_url(png(300, 200, 61))))
    by_url = _repeat_until_exact(url, _ask(model, "Describe it for a child. " * 8,
                                           image_host + "/62.png"))
    report("media_gateway_vllm", {"bytes": as_bytes, "url": by_url, "host": _Images.seen})
    for seen in (as_bytes, by_url):
        mode, hit, cached = seen[-1]
        assert mode == "exact_kv" and hit == cached > 77, seen  # 77 image tokens
    ranged = [r for p, r in _Images.seen if r is not None]
    fetched = [p for p, r in _Images.seen if r is None]
    assert ranged == ["bytes=0-4095"]  # one header read by the gateway, its size kept
    assert set(fetched) == {"/62.png"}  # the engine fetched the image itself
    status, _, raw = post(url, _ask(model, "Look closely. " * 12, image_host + "/gone.png"))
    assert status == 400 and b"HTTP 404" in raw
    assert ("/gone.png", None) not in _Images.seen  # refused before the engine saw it
