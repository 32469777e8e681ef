"""The gateway's live replica of the ledger: one ``Index.Replicate`` stream feeding a
:class:`~cortex.ledger.replica.LedgerReplica`, so routing matches in process.

The loop connects to an index replica (failing over in order), sends the models this gateway
serves, applies the snapshot and then every live batch, and every ``touch_interval_s``
reports the blocks it matched (the index's eviction stays least-recently-*matched*). A
broken, silent (no batch, heartbeats included, for ``grace_s``) or out-of-sync stream is
dropped and reconnected with capped backoff; every new stream starts with a snapshot.

:attr:`ReplicaClient.usable` is the routing rule: the replica answers Match while the last
batch it applied is at most ``grace_s`` old — a live stream (SYNCED), or a lost one within
the grace (STALE, the view kept). Beyond that routing asks the index over gRPC, then
degrades to load only.

What the ledger's :class:`~cortex.ledger.match.Match` (from the replica, or the index over
gRPC) means for routing: per worker its best rank, and two matches of one prompt merged.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Generic, TypeVar

from grpclib.client import Channel
from grpclib.const import Cardinality
from grpclib.exceptions import GRPCError, ProtocolError, StreamTerminatedError

from cortex.edge.tasks import stop_tasks
from cortex.gateway.config.gateway import IndexConfig
from cortex.gateway.metrics import GatewayMetrics
from cortex.hashing import HashDomain
from cortex.ledger.client import stream_channel
from cortex.ledger.codec import pb
from cortex.ledger.frames import CallStream, FramesChannel, FramesRefused
from cortex.ledger.grpc import bearer, method
from cortex.ledger.match import Match, SourceMatch
from cortex.ledger.model import LedgerState, Tier
from cortex.ledger.replica import LedgerReplica, OutOfSync, ReplicaChanges, touch_request

__all__ = ["LeadingRuns", "ReplicaClient", "WorkerMatch", "fold_sources", "merge_matches",
           "walk_depth"]

log = logging.getLogger(__name__)


# ---- matching ----

H = TypeVar("H", bound=Hashable)


class LeadingRuns(Generic[H]):
    """Per holder, the leading blocks it holds of a key chain that only grows (the walk's
    keys), asked for the keys added since the last time only: a holder's run over the
    longer chain is its run so far, plus its run over the new keys if it held every key so
    far. The walk then matches each key once, not the whole chain at every ask."""

    __slots__ = ("asked", "runs")

    def __init__(self) -> None:
        self.asked = 0  # keys of the chain asked for so far
        self.runs: dict[H, int] = {}

    def growing(self) -> bool:
        """Whether some holder (any, before the first ask) held every key so far."""
        return self.asked == 0 or self.asked in self.runs.values()

    def extend(self, new_runs: Mapping[H, int], count: int) -> None:
        """``count`` more keys asked for; ``new_runs``: each holder's leading run of them."""
        asked, runs = self.asked, self.runs
        for holder, run in new_runs.items():
            if runs.get(holder, 0) == asked:
                runs[holder] = asked + run
        self.asked = asked + count

    def ask(self, keys: list[int], runs_of: Callable[[list[int], int], Mapping[H, int]]
            ) -> None:
        """Extend to ``keys`` (the chain so far): ``runs_of(keys, start)`` is asked about
        the keys past those asked before (each holder's leading run of ``keys[start:]``),
        unless no holder can grow."""
        asked = self.asked
        new = len(keys) - asked
        if new > 0:
            self.extend(runs_of(keys, asked) if self.growing() else {}, new)

    @property
    def deepest(self) -> int:
        return max(self.runs.values(), default=0)

    def __repr__(self) -> str:
        return f"LeadingRuns(asked={self.asked}, deepest={self.deepest})"


def walk_depth(ledger: LedgerReplica, domain: HashDomain,
               predicted: Callable[[list[int], int], Mapping[str, int]],
               predictions: LeadingRuns[str] | None = None) -> Callable[[list[int]], int]:
    """The lazy walk's question (``tokens/prompt.py`` ``walk``): of a key chain that only
    grows, the leading blocks the best-placed holder has, a DP rank in ``ledger`` or a worker
    in ``predicted`` (``(keys, start)`` → each worker's leading run of ``keys[start:]``,
    as ``PredictedBlocks.match``). Each key is matched once: per rank, and per worker
    predicted (their runs kept in ``predictions``, when given)."""
    ranks: LeadingRuns[tuple[str, int]] = LeadingRuns()
    workers: LeadingRuns[str] = predictions if predictions is not None else LeadingRuns()

    def held(keys: list[int], start: int) -> dict[tuple[str, int], int]:
        # a rank's host and disk tiers add blocks after its device prefix: their sum bounds
        # its leading run from above (over-estimating only walks further)
        out: dict[tuple[str, int], int] = {}
        for match in ledger.match(domain, keys[start:]).sources:
            rank = (match.worker_id, match.dp_rank)
            out[rank] = out.get(rank, 0) + match.blocks
        return out

    def deepest(keys: list[int]) -> int:
        ranks.ask(keys, held)
        workers.ask(keys, predicted)
        return max(ranks.deepest, workers.deepest)

    return deepest


@dataclass(frozen=True, slots=True)
class WorkerMatch:
    """A worker's best READY rank: its device prefix (``ready_blocks``), the blocks its host
    and disk tiers add after it, the DP rank holding them, and the worker's overall ledger
    state (``READY`` if any rank's device ledger is)."""

    worker_id: str
    ready_blocks: int
    dp_rank: int
    state: LedgerState
    host_blocks: int = 0
    disk_blocks: int = 0

    @property
    def held_blocks(self) -> int:
        """The effective prefix: device, then host and disk."""
        return self.ready_blocks + self.host_blocks + self.disk_blocks


_STATE_RANK = {
    LedgerState.READY: 5,
    LedgerState.STALE: 4,
    LedgerState.SYNCING: 3,
    LedgerState.MISALIGNED: 2,
    LedgerState.REMOVED: 1,
    LedgerState.UNSPECIFIED: 0,
}


class _Rank:
    __slots__ = ("device", "disk", "host", "state")

    def __init__(self) -> None:
        self.device = self.host = self.disk = 0
        self.state = LedgerState.UNSPECIFIED


def fold_sources(sources: Iterable[SourceMatch]) -> dict[str, WorkerMatch]:
    """Per worker its best rank (the longest effective READY prefix). Offload tiers count
    only behind a READY device ledger: they continue its prefix. The shared tier credits
    no worker (a cluster-level cache)."""
    ranks: dict[tuple[str, int], _Rank] = {}
    for src in sources:
        rank = ranks.get((src.worker_id, src.dp_rank))
        if rank is None:
            rank = ranks[src.worker_id, src.dp_rank] = _Rank()
        ready = src.state is LedgerState.READY
        if src.tier is Tier.DEVICE:
            rank.state = src.state
            rank.device = src.blocks if ready else 0
        elif src.tier is Tier.HOST and ready:
            rank.host = src.blocks
        elif src.tier is Tier.DISK and ready:
            rank.disk = src.blocks
    out: dict[str, WorkerMatch] = {}
    for (worker_id, dp_rank), rank in ranks.items():
        if rank.state is LedgerState.READY:
            match = WorkerMatch(worker_id, rank.device, dp_rank, rank.state, rank.host,
                                rank.disk)
        else:
            match = WorkerMatch(worker_id, 0, dp_rank, rank.state)
        seen = out.get(worker_id)
        if seen is None:
            out[worker_id] = match
            continue
        state = seen.state if _STATE_RANK[seen.state] >= _STATE_RANK[match.state] else match.state
        best = match if match.held_blocks > seen.held_blocks else seen
        if best is not seen or state is not seen.state:
            out[worker_id] = WorkerMatch(worker_id, best.ready_blocks, best.dp_rank, state,
                                         best.host_blocks, best.disk_blocks)
    return out


def merge_matches(first: Match | None, other: Match | None) -> Match | None:
    """Two answers for key sets of one prompt (plain and lookahead keys): per source, the
    longer match. Exact, because a source holds keys of one set only: under the other set it
    matches nothing."""
    if first is None or other is None:
        return first or other
    best = {(s.worker_id, s.dp_rank): s for s in first.sources}
    for src in other.sources:
        seen = best.get((src.worker_id, src.dp_rank))
        if seen is None or src.blocks > seen.blocks:
            best[(src.worker_id, src.dp_rank)] = src
    return Match(tuple(best.values()), max(first.version, other.version),
                 max(first.query_blocks, other.query_blocks), first.domain,
                 max(first.shared_blocks, other.shared_blocks))


# ---- replica_client ----


_ERRORS = (GRPCError, StreamTerminatedError, ProtocolError, OSError, TimeoutError, OutOfSync)


class ReplicaClient:
    """Use as ``async with ReplicaClient(config, models, metrics, on_changes) as rc``.

    ``on_changes(changes)`` gets what each applied batch took away (predictions derived
    from those blocks must go). ``token``: the index's peer token. ``clock``: monotonic
    seconds (tests).
    """

    def __init__(
        self,
        config: IndexConfig,
        models: tuple[str, ...],
        metrics: GatewayMetrics,
        on_changes: Callable[[ReplicaChanges], None],
        *,
        replica_id: str = "gateway",
        token: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.models = models
        self.metrics = metrics
        self.replica = LedgerReplica(clock)
        self.replica_id = replica_id
        self._metadata = bearer(token)
        self.frames = config.frames  # off once the index refuses them
        self.connected = False
        self.last_error: str | None = None
        self._on_changes = on_changes
        self._clock = clock
        self._target = 0
        self._task: asyncio.Task[None] | None = None
        self._sweeper: asyncio.Task[None] | None = None

    def __repr__(self) -> str:
        return (f"ReplicaClient(targets={self.config.targets}, connected={self.connected}, "
                f"usable={self.usable}, {self.replica!r})")

    @property
    def usable(self) -> bool:
        """The replica may answer Match: it applied a batch within ``grace_s``."""
        last = self.replica.last_batch_s
        return (self.replica.snapshots > 0 and last is not None
                and self._clock() - last <= self.config.replica_grace_s)

    async def __aenter__(self) -> ReplicaClient:
        if self.config.targets:
            self._task = asyncio.create_task(self._run(), name="gateway-replica")
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        tasks = [t for t in (self._task, self._sweeper) if t is not None]
        self._task = self._sweeper = None
        await stop_tasks(tasks)

    async def _run(self) -> None:
        backoff = 0.05
        targets = self.config.targets
        while True:
            target = targets[self._target % len(targets)]
            channel = stream_channel(target, frames=self.frames)
            synced_before = self.replica.snapshots
            try:
                await self._stream(channel)
            except _ERRORS as exc:
                self._lost(target, exc)
            finally:
                channel.close()
                self.connected = False
                self.replica.lost()
                self._publish_state()
            if self.replica.snapshots > synced_before:
                backoff = 0.05  # this stream worked: retry promptly
            else:
                self._target += 1  # fail over to the next replica
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 2.0)

    def _lost(self, target: str, exc: BaseException) -> None:
        if isinstance(exc, FramesRefused):
            log.warning("index %s does not answer Cortex frames; replicating over gRPC",
                        target)
            self.frames = False
        reason = "out_of_sync" if isinstance(exc, OutOfSync) else type(exc).__name__
        self.last_error = f"{target}: {reason}"
        self.metrics.replica_resyncs.labels(reason=reason).inc()
        if self.connected:
            log.warning("ledger replica stream from %s lost (%r); resyncing", target, exc)
        else:
            log.info("ledger replica: index %s unreachable (%r)", target, exc)

    async def _stream(self, channel: Channel | FramesChannel) -> None:
        grace = self.config.replica_grace_s
        async with channel.request(method("Replicate"), Cardinality.STREAM_STREAM,
                                   pb.ReplicaRequest, pb.ReplicaBatch,
                                   metadata=self._metadata) as stream:
            await stream.send_message(pb.ReplicaRequest(models=list(self.models),
                                                        replica_id=self.replica_id))
            self.replica.begin()
            self.connected = True
            touches = asyncio.create_task(self._touch_loop(stream), name="replica-touch")
            try:
                async for batch in _batches(stream, grace):
                    self._apply(batch)
            finally:
                await stop_tasks([touches])

    def _apply(self, batch: pb.ReplicaBatch) -> None:
        replica, m = self.replica, self.metrics
        was_synced = replica.synced
        changes = replica.apply(batch)
        m.replica_batches.inc()
        if batch.snapshot and batch.synced:
            m.replica_snapshots.inc()
            log.info("ledger replica synced from index %s over %s: %d blocks, %d sources, "
                     "version %d", batch.index_id, "frames" if self.frames else "gRPC",
                     replica.view.blocks, len(replica.view.places), replica.version)
        if batch.applied_unix_s and batch.ops:
            m.replica_lag.observe(max(0.0, time.time() - batch.applied_unix_s))
        if changes.reset or changes.removed or changes.cleared:
            self._on_changes(changes)
        if changes.reset or not was_synced:
            self._publish_state()
        if replica.view.retiring and (self._sweeper is None or self._sweeper.done()):
            self._sweeper = asyncio.create_task(self._sweep(), name="replica-sweep")

    async def _sweep(self) -> None:
        """Take removed and cleared ledgers off the replica's trees, one bounded step per
        loop turn (:meth:`LedgerView.sweep`), so requests are routed between the steps."""
        while True:
            if not self.replica.view.sweep():
                return
            await asyncio.sleep(0)  # one loop turn between steps

    async def _touch_loop(self, stream: CallStream) -> None:
        while True:
            await asyncio.sleep(self.config.replica_touch_interval_s)
            touched = self.replica.take_touched()
            if touched:
                await stream.send_message(touch_request(touched))

    def _publish_state(self) -> None:
        m = self.metrics
        state = self.replica.state.value
        for name in ("empty", "loading", "synced", "stale"):
            m.replica_state.labels(state=name).set(1 if name == state else 0)
        m.replica_blocks.set(self.replica.view.blocks)
        m.replica_bytes.set(self.replica.view.bytes_estimate)


async def _batches(stream: CallStream, timeout: float) -> AsyncIterator[pb.ReplicaBatch]:
    """The stream's batches; TimeoutError when none arrives for ``timeout`` s (the index
    heartbeats far more often: a silent stream is a dead one)."""
    while True:
        async with asyncio.timeout(timeout):
            batch = await stream.recv_message()
        if batch is None:
            raise StreamTerminatedError("the index ended the replica stream")
        yield batch
