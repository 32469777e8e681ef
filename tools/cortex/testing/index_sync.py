"""Small client helpers for the Index service: ledger-update builders and a Sync session.

Used by the index's own tests and benchmarks, and handy for ingest / gateway tests that drive
a real in-process index. Keys travel in the ``*_le`` twins (uint64 little-endian).
"""

from __future__ import annotations

from collections.abc import Sequence
from types import TracebackType

from grpclib.client import Channel
from grpclib.const import Cardinality

from cortex.hashing import HashDomain, pack_keys
from cortex.ledger.codec import domain_to_pb, pb
from cortex.ledger.frames import CallStream, FramesChannel
from cortex.ledger.grpc import bearer, method

__all__ = [
    "SYNC_METHOD",
    "LedgerUpdates",
    "SyncSession",
]

SYNC_METHOD = method("Sync")


class LedgerUpdates:
    """Builds the ordered ``LedgerUpdate`` stream of one source, numbering ``seq`` itself.

    ``snapshot()`` may start a new epoch (``epoch=``); every call returns the next update.
    """

    def __init__(
        self, worker_id: str, domain: HashDomain, *, dp_rank: int = 0, epoch: int = 1,
        seq: int = 0, tier: int = 0,
    ) -> None:
        self.source = pb.Source(worker_id=worker_id, dp_rank=dp_rank,
                                tier=tier)  # type: ignore[arg-type]
        self.domain = pb.Domain()
        domain_to_pb(domain, self.domain)
        self.epoch = epoch
        self.seq = seq

    def __repr__(self) -> str:
        return (f"LedgerUpdates({self.source.worker_id}#{self.source.dp_rank}, "
                f"epoch={self.epoch}, seq={self.seq})")

    def _next(self, **op: object) -> pb.LedgerUpdate:
        self.seq += 1
        return pb.LedgerUpdate(source=self.source, domain=self.domain, epoch=self.epoch,
                               seq=self.seq, **op)  # type: ignore[arg-type]

    def store(self, parent_key: int, keys: Sequence[int]) -> pb.LedgerUpdate:
        return self.store_packed(parent_key, pack_keys(keys))

    def store_packed(self, parent_key: int, keys_le: bytes) -> pb.LedgerUpdate:
        """A store of keys already packed (uint64 little-endian)."""
        return self._next(store=pb.StoreBlocks(parent_key=parent_key, keys_le=keys_le))

    def remove(self, keys: Sequence[int]) -> pb.LedgerUpdate:
        return self._next(remove=pb.RemoveBlocks(keys_le=pack_keys(keys)))

    def clear(self, reason: str = "all_blocks_cleared") -> pb.LedgerUpdate:
        return self._next(clear=pb.ClearBlocks(reason=reason))

    def set_state(self, state: int, reason: str = "") -> pb.LedgerUpdate:
        """``state``: a ``LedgerState`` value."""
        return self._next(state=pb.SetState(state=state, reason=reason))  # type: ignore[arg-type]

    def snapshot(
        self,
        parent_keys: Sequence[int],
        keys: Sequence[int],
        *,
        state: int = 2,
        epoch: int | None = None,
    ) -> pb.LedgerUpdate:
        """``state``: a ``LedgerState`` value (default READY)."""
        if epoch is not None and epoch != self.epoch:
            self.epoch, self.seq = epoch, 0
        snapshot = pb.Snapshot(
            parent_keys_le=pack_keys(parent_keys),
            keys_le=pack_keys(keys),
            state=state,  # type: ignore[arg-type]
        )
        return self._next(snapshot=snapshot)

    def chain_snapshot(
        self, chains: Sequence[tuple[int, Sequence[int]]], *, epoch: int | None = None,
        state: int = 2,
    ) -> pb.LedgerUpdate:
        """A snapshot of ``(parent_key, chain keys)`` chains."""
        parents: list[int] = []
        keys: list[int] = []
        for parent, chain in chains:
            parents.extend([parent, *chain[:-1]])
            keys.extend(chain)
        return self.snapshot(parents, keys, epoch=epoch, state=state)

    def remove_source(self, reason: str = "lease_lost") -> pb.LedgerUpdate:
        return self._next(remove_source=pb.RemoveSource(reason=reason))


class SyncSession:
    """One open ``Sync`` stream: ``await session.send(updates)`` returns the reply
    (``token``: the index's peer token, when it requires one).

    ``async with SyncSession(channel, ingest_id="ingest-0") as session: ...``; leaving the
    block ends the stream (half-close, then the server's trailers).
    """

    def __init__(self, channel: Channel | FramesChannel, ingest_id: str = "test-ingest",
                 token: str | None = None) -> None:
        self.channel = channel
        self.ingest_id = ingest_id
        self._cm = channel.request(SYNC_METHOD, Cardinality.STREAM_STREAM, pb.UpdateBatch,
                                   pb.SyncReply, metadata=bearer(token))
        self._stream: CallStream | None = None

    def __repr__(self) -> str:
        return f"SyncSession(ingest_id={self.ingest_id!r}, open={self._stream is not None})"

    async def __aenter__(self) -> SyncSession:
        self._stream = await self._cm.__aenter__()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        stream, self._stream = self._stream, None
        try:
            if stream is not None and exc is None:
                await stream.end()
                while await stream.recv_message() is not None:
                    pass
        finally:
            await self._cm.__aexit__(exc_type, exc, tb)

    async def send(self, updates: Sequence[pb.LedgerUpdate]) -> pb.SyncReply:
        """Send one batch and wait for its reply."""
        await self.post(updates)
        return await self.reply()

    async def post(self, updates: Sequence[pb.LedgerUpdate], quiet: bool = False) -> None:
        """Send one batch without waiting for its reply (:meth:`reply` takes replies in
        order: an ingest keeps a few batches in flight; a ``quiet`` batch asks for none)."""
        if self._stream is None:
            raise RuntimeError("SyncSession is not open")
        await self._stream.send_message(
            pb.UpdateBatch(ingest_id=self.ingest_id, updates=list(updates), quiet=quiet)
        )

    async def reply(self) -> pb.SyncReply:
        """The reply to the oldest batch sent and not yet answered."""
        if self._stream is None:
            raise RuntimeError("SyncSession is not open")
        reply: pb.SyncReply | None = await self._stream.recv_message()
        if reply is None:
            raise ConnectionError("Sync stream ended without a reply")
        return reply
