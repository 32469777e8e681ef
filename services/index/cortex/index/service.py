"""The ``cortex.index.v1.Index`` gRPC service on grpclib: :class:`IndexService`.

Handlers only move messages between the wire and :class:`PrefixIndex`; validation errors
become ``INVALID_ARGUMENT`` with a message and no internals. Messages are the protobuf
classes of ``index.proto`` (upb), through :class:`~cortex.ledger.grpc.LedgerCodec`. The
runner that serves it (with health, reflection and metrics) is
:class:`~cortex.index.server.IndexServer`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from grpclib.const import Status
from grpclib.exceptions import GRPCError
from grpclib.server import Stream

from cortex.api.index.v1.index_grpc import IndexBase
from cortex.edge.tasks import stop_tasks
from cortex.hashing import HashDomain
from cortex.index.changes import ChangeSet
from cortex.index.config import IndexConfig
from cortex.index.convert import (
    change_batch,
    match_args,
    match_reply,
    stats_response,
    workers_response,
)
from cortex.index.metrics import IndexMetrics
from cortex.index.prefix_index import ApplyResult, PrefixIndex
from cortex.index.replicas import ReplicaHub, numbered
from cortex.index.sequencing import Verdict
from cortex.ledger import cores
from cortex.ledger.codec import (
    domain_from_bytes,
    domain_from_pb,
    keys_from_le,
    pb,
    source_from_bytes,
    source_from_pb,
    update_from_pb,
)
from cortex.ledger.errors import InvalidArgument
from cortex.ledger.model import INGEST_LOST, Source

if TYPE_CHECKING:
    from cortex.ledger.native import PlannedUpdates

__all__ = ["IndexService"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")
_Planned = tuple["PlannedUpdates", list[Source | None], list[HashDomain | None]]
_DRAINING = "index is shutting down"


class _Drained(Exception):
    """The server began draining while a stream waited."""


async def _messages(stream: Stream[Any, Any]) -> AsyncIterator[Any]:
    while (message := await stream.recv_message()) is not None:
        yield message


class IndexService(IndexBase):
    """``cortex.index.v1.Index`` over a :class:`PrefixIndex` (one per process).

    Each gRPC method is a thin loop around a method that takes and gives messages
    (``match``, ``sync_batches``, ``changes``, ``replicate``), which tests drive directly.
    """

    def __init__(
        self, core: PrefixIndex, config: IndexConfig, metrics: IndexMetrics, index_id: str
    ) -> None:
        self.core = core
        self.config = config
        self.metrics = metrics
        self.index_id = index_id
        self.replicas = ReplicaHub(core, index_id, queue_bytes=config.replica_queue_bytes,
                                   chunk_bytes=config.replica_chunk_bytes)
        self._changed = asyncio.Event()
        self._ingest_seen = asyncio.Event()  # wakes the ingest watcher when it has no deadline
        self._ingest_watch_idle = False
        self._draining = asyncio.Event()
        self._inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._last_reject_log = 0.0
        self._flush: asyncio.TimerHandle | None = None
        self._receivers: set[asyncio.Task[Any]] = set()  # tasks awaiting a stream's message
        self._drain_cancelled: set[asyncio.Task[Any]] = set()
        self._sweeper: asyncio.Task[None] | None = None
        self._losses_flushed = 0  # ``core.changes.appended`` at the last replica flush

    def __repr__(self) -> str:
        return (
            f"IndexService(index_id={self.index_id}, inflight={self._inflight}, "
            f"draining={self._draining.is_set()}, {self.replicas!r}, {self.core!r})"
        )

    # ---- gRPC methods --------------------------------------------------------------------

    async def Match(self, stream: Stream[pb.MatchRequest, pb.MatchResponse]) -> None:
        request = await stream.recv_message()
        assert request is not None
        await stream.send_message(self.match(request))

    async def Workers(self, stream: Stream[pb.WorkersRequest, pb.WorkersResponse]) -> None:
        request = await stream.recv_message()
        assert request is not None
        with self._call():
            reply = workers_response(self.core.workers(request.model), self.core.version)
        await stream.send_message(reply)

    async def Stats(self, stream: Stream[pb.StatsRequest, pb.StatsResponse]) -> None:
        await stream.recv_message()
        with self._call():
            reply = stats_response(self.core.stats(), self.index_id)
        await stream.send_message(reply)

    async def Sync(self, stream: Stream[pb.UpdateBatch, pb.SyncReply]) -> None:
        async for reply in self.sync_batches(_messages(stream)):
            await stream.send_message(reply)

    async def Changes(self, stream: Stream[pb.ChangesRequest, pb.ChangeBatch]) -> None:
        request = await stream.recv_message()
        assert request is not None
        async for batch in self.changes(request):
            await stream.send_message(batch)

    async def Replicate(self, stream: Stream[pb.ReplicaRequest, pb.ReplicaBatch]) -> None:
        async for data in self.replicate(_messages(stream)):
            await stream.send_message(data)  # type: ignore[arg-type]  # LedgerCodec: bytes

    # ---- lifecycle helpers ----------------------------------------------------------------

    @contextlib.contextmanager
    def _call(self) -> Iterator[None]:
        self._inflight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._inflight -= 1
            if not self._inflight:
                self._idle.set()

    def drain(self) -> None:
        """Ask every open stream to end (with UNAVAILABLE, so clients reconnect elsewhere)."""
        self._draining.set()
        for task in self._receivers - self._drain_cancelled:
            self._drain_cancelled.add(task)
            task.cancel()
        if self._sweeper is not None:
            self._sweeper.cancel()

    async def wait_idle(self) -> None:
        """Until no call is in flight."""
        await self._idle.wait()

    def notify(self) -> None:
        """The core changed: change-feed subscribers wake up, and the journal goes to the
        replicas. Stores wait up to ``replica_flush_s`` (changes applied meanwhile join the
        same batch: one message per replica instead of one per Sync batch); a change that
        makes a replica optimistic (blocks lost, a source cleared or no longer READY) goes
        out now, with what the journal holds before it: a request routed meanwhile would
        be credited with blocks the engine no longer has. Ledgers the change retired are
        swept in the background."""
        if self.replicas.subscribers:
            if self.core.changes.appended != self._losses_flushed:
                if self._flush is not None:
                    self._flush.cancel()
                self._flush_replicas()
            elif self._flush is None:
                self._flush = asyncio.get_running_loop().call_later(
                    self.config.replica_flush_s, self._flush_replicas)
        self._changed.set()
        self._changed = asyncio.Event()
        if self.core.view.retiring and (self._sweeper is None or self._sweeper.done()):
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep(),
                                                                   name="ledger-sweep")

    async def _sweep(self) -> None:
        """Take removed and cleared ledgers off the trees, one bounded step per loop turn
        (:meth:`LedgerView.sweep`): Match and Sync are served between the steps."""
        while True:
            if not self.core.view.sweep():
                return
            await asyncio.sleep(0)  # one loop turn between steps

    def _flush_replicas(self) -> None:
        self._flush = None
        self._losses_flushed = self.core.changes.appended
        self.replicas.flush()

    async def _wait(self, event: asyncio.Event, timeout: float | None) -> None:
        """Until ``event`` is set or ``timeout`` (s) passes; :class:`_Drained` on drain."""
        if self._draining.is_set():
            raise _Drained
        waiters = {
            asyncio.ensure_future(event.wait()),
            asyncio.ensure_future(self._draining.wait()),
        }
        try:
            await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters:
                waiter.cancel()
        if self._draining.is_set():
            raise _Drained

    async def _next(self, stream: AsyncIterator[_T]) -> _T | None:
        """The next message of ``stream`` (None at its end); :class:`_Drained` on drain.

        Awaited directly (racing a drain watcher cost two tasks per message: ~19 µs, more
        than applying a small batch); :meth:`drain` cancels the receivers instead."""
        if self._draining.is_set():
            raise _Drained
        task = asyncio.current_task()
        assert task is not None
        self._receivers.add(task)
        try:
            return await anext(stream)
        except StopAsyncIteration:
            return None
        except asyncio.CancelledError:
            if task in self._drain_cancelled:  # our own cancel: the stream ends UNAVAILABLE
                self._drain_cancelled.discard(task)
                task.uncancel()
                raise _Drained from None
            raise
        finally:
            self._receivers.discard(task)

    # ---- queries --------------------------------------------------------------------------

    def match(self, request: pb.MatchRequest) -> pb.MatchResponse:
        """Answer one Match; ``INVALID_ARGUMENT`` (GRPCError) for a malformed query."""
        with self._call():
            started = time.perf_counter()
            try:
                args = match_args(request)
                result = self.core.match(args.model, **args.as_kwargs())
            except InvalidArgument as exc:
                self.metrics.match_requests.labels("invalid").inc()
                raise GRPCError(Status.INVALID_ARGUMENT, str(exc)) from None
            reply = match_reply(result, args)
            self.metrics.match_seconds.observe(time.perf_counter() - started)
            self.metrics.match_requests.labels("ok").inc()
            self.metrics.match_query_blocks.observe(result.query_blocks)
            return reply

    # ---- ledger updates -------------------------------------------------------------------

    def _apply(self, update: pb.LedgerUpdate, ingest_id: str, counts: Counter[tuple[str, str]]
               ) -> tuple[ApplyResult, Source | None]:
        """Apply one update; ``counts[op, verdict]`` counts it (the metric is updated once
        per batch: a labelled counter costs more than a small update's apply)."""
        op = update.WhichOneof("op") or "unset"
        try:
            core_update = update_from_pb(update)
        except InvalidArgument as exc:
            self.metrics.rejected_updates.inc()
            source = domain = None
            with contextlib.suppress(InvalidArgument):
                source = source_from_pb(update.source)
            with contextlib.suppress(InvalidArgument):
                domain = domain_from_pb(update.domain)
            now = time.monotonic()
            if now - self._last_reject_log >= 1.0:  # at most one line a second
                self._last_reject_log = now
                log.warning("rejected ledger update: %s (source=%s op=%s)", exc, source, op)
            if source is None:
                return ApplyResult(Verdict.STALE, error=str(exc)), None
            result = self.core.reject(source, domain, str(exc))
        else:
            source = core_update.source
            result = self.core.apply(core_update, ingest_id)
            if result.error is not None:
                log.warning("ledger update failed: %s (source=%s op=%s)", result.error, source, op)
        counts[op, result.verdict.value] += 1
        return result, source

    def _plan(self, batch: pb.UpdateBatch) -> _Planned | None:
        """The batch's updates planned by the compiled core, with their sources and domains
        decoded (None: the pure-Python core is active, or the batch has no updates)."""
        if not self.config.columnar_sync or not batch.updates:
            return None
        planned = cores.plan_updates(batch.SerializeToString())
        if planned is None:
            return None
        return (planned, [source_from_bytes(raw) for raw in planned.sources],
                [domain_from_bytes(raw) for raw in planned.domains])

    def _apply_planned(self, planned: _Planned, start: int, ingest_id: str,
                       counts: Counter[tuple[str, str]]) -> int:
        """Apply the in-order stores and removals from ``start`` in one call
        (:meth:`PrefixIndex.apply_planned`); returns the first update left."""
        plan, sources, domains = planned
        stop, stores, removes = self.core.apply_planned(plan, start, sources, domains,
                                                        ingest_id)
        if stores:
            counts["store", Verdict.APPLY.value] += stores
        if removes:
            counts["remove", Verdict.APPLY.value] += removes
        return stop

    async def sync_batches(
        self, batches: AsyncIterator[pb.UpdateBatch]
    ) -> AsyncIterator[pb.SyncReply]:
        """A reply per received batch (acks, the version, sources to re-snapshot), except
        for a ``quiet`` batch that asks for no resync and is not the stream's first: a
        later reply's ``applied_batches`` acknowledges it.

        Each update is validated and applied on its own, so a bad update is rejected (its
        source asked to resync) and the rest of the batch applies. Every batch (empty ones
        are an idle ingest's heartbeat) and the stream's end count as hearing from the
        batch's ``ingest_id`` (see :meth:`watch_ingests`).
        """
        metrics = self.metrics
        metrics.sync_streams.inc()
        applied = 0
        ingest_id: str | None = None
        try:
            with self._call():
                while True:
                    try:
                        batch = await self._next(batches)
                    except _Drained:
                        raise GRPCError(Status.UNAVAILABLE, _DRAINING) from None
                    if batch is None:
                        return
                    if batch.ingest_id != ingest_id:
                        if ingest_id is not None:
                            self._heard(ingest_id)
                        ingest_id = batch.ingest_id
                        log.info("sync stream from ingest %r", ingest_id)
                    started = slice_start = time.perf_counter()
                    back = self._heard(ingest_id)
                    resync: dict[Source, None] = {}
                    counts: Counter[tuple[str, str]] = Counter()
                    updates, planned = batch.updates, self._plan(batch)
                    i, n = 0, len(updates)
                    while i < n:
                        stop = i if planned is None else self._apply_planned(
                            planned, i, ingest_id, counts)
                        if stop > i:
                            i = stop
                        else:
                            result, source = self._apply(updates[i], ingest_id, counts)
                            if result.request_resync and source is not None:
                                resync[source] = None
                            i += 1
                        if time.perf_counter() - slice_start > self.config.apply_slice_s:
                            self.notify()
                            await asyncio.sleep(0)  # let queries in between
                            slice_start = time.perf_counter()
                    if back:  # snapshots it owes and did not just send
                        resync.update(dict.fromkeys(self.core.snapshots_owed(back)))
                    applied += 1
                    for (op, verdict), n in counts.items():
                        metrics.updates.labels(op, verdict).inc(n)
                    metrics.update_batches.inc()
                    metrics.apply_seconds.observe(time.perf_counter() - started)
                    if resync:
                        metrics.resync_requests.inc(len(resync))
                    if self._ingest_watch_idle:  # no deadline yet: this batch may set one
                        self._ingest_seen.set()
                    self.notify()
                    if batch.quiet and not resync and applied > 1:
                        metrics.quiet_batches.inc()
                        continue
                    reply = pb.SyncReply(applied_batches=applied, index_version=self.core.version,
                                         index_id=self.index_id)
                    for s in resync:
                        reply.resync.add(worker_id=s.worker_id, dp_rank=s.dp_rank)
                    yield reply
        finally:
            metrics.sync_streams.dec()
            if ingest_id is not None:
                self._heard(ingest_id)  # the grace runs from the stream's end

    # ---- ingest liveness ------------------------------------------------------------------

    def _heard(self, ingest_id: str) -> list[Source]:
        """Note a sign of life of ``ingest_id``; the sources demoted while it was lost."""
        back = self.core.ingest_heard(ingest_id, time.monotonic())
        if back:
            log.info("ingest %r is back (%d source(s) awaiting its snapshots)", ingest_id,
                     len(back))
        return back

    async def watch_ingests(self) -> None:
        """Until cancelled: when an ingest has not been heard for ``ingest_grace_s``, demote
        the sources it owns to SYNCING (``ingest_lost``) and announce them on the change
        feed, so routers stop crediting ledgers nobody updates. Sleeps until the next
        deadline; with none, until a batch is applied (hearing from an ingest only ever moves
        deadlines later, so the earliest one never comes closer meanwhile)."""
        core = self.core
        while True:
            self._ingest_seen.clear()
            lost = core.expire_ingests(time.monotonic())
            for ingest_id, sources in lost:
                log.warning(
                    "ingest %r silent for over %.1fs: %d source(s) SYNCING (%s): %s",
                    ingest_id, self.config.ingest_grace_s, len(sources), INGEST_LOST,
                    ", ".join(map(str, sources[:8])) + (" ..." if len(sources) > 8 else ""),
                )
            if lost:
                self.notify()
            deadline = core.owners.next_deadline()
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            # a deadline is crossed, not met: wake just after it
            await self._wait_ingests(None if timeout is None else timeout + 0.01)

    async def _wait_ingests(self, timeout: float | None) -> None:
        self._ingest_watch_idle = timeout is None
        try:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._ingest_seen.wait()
        finally:
            self._ingest_watch_idle = False

    # ---- change feed ----------------------------------------------------------------------

    async def changes(self, changes_request: pb.ChangesRequest) -> AsyncIterator[pb.ChangeBatch]:
        """Catch up from ``since_version`` (0 = now), then stream; heartbeats when idle."""
        metrics, config, core = self.metrics, self.config, self.core
        model = changes_request.model
        cursor = changes_request.since_version or core.version
        metrics.change_subscribers.inc()
        try:
            with self._call():
                last_sent: float | None = None
                while True:
                    event = self._changed  # grab before reading: no lost wake-up
                    current = core.version
                    sets = core.changes.since(
                        cursor, current, model=model, max_batch_keys=config.changes_batch_keys
                    )
                    now = time.monotonic()
                    if not sets and (
                        last_sent is None or now - last_sent >= config.changes_heartbeat_s
                    ):
                        sets = [ChangeSet(cursor, current)]
                    for change in sets:
                        if change.reset:
                            metrics.change_resets.inc()
                            log.info("change feed reset (cursor=%d current=%d floor=%d)",
                                     cursor, current, core.changes.floor)
                        metrics.change_batches.inc()
                        yield change_batch(change)
                        cursor = change.to_version
                        last_sent = time.monotonic()
                    assert last_sent is not None
                    timeout = max(0.0, config.changes_heartbeat_s - (time.monotonic() - last_sent))
                    try:
                        await self._wait(event, timeout)
                    except _Drained:
                        raise GRPCError(Status.UNAVAILABLE, _DRAINING) from None
        finally:
            metrics.change_subscribers.dec()

    # ---- ledger replicas ------------------------------------------------------------------

    async def replicate(self, requests: AsyncIterator[pb.ReplicaRequest]) -> AsyncIterator[bytes]:
        """A replica stream: the snapshot, then every journal batch, numbered 1, 2, ...
        (encoded bytes: a live batch is encoded once for every subscriber). Heartbeats when
        idle; a subscriber that falls ``replica_queue_bytes`` behind is cut off with
        ``RESOURCE_EXHAUSTED``. Later requests' touched blocks refresh the index's recency.
        """
        try:
            first = await self._next(requests)
        except _Drained:
            raise GRPCError(Status.UNAVAILABLE, _DRAINING) from None
        if first is None:
            return
        models = frozenset(m for m in first.models if m)
        hub, metrics = self.replicas, self.metrics
        with self._call():
            sub, snapshot = hub.subscribe(models, first.replica_id)
            metrics.replica_subscribers.set(len(hub.subscribers))
            log.info("replica %r subscribed (models=%s)", sub.replica_id,
                     ",".join(sorted(models)) or "all")
            touches = asyncio.create_task(self._touches(requests), name="replica-touches")
            try:
                seq = 0
                for batch in snapshot:
                    seq += 1
                    batch.seq = seq
                    data = batch.SerializeToString()
                    metrics.replica_snapshot_bytes.inc(len(data))
                    yield data
                heartbeat = self.config.replica_heartbeat_s
                while True:
                    if self._draining.is_set():
                        raise GRPCError(Status.UNAVAILABLE, _DRAINING)
                    queued = await sub.get(heartbeat)
                    if sub.overflowed:
                        metrics.replica_overflows.inc()
                        log.warning("replica %r fell %d bytes behind: cut off, it will resync",
                                    sub.replica_id, sub.max_bytes)
                        raise GRPCError(Status.RESOURCE_EXHAUSTED, "replica fell behind")
                    seq += 1
                    yield numbered(seq, queued if queued is not None else hub.heartbeat())
            finally:
                await stop_tasks([touches])
                hub.unsubscribe(sub)
                metrics.replica_subscribers.set(len(hub.subscribers))
                log.info("replica %r unsubscribed after %d batches", sub.replica_id, seq)

    async def _touches(self, requests: AsyncIterator[pb.ReplicaRequest]) -> None:
        """Apply a replica's touch reports until its stream ends."""
        async for request in requests:
            for touch in request.touched:
                with contextlib.suppress(InvalidArgument):
                    self.core.touch(domain_from_pb(touch.domain),
                                    keys_from_le(touch.keys_le, "keys_le").tolist())
