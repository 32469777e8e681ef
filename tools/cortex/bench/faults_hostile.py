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
- :class:`HugeAnswer`: a worker answering a 200 MiB non-streamed 200 (the gateway's RSS is
  sampled meanwhile).
- :class:`BrokenAnswers`: a worker answering each broken shape of
  :class:`~cortex.bench.answer_proxy.Shape` in turn.

- :class:`StoppedReader`: a client asking for a long streamed answer that never reads it
  (the gateway's write timeout must free the connection and end the upstream request).
- :class:`SmallBounds`: one request each against the smaller bounds — a 100 kB header
  (431), a worker registered on the cloud metadata address (400), a 256 MiB gRPC message
  to the index (refused from its length prefix; the index's RSS is sampled).

:class:`HugeAnswer` and :class:`BrokenAnswers` put an
:class:`~cortex.bench.answer_proxy.AnswerProxy` in front of a worker
(re-registered at the proxy's URL) and send requests of their own, distinct prompts, until
the proxy answered one (routing picks the worker); the cluster's load meets it too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import socket
import time
import urllib.request
from collections import Counter
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from grpclib.const import Cardinality
from grpclib.exceptions import GRPCError, StreamTerminatedError

from cortex.bench.answer_proxy import AnswerProxy, Shape
from cortex.bench.faults_catalogue import Bench, Fault, SimFault, wait_for
from cortex.bench.faults_load import MODEL, Prompts, send_chat
from cortex.ledger.client import index_channel
from cortex.ledger.codec import pb
from cortex.ledger.grpc import bearer, method
from cortex.registry import WorkerSpec

__all__ = ["BROKEN_SHAPES", "HOSTILE", "BrokenAnswers", "ConnectFlood", "GoodClient",
           "HugeAnswer", "LongGeneration", "SmallBounds", "StoppedReader", "WedgedWorker",
           "answer_outcome", "metric_sum"]

BROKEN_SHAPES = ((Shape.NOT_JSON, False), (Shape.GARBAGE_SSE, True),
                 (Shape.LATE_GARBAGE_SSE, True), (Shape.JSON_FOR_STREAM, True))
"""Each broken 200 of issue 32, with whether the request that meets it is streamed."""


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
                            deadline_s: float = 60.0, source: str = "127.0.0.2"
                            ) -> dict[str, Any]:
    """Open ``count`` TCP connections to ``host:port`` (``concurrency`` at a time, from
    address ``source``: another peer than the good clients on 127.0.0.1, as an attacker
    would be) and close each at once without sending a byte; stops at ``deadline_s``.
    What it managed."""
    done = Counter[str]()
    started = time.monotonic()
    todo = iter(range(count))

    async def opener() -> None:
        for _ in todo:
            if time.monotonic() - started > deadline_s:
                return
            try:
                _, writer = await asyncio.open_connection(host, port,
                                                          local_addr=(source, 0))
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
        self.notes["gateway connections open after"] = metric_sum(
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
        self.notes["wedges detected"] = metric_sum(b.cluster.gateway_urls[0],
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


class ProxiedWorker(Fault):
    """A fault through an :class:`AnswerProxy` in front of ``worker``."""

    worker = "worker-2"

    def start_proxy(self, b: Bench) -> AnswerProxy:
        spec = b.spec_of(self.worker)
        proxy = self.proxy = AnswerProxy(spec.url)
        b.loop.call(proxy.__aenter__())
        b.register(WorkerSpec.from_dict({**spec.to_dict(), "url": proxy.url}))
        self.notes["routed through the proxy after s"] = wait_for(
            lambda: b.in_pool(self.worker, proxy.url), 15.0, 0.2)
        return proxy

    def until_answered(self, b: Bench, stream: bool, tries: int = 40) -> str:
        """Requests to the first gateway until the proxy answered one; that one's result."""
        url = b.cluster.gateway_urls[0]
        for i in range(tries):
            before = self.proxy.answered
            body = {"model": MODEL, "max_tokens": 4, "stream": stream, "messages": [
                {"role": "user", "content": f"probe {i} {self.name} " * (i % 7 + 1)}]}
            outcome = b.loop.call(answer_outcome(url, body), timeout_s=120)
            if self.proxy.answered > before:
                return outcome
        return f"the proxy answered none of {tries}"

    def repair(self, b: Bench) -> None:
        b.register(b.spec_of(self.worker))
        wait_for(lambda: b.in_pool(self.worker, b.spec_of(self.worker).url), 15.0, 0.2)
        b.loop.call(self.proxy.__aexit__(None, None, None))


class HugeAnswer(ProxiedWorker):
    name, title, hold = "huge_answer", "a worker answering a 200 MiB non-streamed 200", "none"

    def inject(self, b: Bench) -> None:
        proxy = self.start_proxy(b)
        proxy.shape = Shape.HUGE
        before = b.rss("gateway-0") or 0.0
        peak = [before]
        sampling = b.loop.submit(_sample_rss(b, "gateway-0", peak))
        try:
            self.notes["answer"] = self.until_answered(b, stream=False)
        finally:
            sampling.cancel()
        proxy.shape = None
        self.notes["gateway RSS before (MB)"] = before
        self.notes["gateway RSS growth, peak (MB)"] = round(peak[0] - before, 1)


class BrokenAnswers(ProxiedWorker):
    name, title, hold = ("broken_answers", "a worker answering broken 200s (non-JSON, "
                         "garbage SSE, JSON to a stream)", "none")

    def inject(self, b: Bench) -> None:
        proxy = self.start_proxy(b)
        for shape, stream in BROKEN_SHAPES:
            proxy.shape = shape
            self.notes[shape.value] = self.until_answered(b, stream=stream)
        proxy.shape = None
        self.notes["bad_answer failures counted"] = metric_sum(
            b.cluster.gateway_urls[0], "cortex_gateway_upstream_errors_total",
            'kind="bad_answer"')


class StoppedReader(Fault):
    """A client that asks for a long streamed answer and never reads it: the gateway must
    abort the connection after ``server.write_timeout_s`` (60 s; the upstream request is
    cancelled with it), while everyone else is served."""

    name, title, hold = ("stopped_reader", "a client that stops reading a long streamed "
                         "answer", "none")

    def inject(self, b: Bench) -> None:
        url = b.cluster.gateway_urls[0]
        metric = "cortex_gateway_connections_timed_out_total"
        before = metric_sum(url, metric, 'phase="write"') or 0.0
        host, port = url.removeprefix("http://").rsplit(":", 1)
        client = socket.socket()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window
        body = json.dumps({"model": MODEL, "stream": True, "max_tokens": 100_000,
                           "ignore_eos": True,
                           "messages": [{"role": "user", "content": "go on"}]}).encode()
        started = time.monotonic()
        try:
            client.connect((host, int(port)))
            client.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                           b"content-type: application/json\r\ncontent-length: %d\r\n\r\n"
                           % len(body) + body)  # then reads nothing
            aborted = wait_for(lambda: (metric_sum(url, metric, 'phase="write"') or 0.0) > before,
                               240.0, 0.5)
        finally:
            client.close()
        self.notes["connection aborted by the gateway after s"] = (
            None if aborted is None else round(time.monotonic() - started, 1))
        self.notes["write timeouts counted"] = (metric_sum(url, metric, 'phase="write"') or 0.0
                                                ) - before


class SmallBounds(Fault):
    name, title, hold = ("small_bounds", "a 100 kB header, a worker on the metadata address, "
                         "a 256 MiB gRPC message", "none")

    def inject(self, b: Bench) -> None:
        url = b.cluster.gateway_urls[0]
        self.notes["100 kB header"] = b.loop.call(_header_outcome(url), timeout_s=60)
        status, body = b.loop.call(_admin_add(url, b.cluster.admin_token), timeout_s=60)
        self.notes["worker on 169.254.169.254"] = f"HTTP {status}: {body[:80]}"
        before = b.rss("index") or 0.0
        peak = [before]
        sampling = b.loop.submit(_sample_rss(b, "index", peak))
        token = b.cluster.index_token_file.read_text().strip()
        try:
            outcome = b.loop.call(_huge_grpc(b.cluster.index_target or "", token),
                                  timeout_s=120)
        finally:
            sampling.cancel()
        self.notes["256 MiB Match message"] = outcome
        self.notes["index RSS growth, peak (MB)"] = round(peak[0] - before, 1)


async def _header_outcome(url: str) -> str:
    async with aiohttp.ClientSession() as session, session.get(
            url + "/health/live", headers={"x-big": "a" * 100_000},
            timeout=aiohttp.ClientTimeout(total=30)) as resp:
        return f"HTTP {resp.status}"


async def _admin_add(url: str, token: str) -> tuple[int, str]:
    body = {"id": "metadata", "url": "http://169.254.169.254:80", "engine": "sglang",
            "model": MODEL}
    async with aiohttp.ClientSession() as session, session.post(
            url + "/admin/workers", json=body, headers={"authorization": f"Bearer {token}"},
            timeout=aiohttp.ClientTimeout(total=30)) as resp:
        return resp.status, await resp.text()


async def _huge_grpc(target: str, token: str) -> str:
    """A 256 MiB ``Match`` message (with the peer token): what the index answered."""
    async with index_channel(target) as channel:
        try:
            async with channel.request(method("Match"), Cardinality.UNARY_UNARY,
                                       pb.MatchRequest, pb.MatchResponse,
                                       metadata=bearer(token), timeout=60) as stream:
                await stream.send_message(  # raw bytes: LedgerCodec passes them as is
                    b"\x0a" * (256 << 20), end=True)  # type: ignore[arg-type]
                await stream.recv_message()
        except GRPCError as exc:
            return f"{exc.status.name}: {exc.message}"
        except (StreamTerminatedError, OSError, TimeoutError) as exc:
            return type(exc).__name__
    return "answered"


async def answer_outcome(url: str, body: dict[str, Any]) -> str:
    """What the client got: status, error code, and for a 200 whether it carried garbage."""
    try:
        async with aiohttp.ClientSession() as session, session.post(
                url + "/v1/chat/completions", json=body,
                timeout=aiohttp.ClientTimeout(total=60)) as resp:
            raw = await resp.read()
    except (aiohttp.ClientError, TimeoutError) as exc:
        return type(exc).__name__
    if resp.status != 200:
        try:
            code = json.loads(raw)["error"]["code"]
        except (ValueError, KeyError, TypeError):
            code = ""
        return f"HTTP {resp.status} {code}".rstrip()
    garbage = b"not an event stream" in raw or b"<html>" in raw or b'"pad"' in raw
    ended = b"upstream_stream_error" in raw
    return ("HTTP 200 WITH GARBAGE" if garbage else
            "HTTP 200, stream ended by an error event" if ended else "HTTP 200 (a retry)")


async def _sample_rss(b: Bench, name: str, peak: list[float]) -> None:
    while True:
        peak[0] = max(peak[0], b.rss(name) or 0.0)
        await asyncio.sleep(0.05)


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


def metric_sum(url: str, name: str, label: str = "") -> float | None:
    """The sum of a metric's series of the gateway at ``url`` (those whose labels hold
    ``label``)."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
            text = resp.read().decode()
    except OSError:
        return None
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith((name + " ", name + "{")) and label in line]
    return sum(values) if values else None


HOSTILE = (ConnectFlood, BrokenAnswers, HugeAnswer, SmallBounds, WedgedWorker,
           LongGeneration, StoppedReader)
"""The cases of this module, in the order they run."""
