"""Steady bounded load against the gateways of a local cluster, recorded request by request
(``cortex bench faults`` and ``cortex bench soak``).

- :class:`LoadGenerator`: ``clients`` closed-loop clients at ``rate`` requests/s in all,
  chat completions over a pool of shared system prompts (most requests repeat an earlier
  prompt: exact-KV hits; the rest add a new question: a partial hit), half of them streamed,
  ``max_tokens`` small. Gateways are taken in turns; a gateway that refuses the connection is
  skipped for the next one, as a load balancer would (``proxy_next_upstream error``), and
  counted as a failover, not a failure. Every request has a deadline (``timeout_s``).
- :class:`Canary`: one request every ``interval_s`` from a few prompts warmed before the
  faults; it tells when exact-KV hits are served (``x-cortex-match-mode: exact_kv`` with
  cached tokens).
- :class:`LoopThread`: an event loop in a thread of its own, so the fault schedule can run
  (and block on the cluster's calls) in the thread that owns the cluster's processes.

A request is *ok* when it answered 200 and (streamed) reached ``[DONE]`` without an error
event; everything else is a failure with its reason (``http 503``, ``timeout``, ``cut``,
``stream error <code>``, ``ClientConnectorError``...).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import random
import threading
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp

__all__ = ["Canary", "LoadGenerator", "LoopThread", "Prompts", "Record"]

T = TypeVar("T")

MODEL = "cortex-sim"
_WORDS = ("cache", "prefix", "token", "worker", "router", "engine", "block", "ledger",
          "index", "gateway", "replica", "stream", "decode", "prefill", "batch", "event",
          "lease", "shard", "epoch", "budget", "queue", "latency", "memory", "fleet")


@dataclass(slots=True)
class Record:
    """One request as the client saw it; times in s (monotonic), ``duration_s`` until the
    answer ended (or failed)."""

    started: float
    duration_s: float = 0.0
    ok: bool = False
    error: str = ""
    stream: bool = False
    mode: str = ""
    hit_tokens: int = 0
    gateway: str = ""
    worker: str = ""

    @property
    def exact(self) -> bool:
        return self.ok and self.mode == "exact_kv" and self.hit_tokens > 0


class Prompts:
    """System prompts shared by many requests, and the conversations already sent."""

    def __init__(self, rng: random.Random, systems: int = 24, words: int = 90) -> None:
        self.rng = rng
        self.systems = [self._text(words, i) for i in range(systems)]
        self.sent: list[list[dict[str, str]]] = []

    def _text(self, words: int, salt: int) -> str:
        picked = " ".join(self.rng.choice(_WORDS) for _ in range(words))
        return f"You are assistant {salt}. Context: {picked}."

    def next(self, repeat: float = 0.6, keep: int = 400) -> list[dict[str, str]]:
        """Messages of the next request: an earlier one again (``repeat`` of the time), or a
        new question under one of the shared system prompts."""
        if self.sent and self.rng.random() < repeat:
            return self.rng.choice(self.sent)
        messages = [{"role": "system", "content": self.rng.choice(self.systems)},
                    {"role": "user", "content": self._text(12, self.rng.randrange(10**9))}]
        self.sent.append(messages)
        if len(self.sent) > keep:  # the oldest fall out of the repeats (and of the caches)
            del self.sent[0]
        return messages


async def send_chat(
    session: aiohttp.ClientSession,
    gateways: Sequence[str],
    turn: int,
    messages: list[dict[str, str]],
    *,
    stream: bool,
    timeout_s: float,
    max_tokens: int = 8,
) -> tuple[Record, int]:
    """One chat completion; returns its record and how many gateways refused first."""
    record = Record(started=time.monotonic(), stream=stream)
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "stream": stream}
    failovers = 0
    try:
        async with asyncio.timeout(timeout_s):
            for attempt in range(len(gateways)):
                url = gateways[(turn + attempt) % len(gateways)]
                try:
                    await _exchange(session, url, body, record)
                    break
                except aiohttp.ClientConnectorError:
                    if attempt == len(gateways) - 1:
                        raise
                    failovers += 1  # nothing was sent: the next gateway gets it
    except TimeoutError:
        record.error = "timeout"
    except (aiohttp.ClientError, ValueError) as exc:
        record.error = type(exc).__name__
    record.duration_s = time.monotonic() - record.started
    return record, failovers


async def _exchange(session: aiohttp.ClientSession, url: str, body: dict[str, Any],
                    record: Record) -> None:
    record.gateway = url
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        record.mode = resp.headers.get("x-cortex-match-mode", "")
        record.worker = resp.headers.get("x-cortex-assigned-worker", "")
        record.hit_tokens = int(resp.headers.get("x-cortex-cache-hit-tokens", "0") or 0)
        if resp.status != 200:
            await resp.read()
            record.error = f"http {resp.status}"
            return
        if not body["stream"]:
            answer = await resp.json()
            record.ok = bool(answer.get("choices"))
            record.error = "" if record.ok else "no choices"
            return
        async for line in resp.content:
            if line.startswith(b'data: {"error"'):
                error = json.loads(line[6:]).get("error") or {}
                record.error = f"stream error {error.get('code') or error.get('type')}"
            elif line.strip() == b"data: [DONE]":
                record.ok = not record.error
                return
        record.error = record.error or "cut"  # the stream ended without [DONE]


def _client_session() -> aiohttp.ClientSession:
    """A session opening a connection per request, as independent clients would."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True))


@dataclass
class LoadGenerator:
    """Closed-loop clients sending chat completions at ``rate`` requests/s in all."""

    gateways: list[str]
    clients: int = 4
    rate: float = 10.0
    timeout_s: float = 30.0
    seed: int = 1
    records: list[Record] = field(default_factory=list)
    failovers: int = 0
    inflight: dict[int, float] = field(default_factory=dict)  # client -> start of its request
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self._session = _client_session()
        prompts = Prompts(random.Random(self.seed))
        self._tasks = [asyncio.create_task(self._client(i, prompts), name=f"client-{i}")
                       for i in range(self.clients)]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    async def _client(self, index: int, prompts: Prompts) -> None:
        assert self._session is not None
        rng = random.Random(self.seed * 1000 + index)
        period = self.clients / self.rate
        turn = index
        next_at = time.monotonic() + rng.uniform(0, period)
        while True:
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            next_at += period
            turn += 1
            self.inflight[index] = time.monotonic()
            record, failovers = await send_chat(
                self._session, self.gateways, turn, prompts.next(), stream=rng.random() < 0.5,
                timeout_s=self.timeout_s)
            del self.inflight[index]
            self.records.append(record)
            self.failovers += failovers
            next_at = max(next_at, time.monotonic())  # closed loop: never a backlog burst


@dataclass
class Canary:
    """One non-streamed request every ``interval_s`` from a few fixed prompts."""

    gateways: list[str]
    interval_s: float = 0.25
    timeout_s: float = 10.0
    prompts: int = 3
    records: list[Record] = field(default_factory=list)
    _task: asyncio.Task[None] | None = None
    _session: aiohttp.ClientSession | None = None
    _messages: list[list[dict[str, str]]] = field(default_factory=list)

    async def start(self, warm_until_exact_s: float = 30.0) -> bool:
        """Warm the prompts (each sent until it is an exact hit), then probe; returns
        whether every prompt became an exact hit in time."""
        self._session = _client_session()
        rng = random.Random(4242)
        pool = Prompts(rng, systems=self.prompts, words=120)
        self._messages = [[{"role": "system", "content": system},
                           {"role": "user", "content": "Which worker holds this prompt?"}]
                          for system in pool.systems]
        deadline = time.monotonic() + warm_until_exact_s
        warmed = 0
        for messages in self._messages:
            while time.monotonic() < deadline:
                record, _ = await send_chat(self._session, self.gateways, 0, messages,
                                            stream=False, timeout_s=self.timeout_s)
                if record.exact:
                    warmed += 1
                    break
                await asyncio.sleep(0.1)
        self._task = asyncio.create_task(self._probe(), name="canary")
        return warmed == len(self._messages)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    async def _probe(self) -> None:
        assert self._session is not None
        turn = 0
        while True:
            started = time.monotonic()
            messages = self._messages[turn % len(self._messages)]
            record, _ = await send_chat(self._session, self.gateways, turn, messages,
                                        stream=False, timeout_s=self.timeout_s)
            self.records.append(record)
            turn += 1
            await asyncio.sleep(max(0.0, started + self.interval_s - time.monotonic()))


class LoopThread:
    """``with LoopThread() as loop: loop.call(coro)``: an event loop in a daemon thread."""

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="bench-loop",
                                        daemon=True)

    def __enter__(self) -> LoopThread:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        with contextlib.suppress(RuntimeError):
            self._loop.close()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Start ``coro`` on the loop; its future."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def call(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for its result."""
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"{coro!r} did not finish in {timeout_s} s") from None
