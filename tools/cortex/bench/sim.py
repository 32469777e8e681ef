"""``cortex bench sim``: how much one simulated worker process sustains (zero-cost mode).

Starts one ``cortex sim --zero-cost`` process per engine and drives it over HTTP from this
process with a fixed number of concurrent clients:

- *requests/s*: chat completions (non-streaming and streaming) with a short shared-prefix
  prompt, and ``/v1/completions`` with token-id prompts;
- *events/s*: completions with unique prompts into a small KV pool, so every request
  stores new blocks and evicts old ones; a ZMQ SUB in this process counts what arrives.

It also times the in-process event path alone (encode + PUB send) as the publisher's
ceiling. Writes a markdown report (default ``docs/bench/sim.md``).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import zmq
import zmq.asyncio

from cortex.bench.report import table
from cortex.hashing import Engine
from cortex.kvevents.codec import decode_batch
from cortex.kvevents.frames import parse_pub
from cortex.sim.cache import BlocksStored
from cortex.sim.config import FaultConfig
from cortex.sim.faults import FaultState
from cortex.sim.process import SimProcess
from cortex.sim.publisher import EventEncoder, EventPublisher

__all__ = ["register"]

_SYSTEM = "You are a concise assistant for a logistics company. Answer in one sentence."


@dataclass(frozen=True, slots=True)
class LoadResult:
    """One load phase: completed requests, errors, wall time (s), latency percentiles (ms)."""

    name: str
    requests: int
    errors: int
    seconds: float
    p50_ms: float
    p99_ms: float
    events: int = 0
    batches: int = 0
    blocks: int = 0
    """Block hashes carried by BlockStored + BlockRemoved events (SUB-side count)."""

    @property
    def rps(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0


def register(subparsers: argparse._SubParsersAction[Any]) -> None:
    p = subparsers.add_parser("sim", help="requests/s and events/s of one sim process",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--duration-s", type=float, default=8.0, help="length of each phase")
    p.add_argument("--concurrency", type=int, default=32, help="concurrent HTTP clients")
    p.add_argument("--engines", default="sglang,vllm", help="comma-separated engines")
    p.add_argument("--output", type=Path, default=Path("docs/bench/sim.md"))
    p.add_argument("--json", action="store_true", help="also print the results as JSON")
    p.set_defaults(func=run)


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


async def _drive(name: str, url: str, make_body: Callable[[int], dict[str, Any]], stream: bool,
                 concurrency: int, duration_s: float) -> LoadResult:
    latencies: list[float] = []
    errors = 0
    counter = 0
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        deadline = time.monotonic() + duration_s

        async def client() -> None:
            nonlocal errors, counter
            while time.monotonic() < deadline:
                counter += 1
                body = make_body(counter)
                path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
                start = time.monotonic()
                try:
                    async with session.post(url + path, json=body) as resp:
                        await resp.read()
                        ok = resp.status == 200
                except aiohttp.ClientError:
                    ok = False
                if ok:
                    latencies.append((time.monotonic() - start) * 1000.0)
                else:
                    errors += 1

        started = time.monotonic()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        seconds = time.monotonic() - started
    return LoadResult(name, len(latencies), errors, seconds, _percentile(latencies, 0.5),
                      _percentile(latencies, 0.99))


async def _count_events(endpoint: str, engine: Engine, stop: asyncio.Event
                        ) -> tuple[int, int, int]:
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    batches = events = blocks = 0
    try:
        while not stop.is_set():
            try:
                frames = await asyncio.wait_for(sock.recv_multipart(), 0.2)
            except TimeoutError:
                continue
            batch = decode_batch(parse_pub(frames).payload, engine)
            events += len(batch.events)
            blocks += sum(len(getattr(event, "block_hashes", ())) for event in batch.events)
            batches += 1
    finally:
        sock.close(linger=0)
        ctx.term()
    return batches, events, blocks


async def _state(url: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as session, session.get(url + "/sim/state") as resp:
        state: dict[str, Any] = await resp.json()
        return state


async def _bench_engine(engine: Engine, args: argparse.Namespace) -> list[LoadResult]:
    results: list[LoadResult] = []
    common = ("--engine", engine.value, "--port", "0", "--kv-events-port", "0", "--zero-cost",
              "--log-level", "warning", "--max-running", "1024")
    with SimProcess(*common, "--kv-capacity-blocks", "65536") as sim:

        def chat(i: int) -> dict[str, Any]:
            return {"model": "cortex-sim", "max_tokens": 8, "messages": [
                {"role": "system", "content": _SYSTEM},
                {"role": "user", "content": f"Where is parcel {i % 500}?"}]}

        def chat_stream(i: int) -> dict[str, Any]:
            return {**chat(i), "stream": True}

        def tokens(i: int) -> dict[str, Any]:
            return {"model": "cortex-sim", "max_tokens": 8,
                    "prompt": [1 + (i % 50)] * 64 + list(range(100, 164))}

        results.append(await _drive(f"{engine.value}: chat", sim.url, chat, False,
                                    args.concurrency, args.duration_s))
        results.append(await _drive(f"{engine.value}: chat, streamed", sim.url, chat_stream,
                                    True, args.concurrency, args.duration_s))
        results.append(await _drive(f"{engine.value}: completions, token ids", sim.url, tokens,
                                    False, args.concurrency, args.duration_s))

    # Events: unique 256-token prompts into a 4096-block pool (block size 16): every request
    # stores 16 new blocks, and once the pool is full it evicts as many.
    with SimProcess(*common, "--kv-capacity-blocks", "4096") as sim:
        rng = random.Random(7)

        def unique(i: int) -> dict[str, Any]:
            return {"model": "cortex-sim", "max_tokens": 1,
                    "prompt": [rng.randrange(1000, 100_000) for _ in range(256)]}

        stop = asyncio.Event()
        counter = asyncio.create_task(_count_events(sim.kv_events_endpoint, engine, stop))
        await asyncio.sleep(0.3)  # let the SUB connect before the load starts (slow joiner)
        before = (await _state(sim.url))["events"]
        load = await _drive(f"{engine.value}: unique prompts (events)", sim.url, unique, False,
                            args.concurrency, args.duration_s)
        after = (await _state(sim.url))["events"]
        await asyncio.sleep(0.5)
        stop.set()
        received_batches, received_events, received_blocks = await counter
        sent = after["sent_events"] - before["sent_events"]
        results.append(LoadResult(load.name, load.requests, load.errors, load.seconds,
                                  load.p50_ms, load.p99_ms, events=sent,
                                  batches=after["next_seq"] - before["next_seq"]))
        results.append(LoadResult(f"{engine.value}: events received by one SUB", 0, 0,
                                  load.seconds, 0.0, 0.0, events=received_events,
                                  batches=received_batches, blocks=received_blocks))
    return results


async def _publisher_ceiling(engine: Engine, seconds: float) -> tuple[float, float]:
    """Batches/s and blocks/s of encode + PUB send alone (one 16-block BlockStored each)."""
    ctx = zmq.asyncio.Context()
    encoder = EventEncoder(engine, "0.5.23" if engine is Engine.SGLANG else "0.33.0")
    event = BlocksStored(tuple(range(1, 17)), 12345, tuple(range(256)), 16)
    try:
        async with EventPublisher(ctx, encoder, FaultState(FaultConfig()), host="127.0.0.1",
                                  pub_port=0, replay_port=None) as publisher:
            count = 0
            start = time.monotonic()
            while time.monotonic() - start < seconds:
                for _ in range(200):
                    publisher.publish([event])
                count += 200
                await asyncio.sleep(0)
            elapsed = time.monotonic() - start
    finally:
        ctx.term()
    return count / elapsed, count * 16 / elapsed


def _report(results: list[LoadResult], ceilings: dict[str, tuple[float, float]],
            args: argparse.Namespace) -> str:
    lines = [
        "# `cortex bench sim` — one simulated worker process, zero-cost mode",
        "",
        f"Machine: {os.cpu_count()} cores, {platform.processor() or platform.machine()}, "
        f"Python {platform.python_version()}. The load generator runs on the same cores.",
        f"Command: `cortex bench sim --duration-s {args.duration_s:g} "
        f"--concurrency {args.concurrency}` ({time.strftime('%Y-%m-%d')}).",
        "Client and sim share two cores (and, on a developer machine, other work): expect "
        "run-to-run differences of tens of percent.",
        "",
        "## Requests",
        "",
        *table(("phase", "requests", "errors", "req/s", "p50 ms", "p99 ms"),
               [(r.name, r.requests, r.errors, f"{r.rps:,.0f}", f"{r.p50_ms:.1f}",
                 f"{r.p99_ms:.1f}") for r in results if r.requests], "lrrrrr"),
    ]
    lines += ["", "## KV events", "",
              "Unique 256-token prompts (16 blocks of 16) into a 4,096-block pool: each request "
              "stores 16 blocks and, once the pool is full, evicts 16 (SGLang: one BlockRemoved "
              "per evicted chain; vLLM: one per block).", "",
              *table(("phase", "batches", "events", "events/s", "block hashes/s"),
                     [(r.name, r.batches, r.events, f"{r.events / r.seconds:,.0f}",
                       f"{r.blocks / r.seconds:,.0f}" if r.blocks else "-")
                      for r in results if r.events], "lrrrr"),
              "", "## Publisher ceiling (in process: encode + ZMQ PUB send, no HTTP)", "",
              *table(("engine", "batches/s", "blocks stored/s"),
                     [(name, f"{batches:,.0f}", f"{blocks:,.0f}")
                      for name, (batches, blocks) in ceilings.items()], "lrr"),
              ""]
    return "\n".join(lines)


async def _main(args: argparse.Namespace) -> tuple[list[LoadResult], dict[str, tuple[float,
                                                                                      float]]]:
    results: list[LoadResult] = []
    ceilings: dict[str, tuple[float, float]] = {}
    for name in args.engines.split(","):
        engine = Engine(name.strip())
        results += await _bench_engine(engine, args)
        ceilings[engine.value] = await _publisher_ceiling(engine, min(args.duration_s, 3.0))
    return results, ceilings


def run(args: argparse.Namespace) -> int:
    results, ceilings = asyncio.run(_main(args))
    report = _report(results, ceilings, args)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(report, encoding="utf-8")
    print(report)
    if args.json:
        print(json.dumps([{**dataclasses.asdict(r), "rps": r.rps} for r in results]))
    return 0
