"""``IngestService``: the in-process ingest runner (``async with IngestService(config) as ing``).

It owns everything one ingest process runs:

- a :class:`~cortex.registry.RegistryWatcher` and the reconciliation of worker sessions with
  the registry (workers of this shard only; a worker that left — lease expired or removed —
  is dropped: its sources get ``REMOVED`` and a ``RemoveSource`` reaches every index);
- per worker and DP rank a :class:`~cortex.ingest.tracker.SourceTracker` and its
  :class:`~cortex.ingest.source.SourceRunner`;
- one :class:`~cortex.ingest.forwarder.IndexForwarder` per index replica;
- the HTTP endpoint for ``/metrics`` and ``/health/*``.

Exit cancels every task and closes every socket, also when cancelled itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType, TracebackType

import aiohttp
import zmq.asyncio
from aiohttp import web

from cortex.edge.http import start_ops_http
from cortex.edge.tasks import stop_tasks
from cortex.hashing import VLLM_HASH_ALGOS, HashDomain
from cortex.ingest.alignment import AUTO
from cortex.ingest.capacity import ask_capacity, block_bound
from cortex.ingest.config import IngestConfig
from cortex.ingest.forwarder import EpochClock, IndexForwarder
from cortex.ingest.held import HeldBytes
from cortex.ingest.metrics import CONTENT_TYPE, IngestMetrics, IngestStats
from cortex.ingest.ops import SnapshotView, SourceId
from cortex.ingest.source import SourceRunner
from cortex.ingest.tracker import SourceTracker, TrackerConfig
from cortex.ledger.grpc import read_token
from cortex.ledger.model import LedgerState, Op, Tier
from cortex.registry import (
    RedisRegistry,
    Registry,
    RegistryHealth,
    RegistryWatcher,
    SpecError,
    WorkerSpec,
)
from cortex.registry.addresses import AddressPolicy
from cortex.registry.credentials import WorkerCredentials

__all__ = ["IngestService", "WorkerSession"]

log = logging.getLogger(__name__)

_ADDRESSES = AddressPolicy.of()  # the default rule: cortex.registry.addresses

_LABEL_HASH_ALGO = "hash_algo"
_LABEL_HASH_SEED = "hash_seed"


@dataclass(frozen=True, slots=True)
class _Wiring:
    """The parts of a worker spec the ingest depends on: a change restarts the session."""

    engine: str
    model: str
    block_size: int | None
    topic: str
    events: tuple[str | None, ...]
    replay: tuple[str | None, ...]
    hash_algo: str | None
    hash_seed: str | None

    @classmethod
    def of(cls, spec: WorkerSpec) -> _Wiring:
        ranks = range(spec.dp_size)
        return cls(
            engine=spec.engine.value,
            model=spec.model,
            block_size=spec.block_size,
            topic=spec.topic,
            events=tuple(spec.kv_events_endpoint(r) for r in ranks),
            replay=tuple(spec.replay_endpoint(r) for r in ranks),
            hash_algo=spec.labels.get(_LABEL_HASH_ALGO),
            hash_seed=spec.labels.get(_LABEL_HASH_SEED),
        )


class WorkerSession:
    """One worker's sources: a tracker and a runner task per DP rank."""

    def __init__(self, spec: WorkerSpec, runners: list[SourceRunner]) -> None:
        self.spec = spec
        self.wiring = _Wiring.of(spec)
        self.runners = runners
        # set when the capacity must be read again: the worker restarted (a source saw its
        # seq go back) or its URL or credential changed
        self.capacity_stale = asyncio.Event()
        for runner in runners:
            runner.tracker.on_restart = self.capacity_stale.set
        self.tasks = [
            asyncio.create_task(runner.run(), name=f"source-{runner.source}")
            for runner in runners
        ]

    def __repr__(self) -> str:
        states = ",".join(r.tracker.state.name for r in self.runners)
        return f"WorkerSession({self.spec.id}, ranks={len(self.runners)}, states={states})"

    async def stop(self) -> None:
        """Cancel the runners and wait until each closed its sockets (also when cancelled)."""
        await stop_tasks(self.tasks)


class IngestService:
    """See the module docstring. ``registry`` overrides ``config.redis_url`` (tests pass a
    ``MemoryRegistry``); a registry passed in is not closed by the service. ``wall_clock_us``
    replaces the wall clock (µs) the epochs start from (tests step it back). ``environ``
    resolves the workers' ``env:`` credentials (the CLI passes its environment)."""

    def __init__(
        self,
        config: IngestConfig,
        *,
        registry: Registry | None = None,
        wall_clock_us: Callable[[], int] | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        if registry is None and config.redis_url is None:
            raise ValueError("IngestService needs config.redis_url or a registry")
        self.config = config
        self.credentials = WorkerCredentials(environ or {})
        self._refused: dict[str, WorkerSpec] = {}  # specs on a refused address, logged once
        self._own_registry = registry is None
        self.registry: Registry = registry or RedisRegistry(
            config.redis_url or "",
            namespace=config.registry_namespace,
            op_timeout_s=config.redis_timeout_s,
        )
        self.watcher = RegistryWatcher(
            self.registry, interval_s=config.poll_interval_s, use_channel=config.use_channel
        )
        token = read_token(config.index_token_file) if config.index_token_file else None
        self.forwarders = [
            IndexForwarder(target, ingest_id=config.ingest_id, ledgers=self,
                           config=config.forwarder, epochs=EpochClock(wall_clock_us),
                           token=token)
            for target in config.index
        ]
        self.metrics = IngestMetrics(self.stats)
        self.held = HeldBytes(config.max_held_bytes)
        self.sessions: dict[str, WorkerSession] = {}
        self._trackers: dict[SourceId, SourceTracker] = {}
        self._runners: dict[SourceId, SourceRunner] = {}
        self._tombstones: dict[SourceId, tuple[HashDomain, str, float]] = {}
        self._ctx: zmq.asyncio.Context | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._http: web.AppRunner | None = None
        self._watcher_open = False
        self.metrics_port: int | None = None
        self.started_unix_s = 0.0

    def __repr__(self) -> str:
        return (
            f"IngestService(id={self.config.ingest_id}, shard={self.config.shard}, "
            f"workers={len(self.sessions)}, sources={len(self._trackers)}, "
            f"registry={self.watcher.health.value}, index={len(self.forwarders)})"
        )

    # ---- views --------------------------------------------------------------------------

    @property
    def trackers(self) -> Mapping[SourceId, SourceTracker]:
        return MappingProxyType(self._trackers)

    @property
    def runners(self) -> Mapping[SourceId, SourceRunner]:
        return MappingProxyType(self._runners)

    def state_of(self, worker_id: str, dp_rank: int = 0) -> LedgerState | None:
        tracker = self._trackers.get(SourceId(worker_id, dp_rank))
        return None if tracker is None else tracker.state

    @property
    def degraded(self) -> bool:
        return self.watcher.degraded

    def stats(self) -> IngestStats:
        """What the metrics collector reads at a scrape."""
        listing = self.watcher.listing
        return IngestStats(self.runners, self.forwarders, self.watcher.degraded,
                           len(listing.workers), len(listing.invalid), len(self.sessions),
                           self.config.max_held_bytes)

    @property
    def synced(self) -> bool:
        """Every index replica is streaming with nothing left to send or acknowledge."""
        return all(f.idle for f in self.forwarders)

    # ---- LedgerSource (what forwarders read) ----------------------------------------------

    def live_sources(self) -> Iterable[SourceId]:
        """Every device source, and the offload tier sources announced to the index."""
        return [s for source, tracker in self._trackers.items()
                for s in (source, *(source.in_tier(t) for t in tracker.tiers))]

    def snapshot(self, source: SourceId) -> SnapshotView | None:
        tracker = self._trackers.get(source.in_tier(Tier.DEVICE))
        return None if tracker is None else tracker.snapshot(source.tier)

    def tombstones(self) -> Iterable[tuple[SourceId, HashDomain, str]]:
        now = time.monotonic()
        for source in [s for s, (_, _, until) in self._tombstones.items() if until <= now]:
            del self._tombstones[source]
        return [(s, domain, reason) for s, (domain, reason, _) in self._tombstones.items()]

    # ---- lifecycle ----------------------------------------------------------------------

    async def __aenter__(self) -> IngestService:
        try:
            await self._start()
        except BaseException:
            await self._stop()
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._stop()

    async def _start(self) -> None:
        self.started_unix_s = time.time()
        self._ctx = zmq.asyncio.Context()
        if self.config.metrics_port is not None:
            await self._start_http(self.config.metrics_port)
        for forwarder in self.forwarders:
            self._tasks.append(
                asyncio.create_task(forwarder.run(), name=f"forward-{forwarder.target}")
            )
        await self.watcher.__aenter__()
        self._watcher_open = True
        self._tasks.append(asyncio.create_task(self._reconcile_loop(), name="reconcile"))
        log.info(
            "ingest %s started: shard %s, %d index replica(s), registry %s",
            self.config.ingest_id, self.config.shard, len(self.forwarders),
            self.watcher.health.value,
        )

    async def _stop(self) -> None:
        """Stop everything; idempotent. Every step runs to its end even when this task is
        cancelled meanwhile (each is shielded, and a cancellation is re-raised only after
        the last one): no task, socket, context, client or port outlives the service."""
        cancelled = False

        async def step(awaitable: Awaitable[object]) -> None:
            nonlocal cancelled
            try:
                await _settle(awaitable)
            except asyncio.CancelledError:
                cancelled = True

        try:
            tasks, self._tasks = self._tasks, []
            await step(stop_tasks(tasks))
            sessions, self.sessions = list(self.sessions.values()), {}
            await step(asyncio.gather(*(s.stop() for s in sessions), return_exceptions=True))
            self._trackers.clear()
            self._runners.clear()
            if self._watcher_open:
                self._watcher_open = False
                await step(self.watcher.__aexit__(None, None, None))
            if self._own_registry:
                await step(self.registry.close())
            http, self._http = self._http, None
            if http is not None:
                await step(http.cleanup())
        finally:
            ctx, self._ctx = self._ctx, None
            if ctx is not None:
                # sockets are closed by now; destroy() closes any left, and never blocks
                ctx.destroy(linger=0)
        if cancelled:
            raise asyncio.CancelledError

    # ---- reconciliation -----------------------------------------------------------------

    async def _reconcile_loop(self) -> None:
        version = -1
        while True:
            version = await self.watcher.wait_changed(version)
            await self.reconcile()

    async def reconcile(self) -> None:
        """Bring the sessions in line with the last known registry (this shard only)."""
        shard = self.config.shard
        wanted = {
            wid: spec
            for wid, spec in self.watcher.workers.items()
            if spec.kv_events is not None and shard.owns(wid) and self._allowed(wid, spec)
        }
        for wid in [w for w in self.sessions if w not in wanted]:
            await self._drop_worker(wid, "left the registry (lease expired or removed)")
        for wid, spec in wanted.items():
            session = self.sessions.get(wid)
            if session is None:
                self._start_worker(spec)
            elif session.wiring != _Wiring.of(spec):
                log.info("worker=%s spec changed; restarting its sources", wid,
                         extra={"worker": wid})
                await self._drop_worker(wid, "spec changed")
                self._start_worker(spec)
            else:
                if (session.spec.url, session.spec.credential) != (spec.url, spec.credential):
                    session.capacity_stale.set()
                session.spec = spec

    def _allowed(self, worker_id: str, spec: WorkerSpec) -> bool:
        """Whether ``spec``'s addresses pass the default worker-address rule (link-local
        and cloud metadata hosts are never subscribed to); a refusal is logged once."""
        try:
            _ADDRESSES.check(spec)
        except SpecError as exc:
            if self._refused.get(worker_id) != spec:
                self._refused[worker_id] = spec
                log.warning("worker=%s ignored: %s", worker_id, exc, extra={"worker": worker_id})
            return False
        return True

    def _start_worker(self, spec: WorkerSpec) -> None:
        assert self._ctx is not None
        cfg = self.config
        runners: list[SourceRunner] = []
        hash_algo = spec.labels.get(_LABEL_HASH_ALGO, cfg.hash_algo)
        if hash_algo != AUTO and hash_algo not in VLLM_HASH_ALGOS:
            log.warning("worker=%s: label hash_algo=%r is not one of %s; using %r", spec.id,
                        hash_algo, list(VLLM_HASH_ALGOS), cfg.hash_algo,
                        extra={"worker": spec.id})
            hash_algo = cfg.hash_algo
        tracker_config = TrackerConfig(
            engine=spec.engine,
            model=spec.model,
            block_size=spec.block_size,
            replay=spec.replay is not None,
            max_pending=cfg.max_pending_batches,
            max_pending_bytes=cfg.max_pending_bytes,
            drain_bytes=cfg.turn_bytes,
            align_every=cfg.align_every,
            hash_algo=hash_algo,
            hash_seed=spec.labels.get(_LABEL_HASH_SEED, cfg.hash_seed),
            kv_lookahead=spec.kv_lookahead,
            columnar_decode=cfg.columnar_decode,
        )
        for rank in range(spec.dp_size):
            source = SourceId(spec.id, rank)
            events = spec.kv_events_endpoint(rank)
            assert events is not None
            tracker = SourceTracker(source, tracker_config, clock=time.time,
                                    held_total=self.held)
            runner = SourceRunner(
                tracker,
                ctx=self._ctx,
                events_endpoint=events,
                replay_endpoint=spec.replay_endpoint(rank),
                topic=spec.topic.encode(),
                on_ops=self._publish,
                replay_timeout_s=cfg.replay_timeout_s,
                sub_hwm=cfg.sub_hwm,
                read_burst=cfg.read_burst,
                turn_bytes=cfg.turn_bytes,
                max_message_bytes=cfg.max_message_bytes,
                observe_lag=self.metrics.observe_lag,
                after_turn=self._enforce_held_limit,
            )
            self._trackers[source] = tracker
            self._runners[source] = runner
            self._tombstones.pop(source, None)
            runners.append(runner)
        session = self.sessions[spec.id] = WorkerSession(spec, runners)
        session.tasks.append(asyncio.create_task(self._bound(session),
                                                 name=f"capacity-{spec.id}"))
        log.info("worker=%s added: %s %s, %d rank(s), events %s, replay %s", spec.id,
                 spec.engine.value, spec.model, spec.dp_size, spec.kv_events,
                 spec.replay or "none", extra={"worker": spec.id})

    async def _bound(self, session: WorkerSession) -> None:
        """Bound ``session``'s sources by the capacity its worker reports: asked until it
        answers (:func:`ask_capacity`), again whenever ``capacity_stale`` is set; a worker
        whose answer does not say stays unbounded. Runs until the session stops."""
        cfg = self.config
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5.0)) as http:
            while True:
                session.capacity_stale.clear()
                spec = session.spec
                capacity = await ask_capacity(
                    http, spec, lambda: self.credentials.headers(session.spec))
                bound = block_bound(capacity, cfg.capacity_margin, cfg.capacity_tier_blocks)
                for runner in session.runners:
                    runner.tracker.bound(bound)
                log.info("worker=%s capacity %s blocks per rank: ledgers bounded at %s",
                         spec.id, capacity if capacity is not None else "not reported",
                         bound or "none", extra={"worker": spec.id})
                await session.capacity_stale.wait()

    async def _drop_worker(self, worker_id: str, reason: str) -> None:
        session = self.sessions[worker_id]
        # shielded: cancelled meanwhile (the service stopping), the sockets are closed anyway
        # and the session stays listed, so _stop() still accounts for it
        await _settle(session.stop())
        del self.sessions[worker_id]
        for runner in session.runners:
            tracker = runner.tracker
            domain = tracker.domain
            announced = tracker.snapshot() is not None
            tiers = tracker.tiers
            tracker.remove(reason)
            ops = tracker.take_ops()
            if ops:
                self._publish(tracker, ops)
            for tier, tier_ops in tracker.take_tier_ops().items():
                self._publish(tracker, tier_ops, tier)
            if announced and domain is not None:
                until = time.monotonic() + self.config.tombstone_ttl_s
                for tier in (Tier.DEVICE, *tiers):
                    self._tombstones[tracker.source.in_tier(tier)] = (domain, reason, until)
            self._trackers.pop(tracker.source, None)
            self._runners.pop(tracker.source, None)
        log.info("worker=%s dropped: %s", worker_id, reason, extra={"worker": worker_id})

    def _enforce_held_limit(self) -> None:
        """While all sources together hold more than ``max_held_bytes``, the largest holder
        gives its held batches up (its ledger resets): a flood costs its own source, not
        the quiet ones."""
        while self.held.over:
            runner = max(self._runners.values(), key=lambda r: r.tracker.held_bytes,
                         default=None)
            if runner is None or not runner.tracker.shed("held_bytes_limit"):
                return
            runner.flush()

    def _publish(self, tracker: SourceTracker, ops: list[Op], tier: Tier = Tier.DEVICE
                 ) -> None:
        domain = tracker.domain
        if domain is None:
            return
        source = tracker.source.in_tier(tier)
        for forwarder in self.forwarders:
            forwarder.publish(source, domain, ops)

    # ---- HTTP: metrics and health ---------------------------------------------------------

    async def _start_http(self, port: int) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._handle_metrics)
        app.router.add_get("/health/live", self._handle_live)
        app.router.add_get("/health/ready", self._handle_ready)
        self._http, self.metrics_port = await start_ops_http(
            app, self.config.metrics_host, port)

    async def _handle_metrics(self, _: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def _handle_live(self, _: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _handle_ready(self, _: web.Request) -> web.Response:
        """Ready once the registry was read; ``degraded`` while Redis or an index replica is
        unreachable (still 200: the ingest keeps serving what it knows)."""
        health = self.watcher.health
        streaming = sum(1 for f in self.forwarders if f.state.value == "streaming")
        body = {
            "status": "starting" if health is RegistryHealth.STARTING else (
                "degraded" if health is RegistryHealth.DEGRADED
                or streaming < len(self.forwarders) else "ok"
            ),
            "registry": health.value,
            "index_replicas": len(self.forwarders),
            "index_streaming": streaming,
            "workers": len(self.sessions),
            "sources": {str(s): t.state.name for s, t in self._trackers.items()},
        }
        return web.json_response(body, status=503 if body["status"] == "starting" else 200)


async def _settle(awaitable: Awaitable[object]) -> None:
    """Await a cleanup step to its end even if the caller is being cancelled."""
    future = asyncio.ensure_future(awaitable)
    try:
        await asyncio.shield(future)
    except asyncio.CancelledError:
        with contextlib.suppress(BaseException):
            await future
        raise
    except Exception as exc:  # cleanup of one part must not stop the others
        log.warning("cleanup step failed: %s", exc)
