"""Hostile clients and broken workers of issue 32 for ``cortex bench faults``.

Each case acts on the first gateway while the bench's load runs, and probes it with good
requests of its own (a new connection each, as a new client would open) so the case's
notes say what a client that did nothing wrong saw during the fault:

- :class:`ConnectFlood`: 10,000 connections opened and closed without a request.
- :class:`WedgedWorker`: a worker whose generation hangs while its health and load probes
  answer; non-streamed requests (whose first byte is the whole answer) must be answered or
  retried within 15 s under the default config.
- :class:`LongGeneration`: one legitimate non-streamed generation of
  ``Bench.long_generation_s`` (default 60 s; the sim decodes 5 ms a token), which the
  wedge detection must not cut.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
import urllib.request
from collections import Counter
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from cortex.bench.faults_catalogue import Bench, Fault, SimFault
from cortex.bench.faults_load import MODEL, Prompts, send_chat

__all__ = ["HOSTILE", "ConnectFlood", "GoodClient", "LongGeneration", "WedgedWorker"]


@dataclass
class GoodClient:
    """Chat completions to one gateway every ``period_s``, each on a new connection, until
    :meth:`stop`; ``outcomes`` counts them by result (``ok``, ``http 503``, ``timeout``...)."""

    gateway: str
    period_s: float = 0.05
    timeout_s: float = 15.0
    outcomes: Counter[str] = field(default_factory=Counter)
    slowest_s: float = 0.0
    _stopped: asyncio.Event = field(default_factory=asyncio.Event)

    async def run(self) -> None:
        prompts = Prompts(random.Random(7))
        connector = aiohttp.TCPConnector(force_close=True)
        async with aiohttp.ClientSession(connector=connector) as session:
            turn = 0
            while not self._stopped.is_set():
                record, _ = await send_chat(session, [self.gateway], turn, prompts.next(),
                                            stream=False, timeout_s=self.timeout_s)
                turn += 1
                self.outcomes["ok" if record.ok else record.error] += 1
                self.slowest_s = max(self.slowest_s, record.duration_s)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopped.wait(), self.period_s)

    def stop(self) -> None:
        self._stopped.set()

    def summary(self) -> str:
        refused = sum(n for k, n in self.outcomes.items() if k != "ok")
        return (f"{refused} of {sum(self.outcomes.values())} refused or failed "
                f"({dict(self.outcomes)}), slowest {self.slowest_s:.2f} s")


async def connect_and_close(host: str, port: int, count: int, concurrency: int = 64,
                            deadline_s: float = 60.0) -> dict[str, Any]:
    """Open ``count`` TCP connections to ``host:port`` (``concurrency`` at a time) and close
    each at once without sending a byte; stops at ``deadline_s``. What it managed."""
    done = Counter[str]()
    started = time.monotonic()
    todo = iter(range(count))

    async def opener() -> None:
        for _ in todo:
            if time.monotonic() - started > deadline_s:
                return
            try:
                _, writer = await asyncio.open_connection(host, port)
            except OSError as exc:
                done[type(exc).__name__] += 1
                continue
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
            done["opened and closed"] += 1

    await asyncio.gather(*(opener() for _ in range(concurrency)))
    return {**done, "took s": round(time.monotonic() - started, 1)}


class ConnectFlood(Fault):
    name, title, hold = ("connect_flood", "10,000 connections opened and closed without a "
                         "request", "none")
    count = 10_000

    def inject(self, b: Bench) -> None:
        url = b.cluster.gateway_urls[0]
        host, port = url.removeprefix("http://").rsplit(":", 1)
        flood = connect_and_close(host, int(port), self.count)
        self.notes["flood"], self.notes["good requests"] = b.loop.call(
            _probed(url, flood), timeout_s=120)
        self.notes["gateway connections open after"] = _gauge(
            url, "cortex_gateway_connections_open")


async def _probed(gateway: str, fault: Awaitable[dict[str, Any]]) -> tuple[Any, str]:
    """Run ``fault`` while a :class:`GoodClient` probes ``gateway``; both results."""
    client = GoodClient(gateway)
    probing = asyncio.create_task(client.run())
    try:
        result = await fault
    finally:
        client.stop()
        await probing
    return result, client.summary()


class WedgedWorker(SimFault):
    name, title, hold = ("wedged_worker", "a wedged worker (generation hangs, probes answer): "
                         "non-streamed requests", "long")
    worker, patch = "worker-1", {"http_down": True}
    clients = 4

    def inject(self, b: Bench) -> None:
        self.probes = [GoodClient(b.cluster.gateway_urls[0], period_s=0.2, timeout_s=30.0)
                       for _ in range(self.clients)]
        self.running = [b.loop.submit(p.run()) for p in self.probes]
        super().inject(b)

    def repair(self, b: Bench) -> None:
        for probe in self.probes:
            b.loop.call(_stop(probe))
        for running in self.running:
            running.result(timeout=60)
        super().repair(b)
        outcomes: Counter[str] = sum((p.outcomes for p in self.probes), Counter())
        self.notes["non-streamed probes"] = dict(outcomes)
        self.notes["slowest non-streamed probe (s)"] = round(
            max(p.slowest_s for p in self.probes), 2)
        self.notes["wedges detected"] = _gauge(b.cluster.gateway_urls[0],
                                               "cortex_gateway_upstream_wedged_total")


class LongGeneration(Fault):
    name, title, hold = ("long_generation", "a long legitimate non-streamed generation",
                         "none")

    def inject(self, b: Bench) -> None:
        tokens = int(b.long_generation_s * 200)  # the sim's default: 5 ms a token
        body = {"model": MODEL, "max_tokens": tokens, "ignore_eos": True,
                "messages": [{"role": "user", "content": "a long story, please"}]}
        started = time.monotonic()
        status, got = b.loop.call(_long_post(b.cluster.gateway_urls[0], body,
                                             b.long_generation_s * 3 + 60),
                                  timeout_s=b.long_generation_s * 3 + 90)
        self.notes["answer"] = status
        self.notes["completion tokens"] = f"{got} of {tokens}"
        self.notes["took s"] = round(time.monotonic() - started, 1)


async def _stop(client: GoodClient) -> None:
    client.stop()


async def _long_post(url: str, body: dict[str, Any], timeout_s: float) -> tuple[str, int]:
    try:
        async with aiohttp.ClientSession() as session, session.post(
                url + "/v1/chat/completions", json=body,
                timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            answer = await resp.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        return type(exc).__name__, 0
    usage = answer.get("usage") if isinstance(answer, dict) else None
    tokens = usage.get("completion_tokens", 0) if isinstance(usage, dict) else 0
    return f"HTTP {resp.status}", tokens


def _gauge(url: str, name: str) -> float | None:
    """The value of an unlabelled metric of the gateway at ``url``."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
            text = resp.read().decode()
    except OSError:
        return None
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith((name + " ", name + "{"))]
    return sum(values) if values else None


HOSTILE = (ConnectFlood, WedgedWorker, LongGeneration)
"""The cases of this module, in the order they run."""
