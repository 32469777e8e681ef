"""Issue 32's large sources as cases of ``cortex bench faults``: a source holding 1,000,000
blocks cleared (the engine's ``AllBlocksCleared``) and then removed (its worker removed from
the registry) while the index serves Match load; a worker publishing more than its pool.

:class:`LargeSource` is the event side of a worker and nothing else: the sim's SGLang
publisher (with its replay ROUTER) storing ``blocks`` blocks as chains of ``chain`` blocks
that hang off one root block whose engine hash is the real one (ingest's alignment check
passes). It is registered as ``large-0`` at worker-0's HTTP address, so health probes pass
and its lease lives like any worker's.

:class:`SourceRemoval` fills it, starts :class:`MatchLoad` (Match by token ids of its chains
against the index, as another scheduler would, with the query token), clears it, fills it
again and deregisters it. Per phase: Match latency p50 / p99 / max of the calls started in
the phase's window, answers that still credited the source a second after the event, and
what the cluster lost meanwhile (ingest sources marked lost by the index, gateway replica
resyncs) — issue 32's targets: p99 <= 50 ms, 0 and 0. (Its worker is put behind an
:class:`~cortex.bench.answer_proxy.AnswerProxy` whose ``/server_info`` reports room for
the million blocks: ingest bounds a source by its worker's reported capacity.)

:class:`OverCapacity` is the other half of that probe: the same publisher as a worker whose
pool holds 8,192 blocks (the cluster's sims) storing 1,000,000; what the index credited and
what ingest refused and counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import statistics
import time
import urllib.request
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import zmq.asyncio
from grpclib.exceptions import GRPCError, StreamTerminatedError

from cortex.bench.answer_proxy import AnswerProxy
from cortex.bench.faults_catalogue import Bench, Fault, wait_for
from cortex.hashing import Engine, engine_event_ints
from cortex.ledger.client import IndexStub, index_channel, match_request
from cortex.ledger.codec import pb
from cortex.registry import WorkerSpec
from cortex.sim.cache import BlocksStored, CacheCleared
from cortex.sim.config import DEFAULT_VERSIONS, FaultConfig
from cortex.sim.faults import FaultState
from cortex.sim.publisher import EventEncoder, EventPublisher

__all__ = ["LargeSource", "MatchLoad", "OverCapacity", "SourceRemoval"]

WORKER = "large-0"


def _tokens(chain: int, block: int, block_size: int) -> tuple[int, ...]:
    """Distinct tokens of block ``block`` of chain ``chain`` (ids below 32,768)."""
    head = (chain & 0x7FFF, chain >> 15, block & 0x7FFF, block >> 15)
    return head + (7,) * (block_size - len(head))


class LargeSource:
    """An SGLang event publisher (PUB + replay ROUTER on 127.0.0.1) that stores and clears a
    large ledger. Use as ``async with``."""

    def __init__(self, block_size: int, chain: int = 512) -> None:
        self.block_size = block_size
        self.chain = chain
        self._ctx = zmq.asyncio.Context()
        self._publisher = EventPublisher(
            self._ctx, EventEncoder(Engine.SGLANG, DEFAULT_VERSIONS[Engine.SGLANG]),
            FaultState(FaultConfig()), host="127.0.0.1", pub_port=0, replay_port=0,
            buffer_steps=4096, track_subscribers=True)
        self._next_hash = 1 << 40  # engine hashes of the chain blocks (any distinct ints)
        self.root_tokens = _tokens(1 << 20, 0, block_size)
        self._root_hash = engine_event_ints(Engine.SGLANG, self.root_tokens, block_size)[0]

    def __repr__(self) -> str:
        return f"LargeSource(block_size={self.block_size}, chain={self.chain})"

    async def __aenter__(self) -> LargeSource:
        await self._publisher.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._publisher.aclose()
        self._ctx.term()

    @property
    def endpoints(self) -> tuple[str, str]:
        """The kv_events and replay endpoints of its worker spec."""
        return (f"tcp://127.0.0.1:{self._publisher.pub_port}",
                f"tcp://127.0.0.1:{self._publisher.replay_port}")

    async def wait_subscribed(self, timeout_s: float) -> None:
        await self._publisher.wait_subscribed(1, timeout_s)

    def query(self, chain: int, blocks: int) -> list[int]:
        """Token ids of the root block and the first ``blocks`` blocks of chain ``chain``."""
        tokens = list(self.root_tokens)
        for j in range(blocks):
            tokens.extend(_tokens(chain, j, self.block_size))
        return tokens

    async def fill(self, blocks: int, chains_per_batch: int = 8, pause_s: float = 0.02) -> None:
        """Store the root block, then ``blocks`` more as chains under it (a batch of
        ``chains_per_batch`` chains every ``pause_s``: ingest keeps up, nothing is dropped)."""
        bs = self.block_size
        publish = self._publisher.publish
        publish([BlocksStored((self._root_hash,), None, self.root_tokens, bs)])
        chains = -(-blocks // self.chain)
        for first in range(0, chains, chains_per_batch):
            events = []
            for c in range(first, min(first + chains_per_batch, chains)):
                n = min(self.chain, blocks - c * self.chain)
                hashes = tuple(range(self._next_hash, self._next_hash + n))
                self._next_hash += n
                tokens = tuple(t for j in range(n) for t in _tokens(c, j, bs))
                events.append(BlocksStored(hashes, self._root_hash, tokens, bs))
            publish(events)
            await asyncio.sleep(pause_s)

    def clear(self) -> None:
        """The engine's ``AllBlocksCleared``."""
        self._publisher.publish([CacheCleared()])


@dataclass
class MatchLoad:
    """``clients`` closed loops of Match (by token ids, one of ``queries`` each) against the
    index at ``target``, a ``pause_s`` apart; ``samples``: (started, seconds, blocks the
    index credited ``WORKER``) per call, ``errors`` by kind."""

    target: str
    token: str
    model: str
    queries: list[list[int]]
    clients: int = 4
    pause_s: float = 0.01
    samples: list[tuple[float, float, int]] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)
    _stopped: asyncio.Event = field(default_factory=asyncio.Event)

    async def run(self) -> None:
        channel = index_channel(self.target)
        try:
            stub = IndexStub(channel, timeout=5.0, token=self.token)
            await asyncio.gather(*(self._client(stub, i) for i in range(self.clients)))
        finally:
            channel.close()

    async def _client(self, stub: IndexStub, i: int) -> None:
        turn = i
        while not self._stopped.is_set():
            query = self.queries[turn % len(self.queries)]
            turn += self.clients
            started = time.monotonic()
            try:
                reply = await stub.match(match_request(self.model, token_ids=query))
            except (GRPCError, StreamTerminatedError, OSError, TimeoutError) as exc:
                kind = type(exc).__name__
                self.errors[kind] = self.errors.get(kind, 0) + 1
                continue
            credited = max((m.matched_blocks for m in reply.matches if m.worker_id == WORKER),
                           default=0)
            self.samples.append((started, time.monotonic() - started, credited))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopped.wait(), self.pause_s)

    async def stop(self) -> None:
        self._stopped.set()

    def phase(self, start: float, end: float, event: float | None = None) -> dict[str, Any]:
        """Latency of the calls started in ``[start, end)``; with ``event`` (monotonic s),
        when the source's credit was first gone (the index learned the event: a removal
        travels registry -> ingest -> index first) and how many calls started after that
        credited it again (must be 0)."""
        window = [s for s in self.samples if start <= s[0] < end]
        ms = sorted(d * 1000 for _, d, _ in window)
        out: dict[str, Any] = {"calls": len(ms)}
        if ms:
            out.update({"p50 ms": round(statistics.median(ms), 1),
                        "p99 ms": round(ms[min(len(ms) - 1, int(len(ms) * 0.99))], 1),
                        "max ms": round(ms[-1], 1)})
        if event is not None:
            gone = min((s for s, _, c in window if s >= event and not c), default=None)
            out["credit gone after ms"] = None if gone is None else round((gone - event) * 1000)
            out["credited once gone"] = 0 if gone is None else sum(
                1 for s, _, c in window if s > gone and c)
        return out


def _match_process(load: MatchLoad, stop: Any, out: Connection) -> None:
    """A child process's body: ``load`` until ``stop`` (an ``Event``) is set, then its
    samples and errors through ``out`` (the bench's own loop, busy with its load, the canary
    and the large source, would otherwise add its stalls to the index's)."""
    async def main() -> None:
        running = asyncio.create_task(load.run())
        await asyncio.to_thread(stop.wait)
        await load.stop()
        await running

    asyncio.run(main())
    out.send((load.samples, load.errors))


def _metric(url: str | None, name: str, label: str = "") -> float:
    """The sum of a metric's series at ``url`` whose labels hold ``label`` (0 when
    unreadable)."""
    if not url:
        return 0.0
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            text = resp.read().decode()
    except OSError:
        return 0.0
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith((name + " ", name + "{")) and label in line)


async def _held(target: str, token: str, worker: str = WORKER) -> int:
    """Blocks the index says ``worker`` holds."""
    channel = index_channel(target)
    try:
        reply = await IndexStub(channel, timeout=5.0, token=token).workers(
            pb.WorkersRequest())
    finally:
        channel.close()
    return max((w.blocks for w in reply.workers if w.source.worker_id == worker), default=0)


def register_large(b: Bench, source: LargeSource, url: str, worker: str = WORKER) -> None:
    """Register ``worker`` at ``url`` with ``source``'s event endpoints; until ingest
    subscribed."""
    kv_events, replay = source.endpoints
    b.register(WorkerSpec.from_dict({**b.spec_of("worker-0").to_dict(), "id": worker,
                                     "url": url, "kv_events": kv_events, "replay": replay}))
    b.loop.call(source.wait_subscribed(30.0), timeout_s=40)


class SourceRemoval(Fault):
    name, title, hold = ("source_removal", "a source holding 1,000,000 blocks cleared, then "
                         "removed, under Match load", "none")
    blocks = 1_000_000
    after_s = 4.0  # each event's window

    def inject(self, b: Bench) -> None:
        c = b.cluster
        target, state = c.index_target or "", c.state()
        token = c.index_query_token_file.read_text().strip()
        source = LargeSource(c.spec.block_size)
        # a worker that reports room for the million blocks (else ingest bounds its ledger)
        proxy = AnswerProxy(b.spec_of("worker-0").url)
        proxy.server_info = {"max_total_num_tokens": 2 * self.blocks * c.spec.block_size,
                             "page_size": c.spec.block_size}
        b.loop.call(source.__aenter__())
        b.loop.call(proxy.__aenter__())
        try:
            self._run(b, source, proxy.url, target, token, state)
        finally:
            with contextlib.suppress(Exception):
                b.registry(lambda reg: reg.remove(WORKER, reason="bench: source_removal"))
            b.loop.call(proxy.__aexit__(None, None, None))
            b.loop.call(source.__aexit__(None, None, None))

    def _counters(self, b: Bench, state: dict[str, Any]) -> tuple[float, float]:
        lost = _metric(state["index"]["metrics_url"], "cortex_index_ingest_lost_sources")
        resyncs = sum(_metric(url + "/metrics", "cortex_gateway_replica_resyncs_total")
                      for url in b.cluster.gateway_urls)
        return lost, resyncs

    def _fill(self, b: Bench, source: LargeSource, target: str, token: str) -> float | None:
        """Store the blocks; seconds until the index holds them all (None: not in 2 min)."""
        started = time.monotonic()
        b.loop.call(source.fill(self.blocks), timeout_s=300)
        if wait_for(lambda: b.loop.call(_held(target, token)) >= self.blocks, 120.0, 0.5) is None:
            return None
        return round(time.monotonic() - started, 1)

    def _run(self, b: Bench, source: LargeSource, url: str, target: str, token: str,
             state: dict[str, Any]) -> None:
        register_large(b, source, url)
        self.notes["filled to 1 M blocks after s"] = self._fill(b, source, target, token)
        load = MatchLoad(target, token, b.cluster.spec.model,
                         [source.query(q, 128) for q in range(64)])
        spawn = multiprocessing.get_context("spawn")
        stop, (results, out) = spawn.Event(), spawn.Pipe(duplex=False)
        child = spawn.Process(target=_match_process, args=(load, stop, out), daemon=True)
        child.start()
        lost0, resyncs0 = self._counters(b, state)
        try:
            time.sleep(3.0)  # the child started its loop and its calls
            baseline = time.monotonic()
            time.sleep(2.0)
            cleared = time.monotonic()
            source.clear()
            time.sleep(self.after_s)
            self.notes["refilled after s"] = self._fill(b, source, target, token)
            removed = time.monotonic()
            b.registry(lambda reg: reg.remove(WORKER, reason="bench: source_removal"))
            time.sleep(self.after_s)
        finally:
            stop.set()
            if results.poll(60):
                load.samples, load.errors = results.recv()
            child.join(10)
        self.notes["Match before"] = load.phase(baseline, cleared)
        self.notes["Match during the clear"] = load.phase(cleared, cleared + self.after_s,
                                                         cleared)
        self.notes["Match during the removal"] = load.phase(removed, removed + self.after_s,
                                                           removed)
        lost1, resyncs1 = self._counters(b, state)
        self.notes["Match errors"] = load.errors or 0
        self.notes["ingest sources marked lost"] = lost1 - lost0
        self.notes["replica resyncs"] = resyncs1 - resyncs0


class OverCapacity(Fault):
    """Issue 32's probe: a worker whose pool holds 8,192 blocks publishes 1,000,000."""

    name, title, hold = ("over_capacity", "a worker holding 8,192 blocks publishing "
                         "1,000,000", "none")
    worker = "liar-0"
    blocks = 1_000_000

    def inject(self, b: Bench) -> None:
        c = b.cluster
        target, state = c.index_target or "", c.state()
        token = c.index_query_token_file.read_text().strip()
        source = LargeSource(c.spec.block_size)
        b.loop.call(source.__aenter__())
        try:
            register_large(b, source, b.spec_of("worker-0").url, self.worker)
            self.notes["capacity the worker reports (blocks)"] = c.spec.kv_capacity_blocks
            b.loop.call(source.fill(self.blocks), timeout_s=300)
            refused = state["ingest"]["metrics_url"]
            wait_for(lambda: _metric(refused, "cortex_ingest_ignored_blocks_total",
                                     'reason="over_capacity"') > 0.9 * self.blocks, 60.0, 0.5)
            self.notes["published"] = self.blocks + 1
            self.notes["credited by the index"] = b.loop.call(_held(target, token, self.worker))
            self.notes["refused and counted by ingest"] = _metric(
                refused, "cortex_ingest_ignored_blocks_total", 'reason="over_capacity"')
        finally:
            with contextlib.suppress(Exception):
                b.registry(lambda reg: reg.remove(self.worker, reason="bench: over_capacity"))
            b.loop.call(source.__aexit__(None, None, None))
