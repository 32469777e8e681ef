"""Fixtures of the ingest end-to-end tests: a real index, real Redis, real ZMQ publishers.

``fleet`` is a :class:`Fleet`: it starts synthetic engine publishers, registers them in the
registry and can start ingest processes against the index(es). Everything it starts is closed
when the test ends.
"""

from __future__ import annotations

import contextlib
import random
import socket
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import pytest

from cortex.hashing import Engine, HashDomain
from cortex.index.config import IndexConfig
from cortex.index.server import IndexServer
from cortex.ingest.config import IngestConfig
from cortex.ingest.forwarder import ForwarderConfig, IndexTarget
from cortex.ingest.service import IngestService
from cortex.ledger.model import LedgerState as IndexState
from cortex.ledger.model import Source
from cortex.registry import RedisRegistry, Registry, WorkerSpec
from cortex.sim.cache import CacheEvent
from cortex.sim.feed import EngineCache, Hashes, PublisherConfig, SyntheticPublisher
from cortex.testing import RedisServer, free_port, wait_until_async

MODEL = "test-model"


def index_config(port: int = 0, **overrides: object) -> IndexConfig:
    base: dict[str, object] = {"host": "127.0.0.1", "port": port, "metrics_port": None,
                               "resync_retry_s": 0.0, "shutdown_grace_s": 1.0}
    base.update(overrides)
    return IndexConfig(**base)  # type: ignore[arg-type]


def consecutive_ports(count: int) -> int:
    """A base port with ``count`` consecutive free ports (DP ranks publish on port + rank)."""
    for _ in range(100):
        base = free_port()
        try:
            with contextlib.ExitStack() as stack:
                for offset in range(count):
                    sock = stack.enter_context(socket.socket())
                    sock.bind(("127.0.0.1", base + offset))
            return base
        except OSError:
            continue
    raise RuntimeError("no consecutive free ports")


@dataclass
class Rank:
    """One DP rank of a worker: its engine cache model and its publisher."""

    pub: SyntheticPublisher
    cache: EngineCache

    def publish(self, events: Sequence[CacheEvent]) -> int:
        return self.pub.publish(events)


@dataclass
class Worker:
    spec: WorkerSpec
    ranks: list[Rank]

    @property
    def id(self) -> str:
        return self.spec.id


@dataclass
class Fleet:
    registry: Registry
    redis: RedisServer
    index: list[IndexServer]
    stack: contextlib.AsyncExitStack
    workers: dict[str, Worker] = field(default_factory=dict)
    rng: random.Random = field(default_factory=lambda: random.Random(7))

    async def add_worker(
        self,
        worker_id: str,
        engine: Engine = Engine.VLLM,
        *,
        dp_size: int = 1,
        block_size: int = 4,
        registered_block_size: int | None = -1,
        replay: bool = True,
        capacity: int = 400,
        version: str | None = None,
        buffer_steps: int = 10_000,
        ttl_s: float | None = 60.0,
        hashes: Hashes = "fast",
        url: str = "http://127.0.0.1:8000",
        credential: str | None = None,
    ) -> Worker:
        """Start publishers for every rank and register the worker."""
        version = version or ("0.33.0" if engine is Engine.VLLM else "0.5.23")
        pub_base = consecutive_ports(dp_size)
        replay_base = consecutive_ports(dp_size) if replay else None
        ranks: list[Rank] = []
        for rank in range(dp_size):
            pub = await self.stack.enter_async_context(
                SyntheticPublisher(
                    PublisherConfig(
                        engine=engine, version=version, pub_port=pub_base + rank,
                        replay_port=None if replay_base is None else replay_base + rank,
                        buffer_steps=buffer_steps, dp_rank=rank,
                    )
                )
            )
            ranks.append(Rank(pub, EngineCache(engine, block_size, capacity, hashes=hashes)))
        spec = WorkerSpec(
            id=worker_id,
            url=url,
            engine=engine,
            model=MODEL,
            dp_size=dp_size,
            kv_events=f"tcp://127.0.0.1:{pub_base}",
            replay=None if replay_base is None else f"tcp://127.0.0.1:{replay_base}",
            block_size=block_size if registered_block_size == -1 else registered_block_size,
            credential=credential,
        )
        await self.registry.register(spec, ttl_s)
        worker = Worker(spec, ranks)
        self.workers[worker_id] = worker
        return worker

    def ingest_config(self, **overrides: object) -> IngestConfig:
        """The config of an ingest feeding every index of the fleet, quick to react."""
        base: dict[str, object] = {
            "index": tuple(IndexTarget("127.0.0.1", srv.port) for srv in self.index),
            "metrics_port": None,
            "poll_interval_s": 0.1,
            "replay_timeout_s": 0.5,
            "forwarder": ForwarderConfig(backoff_min_s=0.05, backoff_max_s=0.2),
        }
        base.update(overrides)
        return IngestConfig(**base)  # type: ignore[arg-type]

    async def ingest(self, environ: dict[str, str] | None = None,
                     **overrides: object) -> IngestService:
        """An ingest process feeding every index of the fleet (closed with the test)."""
        return await self.stack.enter_async_context(
            IngestService(self.ingest_config(**overrides), registry=self.registry,
                          environ=environ))

    # ---- workload ----

    def prompt(self, pools: int = 6, prefix_blocks: int = 3, block_size: int = 4) -> list[int]:
        """A prompt sharing one of a few prefixes, then a random tail."""
        pool = self.rng.randrange(pools)
        prefix = [1000 + pool * 100 + i for i in range(prefix_blocks * block_size)]
        tail = [self.rng.randrange(50_000) for _ in range(self.rng.randrange(0, 6 * block_size))]
        return prefix + tail

    def traffic(self, worker: Worker, requests: int, *, rank: int | None = None) -> None:
        """Store ``requests`` prompts (LRU evictions included), a batch each."""
        for _ in range(requests):
            r = worker.ranks[rank if rank is not None else self.rng.randrange(len(worker.ranks))]
            r.pub.publish(r.cache.store(self.prompt(block_size=r.cache.block_size)))

    # ---- the index's view ----

    def keys_in(self, srv: IndexServer, worker: Worker, rank: int = 0) -> set[int]:
        cache = worker.ranks[rank].cache
        tree = srv.core.trees.get(HashDomain(MODEL, cache.block_size, cache.engine))
        return set() if tree is None else tree.keys_of(Source(worker.id, rank))

    def converged(self, worker: Worker, ingest: IngestService | None = None) -> bool:
        """Every index holds exactly each rank's cache, READY."""
        if ingest is not None and not ingest.synced:
            return False
        for srv in self.index:
            views = {(v.source.worker_id, v.source.dp_rank): v for v in srv.core.workers()}
            for rank, r in enumerate(worker.ranks):
                view = views.get((worker.id, rank))
                if view is None or view.state is not IndexState.READY:
                    return False
                if self.keys_in(srv, worker, rank) != r.cache.expected_keys(MODEL):
                    return False
        return True

    async def wait_converged(
        self, worker: Worker, ingest: IngestService | None = None, timeout: float = 15.0
    ) -> None:
        await wait_until_async(lambda: self.converged(worker, ingest), timeout=timeout,
                               what=f"index == caches of {worker.id}")

    def index_state(self, srv: IndexServer, worker_id: str, rank: int = 0) -> IndexState | None:
        for view in srv.core.workers():
            if view.source == Source(worker_id, rank):
                return view.state
        return None


@pytest.fixture
async def fleet(redis_server: RedisServer) -> AsyncIterator[Fleet]:
    async with contextlib.AsyncExitStack() as stack:
        registry = await stack.enter_async_context(
            RedisRegistry(redis_server.url, op_timeout_s=0.5)
        )
        srv = await stack.enter_async_context(IndexServer(index_config()))
        yield Fleet(registry=registry, redis=redis_server, index=[srv], stack=stack)
