"""``cortex bench media``: what an image costs on the proxy path, against ``sglang-router``.

One vLLM ``cortex sim`` in zero-cost mode serving the multimodal benchmark's
Qwen2.5-VL-shaped model (:mod:`cortex.bench.routing.vision`), ``cortex gateway`` (with its
index, ingest and Redis) and ``sglang-router`` (cache_aware) in front of it, all on
127.0.0.1. This process sends sequential streamed chat requests, each with one image given
as a base64 ``data:`` URL, interleaved across direct / cortex / sglang-router, for images of
a few sizes (one colour, as in the routing benchmark, then random pixels, so the encoded size
is what the pixels say); every image is new
(nothing cached, the worst case for the gateway: it identifies and sizes every one). The
report gives each target's TTFT p50 / p90 and the p50 added over calling the sim directly.

With ``--profile``, py-spy samples the gateway during a closed loop of requests with the
largest image (``--profile-image flat``: the one-colour one; ``--nonblocking --gil``); the top
frames and the gateway's CPU time per request go into the report.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import io
import random
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from cortex.bench.procstat import cpu_s
from cortex.bench.pyspy import find_py_spy, record, top_frames_table
from cortex.bench.report import publish
from cortex.devcluster.cluster import ClusterSpec, LocalCluster, probe_http
from cortex.devcluster.supervisor import Supervisor
from cortex.hashing import Engine
from cortex.testing import free_port, sglang_router_argv, wait_until

__all__ = ["register", "run"]

MODEL = "cortex-sim"
SIZES = ((224, 224, "flat PNG"), (224, 224, "PNG"), (640, 480, "JPEG"), (1280, 960, "PNG"))
"""(width, height, format) of the images: one colour (a few hundred bytes, as in the routing
benchmark's multimodal workload), then random pixels: ~150 KB, ~270 KB, ~3.6 MB encoded."""


def register(bench_subparsers: argparse._SubParsersAction[Any]) -> None:
    parser = bench_subparsers.add_parser(
        "media", help="proxy cost of chat requests with an image, vs sglang-router")
    parser.add_argument("--requests", type=int, default=40,
                        help="sequential requests per (image size, target)")
    parser.add_argument("--profile", action="store_true",
                        help="py-spy samples the gateway under a closed loop of image requests")
    parser.add_argument("--profile-s", type=float, default=8.0, help="seconds sampled")
    parser.add_argument("--profile-image", choices=("largest", "flat"), default="largest",
                        help="the image of the profiled closed loop")
    parser.add_argument("--py-spy", default="", help="py-spy executable (default: on PATH)")
    parser.add_argument("--out", default="docs/bench/media.md", help="report path")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    report = asyncio.run(_bench(args)) if not args.profile else _run_profiled(args)
    publish(report, Path(args.out))
    return 0


def _run_profiled(args: argparse.Namespace) -> str:
    args.py_spy = find_py_spy(args.py_spy)
    return asyncio.run(_bench(args))


@dataclass
class _Targets:
    direct: str
    cortex: str
    router: str
    gateway_pid: int


@contextlib.contextmanager
def _deployment(model_dir: Path, logs: Path) -> Iterator[_Targets]:
    config = {"models": [{"name": MODEL, "engine": "vllm", "block_size": 16,
                          "tokenizer": str(model_dir)}]}
    spec = ClusterSpec(workers=1, gateways=1, port=0, engine=Engine.VLLM, model=MODEL,
                       block_size=16, kv_capacity_blocks=65536, max_running=256,
                       zero_cost=True, gateway_config=config,
                       sim_args=("--tokenizer", str(model_dir), "--output-tokens", "4:4",
                                 "--log-level", "warning"),
                       index_args=("--log-level", "WARNING"),
                       ingest_args=("--log-level", "WARNING"),
                       gateway_args=("--log-level", "warning"))
    with LocalCluster(spec, logs) as local, Supervisor(logs / "router") as extra:
        worker = next(iter(local.workers.values())).url
        port = free_port()
        router = extra.start("sglang-router", sglang_router_argv(port, "cache_aware", [worker]))
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: probe_http(url + "/v1/models"), 60, 0.1, "sglang-router")
        del router
        yield _Targets(worker, local.gateway_urls[0], url, local.process("gateway-0").pid)


def _image(rng: random.Random, width: int, height: int, fmt: str) -> str:
    from PIL import Image

    if fmt.startswith("flat "):  # one colour: a new image every time, a few hundred bytes
        fmt = fmt.removeprefix("flat ")
        pixels = Image.new("RGB", (width, height), tuple(rng.randbytes(3)))
    else:
        pixels = Image.frombytes("RGB", (width, height), rng.randbytes(width * height * 3))
    out = io.BytesIO()
    pixels.save(out, fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(out.getvalue()).decode()


def _body(url: str, k: int) -> dict[str, Any]:
    return {"model": MODEL, "stream": True, "max_tokens": 4, "messages": [
        {"role": "system", "content": "You describe pictures in one short sentence."},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                     {"type": "text", "text": f"What is in picture {k}?"}]}]}


async def _ttft(session: aiohttp.ClientSession, url: str, raw: bytes) -> float:
    """Seconds to the first streamed chunk with content (the whole stream is read)."""
    started = time.perf_counter()
    first: float | None = None
    async with session.post(url + "/v1/chat/completions", data=raw,
                            headers={"Content-Type": "application/json"}) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status}: {(await resp.text())[:300]}")
        async for line in resp.content:
            if first is None and line.startswith(b"data: {") and b'"content"' in line:
                first = time.perf_counter() - started
    if first is None:
        raise RuntimeError(f"{url}: no content chunk")
    return first


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _bench(args: argparse.Namespace) -> str:
    import json

    from cortex.bench.routing.vision import write_vision_model

    rng = random.Random(31)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="cortex-bench-media-") as tmp:
        model_dir = write_vision_model(Path(tmp) / "model")
        with _deployment(model_dir, Path(tmp) / "logs") as t:
            names = {"direct": t.direct, "cortex": t.cortex, "sglang-router": t.router}
            rows: list[str] = []
            connector = aiohttp.TCPConnector(force_close=True, limit=0)
            async with aiohttp.ClientSession(connector=connector) as session:
                for width, height, fmt in SIZES:
                    times: dict[str, list[float]] = {name: [] for name in names}
                    sample = _image(rng, width, height, fmt)
                    for k in range(args.requests + 3):  # the first 3 warm up
                        for name, url in names.items():
                            raw = json.dumps(_body(_image(rng, width, height, fmt), k)).encode()
                            took = await _ttft(session, url, raw)
                            if k >= 3:
                                times[name].append(took * 1e3)
                    base = _pct(times["direct"], 0.5)
                    for name in names:
                        p50 = _pct(times[name], 0.5)
                        rows.append(f"| {width}x{height} {fmt} | {len(sample) / 1024:,.0f} KiB"
                                    f" | {name} | {p50:.2f} | {_pct(times[name], 0.9):.2f} |"
                                    f" {p50 - base:+.2f} |")
                profile = await _profiled(args, session, t, rng) if args.profile else []
    lines = [
        "# What an image costs on the proxy path: Cortex vs sglang-router",
        "",
        f"`cortex bench media --requests {args.requests}"
        f"{' --profile' if args.profile else ''}"
        f"{' --profile-image flat' if args.profile and args.profile_image == 'flat' else ''}`"
        f" — {time.strftime('%Y-%m-%d')},"
        f" {(time.monotonic() - started) / 60:.1f} min on this machine.",
        "",
        __doc__.split("\n\n", 1)[1].strip() if __doc__ else "",
        "",
        "| image | data URL | target | TTFT p50 ms | TTFT p90 ms | p50 added over direct ms |",
        "|---|---:|---|---:|---:|---:|",
        *rows,
    ]
    if profile:
        lines += ["", f"## Where the gateway's time goes ({args.profile_image} image, closed loop)",
                  "",
                  *profile]
    return "\n".join(lines) + "\n"


async def _profiled(args: argparse.Namespace, session: aiohttp.ClientSession, t: _Targets,
                    rng: random.Random) -> list[str]:
    """py-spy's top frames of the gateway under 4 clients sending one image size."""
    import json

    width, height, fmt = SIZES[-1] if args.profile_image == "largest" else SIZES[0]
    bodies = [json.dumps(_body(_image(rng, width, height, fmt), k)).encode() for k in range(8)]
    with tempfile.NamedTemporaryFile(suffix=".txt") as raw:
        cpu0 = cpu_s(t.gateway_pid) or 0.0
        spy = record(args.py_spy, t.gateway_pid, args.profile_s, Path(raw.name))
        deadline = time.monotonic() + args.profile_s
        count = 0

        async def client(k: int) -> None:
            nonlocal count
            while time.monotonic() < deadline:
                await _ttft(session, t.cortex, bodies[(k + count) % len(bodies)])
                count += 1

        await asyncio.gather(*(client(k) for k in range(4)))
        used = (cpu_s(t.gateway_pid) or 0.0) - cpu0
        await asyncio.to_thread(spy.wait, args.profile_s + 30)
        return [f"{count} requests in {args.profile_s:g} s; the gateway process's CPU time"
                f" {used / max(count, 1) * 1e3:.2f} ms per request (py-spy's sampling"
                " included).", "",
                *top_frames_table(Path(raw.name), 25)]
