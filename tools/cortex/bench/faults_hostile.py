"""Hostile clients and broken workers of issue 32 for ``cortex bench faults``.

Each case acts on the first gateway while the bench's load runs, and probes it with good
requests of its own (a new connection each, as a new client would open) so the case's
notes say what a client that did nothing wrong saw during the fault:

- :class:`ConnectFlood`: 10,000 connections opened and closed without a request.
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

from cortex.bench.faults_catalogue import Bench, Fault
from cortex.bench.faults_load import Prompts, send_chat

__all__ = ["HOSTILE", "ConnectFlood", "GoodClient"]


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


def _gauge(url: str, name: str) -> float | None:
    """The value of an unlabelled metric of the gateway at ``url``."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
            text = resp.read().decode()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


HOSTILE = (ConnectFlood,)
"""The cases of this module, in the order they run."""
