"""``IndexForwarder``: ordered ledger updates to one index replica over the ``Sync`` stream.

One forwarder per index replica, each with its own connection, queue, epochs and backoff, so
a replica that is down or slow never holds the others back.

- On every (re)connected stream the forwarder first sends a full snapshot of each source
  (a new epoch each), then the live updates. Removed sources that the replica may still hold
  (tombstones) are sent a ``RemoveSource``.
- Updates are batched: whatever accumulated while the previous batch was being written goes
  into the next one (no timer), bounded in count and bytes. Each source has its own queue
  and batches take from them in turns (:class:`~cortex.ingest.queues.SourceQueues`), so a
  flooding source cannot delay the others' updates behind its backlog or its snapshots.
- Memory is bounded: live updates queue at most ``source_queue_max_bytes`` per source and
  ``queue_max_bytes`` / ``queue_max_updates`` in all; a source whose update does not fit
  (or the largest queue, when the total is over) is marked dirty and re-sent later as a
  snapshot taken at send time (its queued updates are superseded). A replica that is down
  queues nothing.
- ``SyncReply.resync`` names sources the replica could not apply in order: each gets a fresh
  snapshot.
- An idle stream sends an empty batch every ``heartbeat_s``: the replica counts an ingest it
  has not heard from for its grace as gone and stops crediting that ingest's sources.
- Every batch is answered, heartbeats too, so a stream without any reply for
  ``reply_timeout_s`` has a dead or wedged replica at its other end: it is dropped and
  reconnected. With ``quiet_replies`` a batch asks for a reply only when it fills the
  in-flight window (the sender would wait for it anyway) or is a heartbeat; the others are
  ``quiet`` (answered only with a resync request; the next reply acknowledges them too):
  still a reply every second batch at least and one per heartbeat while idle, but the ack
  of a burst's last batch can lag up to ``heartbeat_s`` (:attr:`IndexForwarder.idle` waits
  for it); an older replica answers every batch.
- Epochs must grow even when the wall clock stepped back across an ingest restart (the
  replica rejects a lower epoch as stale): before each stream the forwarder reads the
  replica's ``Workers`` and starts its epochs above every epoch the replica holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Iterable
from enum import StrEnum
from typing import Protocol

from grpclib.client import Channel
from grpclib.const import Cardinality, Status
from grpclib.exceptions import GRPCError, ProtocolError, StreamTerminatedError

from cortex.edge.tasks import stop_tasks
from cortex.hashing import HashDomain
from cortex.ingest.epochs import EpochClock
from cortex.ingest.errors import IndexUnavailable
from cortex.ingest.forwarder_config import ForwarderConfig, IndexTarget
from cortex.ingest.ops import SnapshotView, SourceId
from cortex.ingest.queues import SourceQueues
from cortex.ingest.wire import UpdateEncoder, encode_batch_bytes
from cortex.ledger.client import stream_channel
from cortex.ledger.codec import pb
from cortex.ledger.frames import CallStream, FramesChannel, FramesRefused
from cortex.ledger.grpc import bearer, method
from cortex.ledger.model import (
    ClearBlocks,
    Op,
    RemoveBlocks,
    RemoveSource,
    SetState,
    Snapshot,
    StoreBlocks,
)

__all__ = [
    "EpochClock",
    "ForwarderConfig",
    "ForwarderState",
    "IndexForwarder",
    "IndexTarget",
    "LedgerSource",
]

log = logging.getLogger(__name__)

SYNC_METHOD = method("Sync")
WORKERS_METHOD = method("Workers")


class ForwarderState(StrEnum):
    CONNECTING = "connecting"
    STREAMING = "streaming"
    BACKOFF = "backoff"
    STOPPED = "stopped"


class LedgerSource(Protocol):
    """What a forwarder reads from the ingest when it needs whole ledgers."""

    def live_sources(self) -> Iterable[SourceId]:
        """Sources the index should hold now."""
        ...

    def snapshot(self, source: SourceId) -> SnapshotView | None:
        """The source's ledger now; ``None`` if the index must not (or no longer) hold it."""
        ...

    def tombstones(self) -> Iterable[tuple[SourceId, HashDomain, str]]:
        """Recently removed sources a reconnected replica may still hold: (source, domain,
        reason)."""
        ...



class _Stream:
    """The (epoch, seq) position of one source on the current Sync stream."""

    __slots__ = ("encoder", "epoch", "seq")

    def __init__(self, encoder: UpdateEncoder, epoch: int) -> None:
        self.encoder = encoder
        self.epoch = epoch
        self.seq = 0


_Item = tuple[HashDomain, Op] | bytes | None
"""A queued op, an encoded update (snapshot part, removal), or ``None``: the source is owed
a snapshot, taken when its turn comes."""

_OP_BYTES = 48  # an update's fixed part: source, domain, epoch, seq, op framing


def _op_bytes(op: Op) -> int:
    keys = getattr(op, "keys", None)
    return _OP_BYTES + (8 * len(keys) if keys is not None else 0)


class IndexForwarder:
    """Run with ``task = asyncio.create_task(forwarder.run())``; feed with :meth:`publish`."""

    def __init__(
        self,
        target: IndexTarget,
        *,
        ingest_id: str,
        ledgers: LedgerSource,
        config: ForwarderConfig | None = None,
        epochs: EpochClock | None = None,
        token: str | None = None,
    ) -> None:
        self.target = target
        self.ingest_id = ingest_id
        self.ledgers = ledgers
        self.config = config or ForwarderConfig()
        self.epochs = epochs or EpochClock()
        self._metadata = bearer(token)  # the index's peer token, on Workers and Sync
        self.state = ForwarderState.CONNECTING
        self.index_id = ""
        self.last_error = ""
        self.frames = self.config.frames  # off once the index refuses them
        # counters (read by metrics)
        self.connects = 0
        self.failures = 0
        self.sent_batches = 0
        self.sent_updates = 0
        self.sent_bytes = 0
        self.acked_batches = 0
        self.snapshots = 0
        self.overflows = 0
        self.resync_requests = 0
        self.heartbeats = 0
        self.epoch_floor_failures = 0
        self._stream_batches = 0  # batches sent on the current stream
        self._data_batches = 0  # ... of which the last one with updates was number
        self._stream_replies = 0  # replies received on the current stream
        self._queues: SourceQueues[_Item] = SourceQueues(self.config.source_turn_bytes)
        self._dirty: set[SourceId] = set()  # sources owed a snapshot
        self._streams: dict[SourceId, _Stream] = {}
        self._wake = asyncio.Event()

    def __repr__(self) -> str:
        return (
            f"IndexForwarder({self.target}, state={self.state.value}, {self._queues!r},"
            f" dirty={len(self._dirty)}, sent={self.sent_batches}, acked={self.acked_batches})"
        )

    @property
    def queue_depth(self) -> int:
        """Updates waiting to be sent (queued ops plus encoded snapshot parts)."""
        return len(self._queues)

    @property
    def queue_bytes(self) -> int:
        """Bytes of the updates waiting to be sent (ops estimated by their keys)."""
        return self._queues.bytes

    @property
    def queue_wait_s(self) -> float:
        """How long the longest-waiting update has been queued (0 when none is)."""
        oldest = self._queues.oldest()
        return 0.0 if oldest is None else max(0.0, time.monotonic() - oldest)

    @property
    def idle(self) -> bool:
        """Streaming, nothing left to send, every batch of updates acknowledged."""
        return (
            self.state is ForwarderState.STREAMING
            and not self._queues
            and not self._dirty
            and self.acked_batches >= self._data_batches
        )

    # ---- input ------------------------------------------------------------------------

    def publish(self, source: SourceId, domain: HashDomain, ops: list[Op]) -> None:
        """Queue a source's ops (synchronous, O(len(ops))). Dropped while disconnected: the
        next stream starts from snapshots."""
        if self.state is not ForwarderState.STREAMING or not ops or source in self._dirty:
            return
        queues, config = self._queues, self.config
        sizes = [_op_bytes(op) for op in ops]
        if queues.bounded_bytes_of(source) + sum(sizes) > config.source_queue_max_bytes:
            self._overflow(source)
            return
        queues.extend(source, [(domain, op) for op in ops], sizes, time.monotonic())
        while (queues.bounded_bytes > config.queue_max_bytes
               or queues.bounded_items > config.queue_max_updates):
            victim = queues.largest()
            if victim is None:
                break
            self._overflow(victim)
        self._wake.set()

    def resync(self, source: SourceId) -> None:
        """Send ``source`` a fresh snapshot (e.g. its domain became known)."""
        if self.state is ForwarderState.STREAMING:
            self._owe_snapshot(source)

    def _overflow(self, source: SourceId) -> None:
        self.overflows += 1
        self._owe_snapshot(source)

    def _owe_snapshot(self, source: SourceId) -> None:
        """Supersede the source's queued updates by a snapshot taken at its next turn."""
        if source in self._dirty:
            return
        self._queues.drop(source)
        self._dirty.add(source)
        self._queues.push(source, None, 0, time.monotonic(), bounded=False)
        self._wake.set()

    # ---- connection loop ----------------------------------------------------------------

    async def run(self) -> None:
        """Connect, stream, and on any failure retry with capped exponential backoff."""
        backoff = self.config.backoff_min_s
        try:
            while True:
                self.state = ForwarderState.CONNECTING
                channel = stream_channel(str(self.target), frames=self.frames)
                try:
                    await self._stream(channel)
                except (
                    GRPCError, StreamTerminatedError, ProtocolError, OSError, TimeoutError,
                    IndexUnavailable,
                ) as exc:
                    self._disconnected(exc)
                finally:
                    channel.close()
                if self._stream_replies:  # it worked for a while: retry promptly
                    backoff = self.config.backoff_min_s
                self.state = ForwarderState.BACKOFF
                await asyncio.sleep(backoff * random.uniform(0.5, 1.0))
                backoff = min(backoff * 2, self.config.backoff_max_s)
        finally:
            self.state = ForwarderState.STOPPED
            self._reset_stream()

    async def _stream(self, channel: Channel | FramesChannel) -> None:
        await self._learn_epoch_floor(channel)
        async with channel.request(
            SYNC_METHOD, Cardinality.STREAM_STREAM, pb.UpdateBatch, pb.SyncReply,
            metadata=self._metadata,
        ) as stream:
            async with asyncio.timeout(self.config.connect_timeout_s):
                await stream.send_request()
            self._connected()
            replies = asyncio.ensure_future(self._recv_loop(stream))
            sender = asyncio.ensure_future(self._send_loop(stream))
            for task in (replies, sender):
                # One ending with the stream's failure is re-raised below, unless the forwarder
                # is being stopped meanwhile (then nobody asks: not an unretrieved error).
                task.add_done_callback(_retrieved)
            try:
                done, _ = await asyncio.wait(
                    {replies, sender}, return_when=asyncio.FIRST_COMPLETED
                )
            finally:
                await stop_tasks([replies, sender])
            for task in done:
                task.result()  # re-raise the failure

    async def _learn_epoch_floor(self, channel: Channel | FramesChannel) -> None:
        """Start this stream's epochs above every epoch the replica holds (tombstones too,
        other ingests' sources too: only growth matters). An index without ``Workers``
        leaves the wall clock alone; any other failure fails the connect (retried)."""
        try:
            async with asyncio.timeout(self.config.connect_timeout_s):
                async with channel.request(
                    WORKERS_METHOD, Cardinality.UNARY_UNARY, pb.WorkersRequest,
                    pb.WorkersResponse, metadata=self._metadata,
                ) as call:
                    await call.send_message(pb.WorkersRequest(), end=True)
                    reply = await call.recv_message()
        except GRPCError as exc:
            if exc.status is not Status.UNIMPLEMENTED:
                raise
            self.epoch_floor_failures += 1
            log.warning("index %s has no Workers method: epochs follow the wall clock",
                        self.target)
            return
        held = max((w.epoch for w in reply.workers), default=0) if reply is not None else 0
        if held >= self.epochs.last:
            log.info("index %s holds epochs up to %d: new epochs start above it",
                     self.target, held)
        self.epochs.raise_floor(held)

    def _connected(self) -> None:
        self._reset_stream()
        self.state = ForwarderState.STREAMING
        self.connects += 1
        self._stream_batches = 0
        self._data_batches = 0
        self._stream_replies = 0
        self.acked_batches = 0
        for source in self.ledgers.live_sources():
            self._owe_snapshot(source)
        for source, domain, reason in self.ledgers.tombstones():
            if source in self._dirty:
                continue
            # A removal applies in any epoch (forgetting only under-estimates).
            encoder = UpdateEncoder(source, domain)
            self._send_later(source, encoder.remove_source(self.epochs.next(), 0, reason))
        log.info("index %s: Sync stream open (%s); sending %d snapshots", self.target,
                 "frames" if self.frames else "gRPC", len(self._dirty))
        self._wake.set()

    def _disconnected(self, exc: BaseException) -> None:
        if isinstance(exc, FramesRefused):
            log.warning("index %s does not answer Cortex frames; streaming over gRPC",
                        self.target)
            self.frames = False
        self.failures += 1
        self.last_error = f"{type(exc).__name__}: {exc}"
        if self.state is ForwarderState.STREAMING:
            log.warning("index %s: Sync stream lost (%s); reconnecting", self.target,
                        self.last_error)
        else:
            log.info("index %s unreachable (%s); retrying", self.target, self.last_error)
        self._reset_stream()

    def _reset_stream(self) -> None:
        self._queues.clear()
        self._dirty.clear()
        self._streams.clear()

    # ---- sending ------------------------------------------------------------------------

    async def _send_loop(self, stream: CallStream) -> None:
        loop = asyncio.get_running_loop()
        heartbeat = self.config.heartbeat_s
        last_sent = loop.time()
        inflight = self.config.max_inflight_batches
        while True:
            while self._stream_batches - self.acked_batches >= inflight:
                self._wake.clear()  # every reply sets it
                await self._wake.wait()
            updates = self._collect()
            if not updates:
                self._wake.clear()
                idle_for = loop.time() - last_sent
                if idle_for < heartbeat:
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(heartbeat - idle_for):
                            await self._wake.wait()
                    continue
                self.heartbeats += 1  # nothing to send for a while: an empty batch
            # ask for a reply only where one is needed: the window is full after this batch
            # (the sender waits for an ack), or a heartbeat (the replica's liveness)
            quiet = (self.config.quiet_replies and bool(updates)
                     and self._stream_batches + 1 - self.acked_batches < inflight)
            data = encode_batch_bytes(self.ingest_id, updates, quiet)
            await stream.send_message(data)  # LedgerCodec passes bytes through
            last_sent = loop.time()
            self.sent_batches += 1
            self._stream_batches += 1
            if updates:
                self._data_batches = self._stream_batches
            self.sent_updates += len(updates)
            self.sent_bytes += len(data)

    def _collect(self) -> list[bytes]:
        """The next batch: the sources' queued updates in turns (a source owed a snapshot
        takes it when its turn comes)."""
        limit, max_bytes = self.config.batch_max_updates, self.config.batch_max_bytes
        out: list[bytes] = []
        size = 0
        queues = self._queues
        while len(out) < limit and size < max_bytes:
            head = queues.pop()
            if head is None:
                break
            source, item = head
            if item is None:
                self._dirty.discard(source)
                self._take_snapshot(source)
                continue
            if isinstance(item, bytes):
                update = item
            else:
                domain, op = item
                encoded = self._encode(source, domain, op)
                if encoded is None:
                    continue
                update = encoded
            out.append(update)
            size += len(update)
        return out

    def _send_later(self, source: SourceId, update: bytes) -> None:
        """Queue an encoded update (a recovery: not subject to the queue limits)."""
        self._queues.push(source, update, len(update), time.monotonic(), bounded=False)

    def _take_snapshot(self, source: SourceId) -> None:
        """Encode the source's whole ledger now into its queue (nothing else is queued for
        it: the ops it had were superseded when it was owed the snapshot)."""
        view = self.ledgers.snapshot(source)
        stream = self._streams.get(source)
        if view is None:
            if stream is not None:  # the replica holds it from this stream: prune it
                stream.seq += 1
                self._send_later(
                    source, stream.encoder.remove_source(stream.epoch, stream.seq, "removed")
                )
                del self._streams[source]
            return
        stream = self._new_epoch(source, view.domain)
        encoder = stream.encoder
        self.snapshots += 1
        chunk = self.config.snapshot_chunk_keys
        parents, keys = view.parent_keys, view.keys
        self._send_later(
            source, encoder.snapshot(stream.epoch, 0, parents[:chunk], keys[:chunk],
                                     view.state, view.reason)
        )
        # The rest as chains of consecutive blocks (parents-first order keeps them valid).
        start = chunk
        total = len(keys)
        while start < total:
            end = start + 1
            stop = min(total, start + chunk)
            while end < stop and parents[end] == keys[end - 1]:
                end += 1
            stream.seq += 1
            self._send_later(source, encoder.store(stream.epoch, stream.seq, parents[start],
                                                   keys[start:end]))
            start = end

    def _new_epoch(self, source: SourceId, domain: HashDomain) -> _Stream:
        """Start a new epoch for ``source`` on this stream (its encoder is kept)."""
        stream = self._streams.get(source)
        encoder = (
            stream.encoder
            if stream is not None and stream.encoder.domain == domain
            else UpdateEncoder(source, domain)
        )
        stream = self._streams[source] = _Stream(encoder, self.epochs.next())
        return stream

    def _encode(self, source: SourceId, domain: HashDomain, op: Op) -> bytes | None:
        stream = self._streams.get(source)
        if type(op) is Snapshot:
            stream = self._new_epoch(source, domain)
            return stream.encoder.snapshot(stream.epoch, 0, [], [], op.state, op.reason)
        if stream is None:
            # The replica has not heard of the source on this stream: a snapshot fixes it.
            if type(op) is not RemoveSource:
                self._owe_snapshot(source)
            return None
        stream.seq += 1
        encoder, epoch, seq = stream.encoder, stream.epoch, stream.seq
        if type(op) is StoreBlocks:
            return encoder.store(epoch, seq, op.parent_key, op.keys)
        if type(op) is RemoveBlocks:
            return encoder.remove(epoch, seq, op.keys)
        if type(op) is ClearBlocks:
            return encoder.clear(epoch, seq, op.reason)
        if type(op) is SetState:
            return encoder.state(epoch, seq, op.state, op.reason)
        if type(op) is RemoveSource:
            del self._streams[source]
            return encoder.remove_source(epoch, seq, op.reason)
        raise TypeError(f"unknown op {op!r}")

    # ---- replies ------------------------------------------------------------------------

    async def _recv_loop(self, stream: CallStream) -> None:
        timeout = self.config.reply_timeout_s
        while True:
            try:
                async with asyncio.timeout(timeout):  # batches (heartbeats too) get replies
                    reply = await stream.recv_message()
            except TimeoutError:
                raise IndexUnavailable(f"no Sync reply for {timeout:.0f}s") from None
            if reply is None:
                raise IndexUnavailable("the index ended the Sync stream")
            self._stream_replies += 1
            # the sender waits for this ack only with a full window; otherwise waking it
            # would only re-arm its heartbeat wait (new updates and resyncs wake it)
            blocked = (self._stream_batches - self.acked_batches
                       >= self.config.max_inflight_batches)
            self.acked_batches = reply.applied_batches
            if reply.index_id and reply.index_id != self.index_id:
                if self.index_id:
                    log.info("index %s: new index_id %s (was %s)", self.target,
                             reply.index_id, self.index_id)
                self.index_id = reply.index_id
            for item in reply.resync:
                source = SourceId(item.worker_id, item.dp_rank)
                self.resync_requests += 1
                log.info("index %s asked to resync source=%s", self.target, source,
                         extra={"worker": source.worker_id, "source": str(source)})
                self._owe_snapshot(source)
            if blocked:
                self._wake.set()


def _retrieved(task: asyncio.Future[None]) -> None:
    """Mark ``task``'s exception as retrieved (asyncio logs one nobody retrieved)."""
    if not task.cancelled():
        task.exception()

