"""``IndexForwarder``: ordered ledger updates to one index replica over the ``Sync`` stream.

One forwarder per index replica, each with its own connection, queue, epochs and backoff, so
a replica that is down or slow never holds the others back.

- On every (re)connected stream the forwarder first sends a full snapshot of each source
  (a new epoch each), then the live updates. Removed sources that the replica may still hold
  (tombstones) are sent a ``RemoveSource``.
- Updates are batched: whatever accumulated while the previous batch was being written goes
  into the next one (no timer), bounded in count and bytes.
- Memory is bounded: the queue holds at most ``queue_max_updates``; a source whose update does
  not fit is marked dirty and re-sent later as a snapshot taken at send time (its queued
  updates are superseded). A replica that is down queues nothing.
- ``SyncReply.resync`` names sources the replica could not apply in order: each gets a fresh
  snapshot.
- An idle stream sends an empty batch every ``heartbeat_s``: the replica counts an ingest it
  has not heard from for its grace as gone and stops crediting that ingest's sources. Every
  batch is answered, so a stream without any reply for ``reply_timeout_s`` has a dead or
  wedged replica at its other end: it is dropped and reconnected.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from grpclib.client import Channel, Stream
from grpclib.const import Cardinality
from grpclib.exceptions import GRPCError, ProtocolError, StreamTerminatedError

from cortex.hashing import HashDomain
from cortex.ingest.errors import ConfigError, IndexUnavailable
from cortex.ingest.ops import (
    Clear,
    Drop,
    Op,
    Remove,
    Reset,
    SetState,
    SnapshotView,
    SourceId,
    Store,
)
from cortex.ingest.wire import UpdateEncoder, encode_batch_bytes
from cortex.ledger.codec import pb
from cortex.ledger.grpc import LedgerCodec, method

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


@dataclass(frozen=True, slots=True)
class IndexTarget:
    """Where an index replica listens for gRPC."""

    host: str
    port: int

    def __post_init__(self) -> None:
        if not self.host:
            raise ConfigError("index host must be non-empty")
        if not 1 <= self.port <= 65535:
            raise ConfigError(f"index port {self.port} out of range 1..65535")

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    @classmethod
    def parse(cls, text: str) -> IndexTarget:
        """``HOST:PORT`` (``[v6]:PORT`` for IPv6)."""
        host, sep, port = text.strip().rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ConfigError(f"index address {text!r} must be HOST:PORT")
        return cls(host.strip("[]"), int(port))


@dataclass(frozen=True, slots=True)
class ForwarderConfig:
    """Limits of one forwarder. Counts are updates, sizes bytes, times seconds."""

    queue_max_updates: int = 100_000
    batch_max_updates: int = 2_048
    batch_max_bytes: int = 4 << 20
    snapshot_chunk_keys: int = 65_536
    backoff_min_s: float = 0.1
    backoff_max_s: float = 5.0
    connect_timeout_s: float = 5.0
    heartbeat_s: float = 1.0
    """An idle stream sends an empty batch this often (keep it well under the index's
    ``ingest_grace_s``)."""
    reply_timeout_s: float = 15.0
    """A stream that got no reply for this long is dropped and reconnected."""

    def __post_init__(self) -> None:
        if min(self.queue_max_updates, self.batch_max_updates, self.snapshot_chunk_keys) < 1:
            raise ConfigError("queue, batch and snapshot chunk sizes must be >= 1")
        if self.batch_max_bytes < 1024:
            raise ConfigError("batch_max_bytes must be >= 1024")
        if not 0 < self.backoff_min_s <= self.backoff_max_s:
            raise ConfigError("backoff must satisfy 0 < min <= max")
        if self.connect_timeout_s <= 0:
            raise ConfigError("connect_timeout_s must be > 0")
        if not 0 < self.heartbeat_s < self.reply_timeout_s:
            raise ConfigError("heartbeat_s and reply_timeout_s must satisfy 0 < heartbeat < reply")


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


class EpochClock:
    """Epochs that grow across ingest restarts: microseconds of wall clock, strictly
    increasing within the process."""

    def __init__(self) -> None:
        self._last = 0

    def next(self) -> int:
        self._last = max(self._last + 1, time.time_ns() // 1000)
        return self._last


class _Stream:
    """The (epoch, seq) position of one source on the current Sync stream."""

    __slots__ = ("encoder", "epoch", "seq")

    def __init__(self, encoder: UpdateEncoder, epoch: int) -> None:
        self.encoder = encoder
        self.epoch = epoch
        self.seq = 0


_QueueItem = tuple[SourceId, HashDomain, int, Op]


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
    ) -> None:
        self.target = target
        self.ingest_id = ingest_id
        self.ledgers = ledgers
        self.config = config or ForwarderConfig()
        self.epochs = epochs or EpochClock()
        self.state = ForwarderState.CONNECTING
        self.index_id = ""
        self.last_error = ""
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
        self._stream_batches = 0  # batches sent on the current stream
        self._data_batches = 0  # ... of which the last one with updates was number
        self._stream_replies = 0  # replies received on the current stream
        self._queue: deque[_QueueItem] = deque()
        self._outbox: deque[bytes] = deque()  # encoded snapshot updates, sent first
        self._dirty: dict[SourceId, None] = {}  # ordered set: sources owed a snapshot
        self._gen: dict[SourceId, int] = {}  # bumped when a snapshot supersedes queued ops
        self._streams: dict[SourceId, _Stream] = {}
        self._wake = asyncio.Event()

    def __repr__(self) -> str:
        return (
            f"IndexForwarder({self.target}, state={self.state.value}, queue={len(self._queue)},"
            f" dirty={len(self._dirty)}, sent={self.sent_batches}, acked={self.acked_batches})"
        )

    @property
    def queue_depth(self) -> int:
        """Updates waiting to be sent (queued ops plus encoded snapshot parts)."""
        return len(self._queue) + len(self._outbox)

    @property
    def idle(self) -> bool:
        """Streaming, nothing left to send, every batch of updates acknowledged."""
        return (
            self.state is ForwarderState.STREAMING
            and not self._queue
            and not self._outbox
            and not self._dirty
            and self.acked_batches >= self._data_batches
        )

    # ---- input ------------------------------------------------------------------------

    def publish(self, source: SourceId, domain: HashDomain, ops: list[Op]) -> None:
        """Queue a source's ops (synchronous, O(len(ops))). Dropped while disconnected: the
        next stream starts from snapshots."""
        if self.state is not ForwarderState.STREAMING or not ops or source in self._dirty:
            return
        queue = self._queue
        if len(queue) + len(ops) > self.config.queue_max_updates:
            self.overflows += 1
            self._dirty[source] = None
            self._wake.set()
            return
        gen = self._gen.get(source, 0)
        for op in ops:
            queue.append((source, domain, gen, op))
        self._wake.set()

    def resync(self, source: SourceId) -> None:
        """Send ``source`` a fresh snapshot (e.g. its domain became known)."""
        if self.state is ForwarderState.STREAMING:
            self._dirty[source] = None
            self._wake.set()

    # ---- connection loop ----------------------------------------------------------------

    async def run(self) -> None:
        """Connect, stream, and on any failure retry with capped exponential backoff."""
        backoff = self.config.backoff_min_s
        try:
            while True:
                self.state = ForwarderState.CONNECTING
                channel = Channel(self.target.host, self.target.port, codec=LedgerCodec())
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

    async def _stream(self, channel: Channel) -> None:
        async with channel.request(
            SYNC_METHOD, Cardinality.STREAM_STREAM, pb.UpdateBatch, pb.SyncReply
        ) as stream:
            async with asyncio.timeout(self.config.connect_timeout_s):
                await stream.send_request()
            self._connected()
            replies = asyncio.ensure_future(self._recv_loop(stream))
            sender = asyncio.ensure_future(self._send_loop(stream))
            try:
                done, _ = await asyncio.wait(
                    {replies, sender}, return_when=asyncio.FIRST_COMPLETED
                )
            finally:
                for task in (replies, sender):
                    task.cancel()
                await asyncio.gather(replies, sender, return_exceptions=True)
            for task in done:
                task.result()  # re-raise the failure

    def _connected(self) -> None:
        self._reset_stream()
        self.state = ForwarderState.STREAMING
        self.connects += 1
        self._stream_batches = 0
        self._data_batches = 0
        self._stream_replies = 0
        self.acked_batches = 0
        for source in self.ledgers.live_sources():
            self._dirty[source] = None
        for source, domain, reason in self.ledgers.tombstones():
            if source in self._dirty:
                continue
            # A removal applies in any epoch (forgetting only under-estimates).
            encoder = UpdateEncoder(source, domain)
            self._outbox.append(encoder.remove_source(self.epochs.next(), 0, reason))
        log.info("index %s: Sync stream open; sending %d snapshots", self.target,
                 len(self._dirty))
        self._wake.set()

    def _disconnected(self, exc: BaseException) -> None:
        self.failures += 1
        self.last_error = f"{type(exc).__name__}: {exc}"
        if self.state is ForwarderState.STREAMING:
            log.warning("index %s: Sync stream lost (%s); reconnecting", self.target,
                        self.last_error)
        else:
            log.info("index %s unreachable (%s); retrying", self.target, self.last_error)
        self._reset_stream()

    def _reset_stream(self) -> None:
        self._queue.clear()
        self._outbox.clear()
        self._dirty.clear()
        self._streams.clear()
        self._gen.clear()

    # ---- sending ------------------------------------------------------------------------

    async def _send_loop(self, stream: Stream[pb.UpdateBatch, pb.SyncReply]) -> None:
        loop = asyncio.get_running_loop()
        heartbeat = self.config.heartbeat_s
        last_sent = loop.time()
        while True:
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
            data = encode_batch_bytes(self.ingest_id, updates)
            await stream.send_message(data)  # type: ignore[arg-type]  # LedgerCodec: bytes
            last_sent = loop.time()
            self.sent_batches += 1
            self._stream_batches += 1
            if updates:
                self._data_batches = self._stream_batches
            self.sent_updates += len(updates)
            self.sent_bytes += len(data)

    def _collect(self) -> list[bytes]:
        """The next batch: snapshot parts first, then dirty sources, then queued ops."""
        limit, max_bytes = self.config.batch_max_updates, self.config.batch_max_bytes
        out: list[bytes] = []
        size = 0
        outbox, dirty, queue = self._outbox, self._dirty, self._queue
        while len(out) < limit and size < max_bytes:
            if outbox:
                update = outbox.popleft()
            elif dirty:
                source = next(iter(dirty))
                del dirty[source]
                self._take_snapshot(source)
                continue
            elif queue:
                source, domain, gen, op = queue.popleft()
                if gen != self._gen.get(source, 0):
                    continue  # superseded by a snapshot taken since
                encoded = self._encode(source, domain, op)
                if encoded is None:
                    continue
                update = encoded
            else:
                break
            out.append(update)
            size += len(update)
        return out

    def _take_snapshot(self, source: SourceId) -> None:
        """Encode the source's whole ledger now into the outbox; its queued ops are
        superseded (the snapshot already reflects them)."""
        self._gen[source] = self._gen.get(source, 0) + 1
        view = self.ledgers.snapshot(source)
        stream = self._streams.get(source)
        if view is None:
            if stream is not None:  # the replica holds it from this stream: prune it
                stream.seq += 1
                self._outbox.append(
                    stream.encoder.remove_source(stream.epoch, stream.seq, "removed")
                )
                del self._streams[source]
            return
        stream = self._new_epoch(source, view.domain)
        encoder = stream.encoder
        self.snapshots += 1
        chunk = self.config.snapshot_chunk_keys
        parents, keys = view.parent_keys, view.keys
        self._outbox.append(
            encoder.snapshot(stream.epoch, 0, parents[:chunk], keys[:chunk], view.state,
                             view.reason)
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
            self._outbox.append(encoder.store(stream.epoch, stream.seq, parents[start],
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
        if type(op) is Reset:
            stream = self._new_epoch(source, domain)
            return stream.encoder.snapshot(stream.epoch, 0, [], [], op.state, op.reason)
        if stream is None:
            # The replica has not heard of the source on this stream: a snapshot fixes it.
            if type(op) is not Drop:
                self._dirty[source] = None
            return None
        stream.seq += 1
        encoder, epoch, seq = stream.encoder, stream.epoch, stream.seq
        if type(op) is Store:
            return encoder.store(epoch, seq, op.parent_key, op.keys)
        if type(op) is Remove:
            return encoder.remove(epoch, seq, op.keys)
        if type(op) is Clear:
            return encoder.clear(epoch, seq, op.reason)
        if type(op) is SetState:
            return encoder.state(epoch, seq, op.state, op.reason)
        if type(op) is Drop:
            del self._streams[source]
            return encoder.remove_source(epoch, seq, op.reason)
        raise TypeError(f"unknown op {op!r}")

    # ---- replies ------------------------------------------------------------------------

    async def _recv_loop(self, stream: Stream[pb.UpdateBatch, pb.SyncReply]) -> None:
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
                self._dirty[source] = None
            self._wake.set()
