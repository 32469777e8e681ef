"""IndexForwarder against a recording grpclib server on 127.0.0.1 (real HTTP/2, real gRPC)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
from collections.abc import AsyncIterator, Iterable
from pathlib import Path

import pytest
from grpclib.const import Cardinality, Handler, Status
from grpclib.exceptions import GRPCError, StreamTerminatedError
from grpclib.server import Server, Stream

from cortex.hashing import Engine, HashDomain, unpack_keys
from cortex.index.config import IndexConfig
from cortex.index.server import IndexServer
from cortex.ingest.forwarder import (
    EpochClock,
    ForwarderConfig,
    ForwarderState,
    IndexForwarder,
    IndexTarget,
)
from cortex.ingest.ops import SnapshotView, SourceId
from cortex.ledger.codec import pb
from cortex.ledger.grpc import method
from cortex.ledger.grpc_server import GrpcServer
from cortex.ledger.model import (
    ClearBlocks,
    LedgerState,
    RemoveBlocks,
    RemoveSource,
    SetState,
    Snapshot,
    StoreBlocks,
)
from cortex.testing import free_port, wait_until_async

DOMAIN = HashDomain("m", 4, Engine.VLLM)
A = SourceId("a", 0)
B = SourceId("b", 1)


class Recorder:
    """Records every LedgerUpdate and each batch's ``quiet``; replies as the index does (to
    every batch that is not quiet, to a stream's first, and with a resync), optionally
    asking for resyncs."""

    def __init__(self, *, mute: bool = False, held_epochs: Iterable[int] | None = ()) -> None:
        self.updates: list[pb.LedgerUpdate] = []
        self.batch_of: list[int] = []  # per update: the number of the batch it came in
        self.batches = 0
        self.empty_batches = 0
        self.quiet: list[bool] = []  # per batch
        self.resync_next: list[SourceId] = []
        self.streams = 0
        self.mute = mute  # read batches, never reply (a wedged index)
        self.transports: list[str] = []
        # None: Workers is UNIMPLEMENTED; else the epochs it reports as held
        self.held_epochs = None if held_epochs is None else list(held_epochs)

    def __mapping__(self) -> dict[str, Handler]:
        return {
            method("Sync"): Handler(self.sync, Cardinality.STREAM_STREAM, pb.UpdateBatch,
                                    pb.SyncReply),
            method("Workers"): Handler(self.workers, Cardinality.UNARY_UNARY,
                                       pb.WorkersRequest, pb.WorkersResponse),
        }

    async def workers(self, stream: Stream[pb.WorkersRequest, pb.WorkersResponse]) -> None:
        """The epochs the "index" holds (the forwarder asks before every stream)."""
        await stream.recv_message()
        if self.held_epochs is None:
            raise GRPCError(Status.UNIMPLEMENTED, "no Workers here")
        await stream.send_message(pb.WorkersResponse(workers=[
            pb.WorkerInfo(source=pb.Source(worker_id=f"old-{i}"), epoch=epoch)
            for i, epoch in enumerate(self.held_epochs)
        ]))

    async def sync(self, stream: Stream[pb.UpdateBatch, pb.SyncReply]) -> None:
        self.streams += 1
        self.transports.append(type(stream).__name__)  # ServedCall: frames; Stream: gRPC
        applied = 0
        async for batch in stream:
            self.updates.extend(batch.updates)
            self.batch_of.extend([self.batches] * len(batch.updates))
            self.batches += 1
            self.empty_batches += not batch.updates
            self.quiet.append(batch.quiet)
            applied += 1
            if self.mute or (batch.quiet and applied > 1 and not self.resync_next):
                continue
            resync, self.resync_next = self.resync_next, []
            await stream.send_message(pb.SyncReply(
                applied_batches=applied, index_id="rec",
                resync=[pb.Source(worker_id=s.worker_id, dp_rank=s.dp_rank) for s in resync],
            ))

    def of(self, source: SourceId) -> list[tuple[int, int, str, object]]:
        """(epoch, seq, op name, op) of one source, in arrival order."""
        out = []
        for u in self.updates:
            if (u.source.worker_id, u.source.dp_rank, u.source.tier) == source:
                name = u.WhichOneof("op")
                out.append((u.epoch, u.seq, name, getattr(u, name)))
        return out


class Ledgers:
    """The forwarder's view of the ingest: snapshots by source, plus tombstones."""

    def __init__(self) -> None:
        self.views: dict[SourceId, SnapshotView] = {}
        self.dead: list[tuple[SourceId, HashDomain, str]] = []

    def live_sources(self) -> Iterable[SourceId]:
        return list(self.views)

    def snapshot(self, source: SourceId) -> SnapshotView | None:
        return self.views.get(source)

    def tombstones(self) -> Iterable[tuple[SourceId, HashDomain, str]]:
        return list(self.dead)


def view(keys: list[int], parents: list[int] | None = None) -> SnapshotView:
    parents = parents if parents is not None else [0, *keys[:-1]]
    return SnapshotView(DOMAIN, parents, keys, LedgerState.READY, "in sync")


@contextlib.asynccontextmanager
async def serving(recorder: Recorder, port: int) -> AsyncIterator[GrpcServer]:
    server = GrpcServer([recorder])  # closes the connections it accepted on shutdown
    await server.start("127.0.0.1", port)
    try:
        yield server
    finally:
        await server.shutdown()


@contextlib.asynccontextmanager
async def serving_grpc_only(recorder: Recorder, port: int) -> AsyncIterator[Server]:
    server = Server([recorder])  # grpclib's own: HTTP/2 and nothing else
    await server.start("127.0.0.1", port)
    try:
        yield server
    finally:
        server.close()
        await server.wait_closed()


@contextlib.asynccontextmanager
async def forwarding(
    port: int, ledgers: Ledgers, *, epochs: EpochClock | None = None, **config: int | float
) -> AsyncIterator[IndexForwarder]:
    forwarder = IndexForwarder(
        IndexTarget("127.0.0.1", port), ingest_id="t", ledgers=ledgers, epochs=epochs,
        config=ForwarderConfig(backoff_min_s=0.02, backoff_max_s=0.1, **config),  # type: ignore[arg-type]
    )
    task = asyncio.create_task(forwarder.run())
    try:
        yield forwarder
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


@pytest.mark.parametrize("frames", [True, False])
async def test_snapshot_first_then_ordered_updates_and_epochs(frames: bool) -> None:
    recorder, ledgers, port = Recorder(), Ledgers(), free_port()
    ledgers.views[A] = view([10, 11])
    async with serving(recorder, port), forwarding(port, ledgers, frames=frames) as fwd:
        await wait_until_async(lambda: fwd.idle, timeout=10)
        fwd.publish(A, DOMAIN, [StoreBlocks(11, [12]), RemoveBlocks([10]),
                                SetState(LedgerState.STALE, "gap"),
                                ClearBlocks("all_blocks_cleared")])
        fwd.publish(B, DOMAIN, [Snapshot([], [], LedgerState.SYNCING, "connecting"),
                                StoreBlocks(0, [7])])
        fwd.publish(A, DOMAIN, [Snapshot([], [], LedgerState.READY, "seq_reset"),
                                RemoveSource("gone")])
        await wait_until_async(lambda: fwd.idle, timeout=10)
    a = recorder.of(A)
    assert [name for _, _, name, _ in a] == [
        "snapshot", "store", "remove", "state", "clear", "snapshot", "remove_source"]
    first_epoch = a[0][0]
    assert [seq for epoch, seq, _, _ in a[:5]] == [0, 1, 2, 3, 4]
    assert all(epoch == first_epoch for epoch, _, _, _ in a[:5])
    assert a[5][0] > first_epoch and a[5][1] == 0 and a[6][:2] == (a[5][0], 1)
    snap = a[0][3]
    assert unpack_keys(snap.keys_le) == [10, 11]  # type: ignore[attr-defined]
    assert unpack_keys(a[1][3].keys_le) == [12]  # type: ignore[attr-defined]
    b = recorder.of(B)
    assert [name for _, _, name, _ in b] == ["snapshot", "store"]
    assert b[0][3].state == pb.LEDGER_STATE_SYNCING  # type: ignore[attr-defined]
    assert recorder.transports == ["ServedCall" if frames else "Stream"]


async def test_an_index_that_speaks_only_grpc_gets_the_stream_over_grpc(
    caplog: pytest.LogCaptureFixture,
) -> None:
    recorder, ledgers, port = Recorder(), Ledgers(), free_port()
    ledgers.views[A] = view([10, 11])
    async with serving_grpc_only(recorder, port), forwarding(port, ledgers) as fwd:
        await wait_until_async(lambda: fwd.idle, timeout=10)
        fwd.publish(A, DOMAIN, [StoreBlocks(11, [12])])
        await wait_until_async(lambda: fwd.idle, timeout=10)
    assert [name for _, _, name, _ in recorder.of(A)] == ["snapshot", "store"]
    assert not fwd.frames and recorder.transports == ["Stream"]
    assert "does not answer Cortex frames" in caplog.text


async def test_resync_request_gets_a_fresh_snapshot() -> None:
    recorder, ledgers, port = Recorder(), Ledgers(), free_port()
    ledgers.views[A] = view([1])
    ledgers.views[B] = view([2])
    async with serving(recorder, port), forwarding(port, ledgers) as fwd:
        await wait_until_async(lambda: fwd.idle, timeout=10)
        recorder.resync_next = [B]
        ledgers.views[B] = view([2, 3])
        fwd.publish(A, DOMAIN, [StoreBlocks(1, [4])])
        await wait_until_async(lambda: fwd.idle and fwd.resync_requests == 1, timeout=10)
    snapshots = [(e, op) for e, _, name, op in recorder.of(B) if name == "snapshot"]
    assert len(snapshots) == 2 and snapshots[1][0] > snapshots[0][0]
    assert unpack_keys(snapshots[1][1].keys_le) == [2, 3]  # type: ignore[attr-defined]
    assert [name for _, _, name, _ in recorder.of(A)] == ["snapshot", "store"]


async def test_a_full_queue_turns_into_a_snapshot_not_unbounded_memory() -> None:
    recorder, ledgers, port = Recorder(), Ledgers(), free_port()
    ledgers.views[A] = view([1])
    async with serving(recorder, port), forwarding(port, ledgers, queue_max_updates=8) as fwd:
        await wait_until_async(lambda: fwd.idle, timeout=10)
        for key in range(100, 150):  # no await in between: the sender cannot drain
            ledgers.views[A] = view(list(range(100, key + 1)))
            fwd.publish(A, DOMAIN, [StoreBlocks(key - 1, [key])])
            assert fwd.queue_depth <= 8
        await wait_until_async(lambda: fwd.idle, timeout=10)
    assert fwd.overflows >= 1
    ops = recorder.of(A)
    last_snapshot = max(i for i, (_, _, name, _) in enumerate(ops) if name == "snapshot")
    assert last_snapshot > 0
    assert unpack_keys(ops[last_snapshot][3].keys_le) == list(range(100, 150))  # type: ignore[attr-defined]
    assert all(name == "store" for _, _, name, _ in ops[last_snapshot + 1:])


async def test_large_snapshots_are_chunked_into_chains() -> None:
    recorder, ledgers, port = Recorder(), Ledgers(), free_port()
    keys = list(range(1, 26))
    parents = [0, *keys[:9], 0, *keys[10:24]]  # two chains: 1..10 and 11..25
    ledgers.views[A] = view(keys, parents)
    async with serving(recorder, port), forwarding(port, ledgers, snapshot_chunk_keys=4) as fwd:
        await wait_until_async(lambda: fwd.idle, timeout=10)
    ops = recorder.of(A)
    assert ops[0][2] == "snapshot" and all(name == "store" for _, _, name, _ in ops[1:])
    assert [seq for _, seq, _, _ in ops] == list(range(len(ops)))
    got = unpack_keys(ops[0][3].keys_le)  # type: ignore[attr-defined]
    pairs = list(zip(unpack_keys(ops[0][3].parent_keys_le), got, strict=True))  # type: ignore[attr-defined]
    for _, _, _, store in ops[1:]:
        chain = unpack_keys(store.keys_le)  # type: ignore[attr-defined]
        parent = store.parent_key  # type: ignore[attr-defined]
        for key in chain:
            pairs.append((parent, key))
            parent = key
    assert pairs == list(zip(parents, keys, strict=True))


async def test_down_index_is_retried_and_gets_snapshots_and_tombstones_on_return() -> None:
    recorder, ledgers, port = Recorder(), Ledgers(), free_port()
    ledgers.views[A] = view([1])
    async with forwarding(port, ledgers) as fwd:
        await wait_until_async(lambda: fwd.failures >= 2, timeout=10, what="retries")
        assert fwd.state is not ForwarderState.STREAMING
        fwd.publish(A, DOMAIN, [StoreBlocks(1, [2])])
        assert fwd.queue_depth == 0  # nothing piles up while the index is down
        ledgers.views[A] = view([1, 2])
        ledgers.dead.append((B, DOMAIN, "lease expired"))
        async with serving(recorder, port):
            await wait_until_async(lambda: fwd.idle, timeout=10)
    assert [name for _, _, name, _ in recorder.of(A)] == ["snapshot"]
    assert [name for _, _, name, _ in recorder.of(B)] == ["remove_source"]


async def test_an_idle_stream_sends_heartbeats_and_stays_synced() -> None:
    recorder, ledgers, port = Recorder(), Ledgers(), free_port()
    ledgers.views[A] = view([1])
    async with serving(recorder, port), forwarding(port, ledgers, heartbeat_s=0.05) as fwd:
        await wait_until_async(lambda: fwd.idle, timeout=10)
        await wait_until_async(lambda: recorder.empty_batches >= 3, timeout=10,
                               what="heartbeats")
        assert fwd.heartbeats >= 3 and fwd.connects == 1
        fwd.publish(A, DOMAIN, [StoreBlocks(1, [2])])  # data still flows between heartbeats
        await wait_until_async(lambda: fwd.idle and len(recorder.of(A)) == 2, timeout=10)
    assert [name for _, _, name, _ in recorder.of(A)] == ["snapshot", "store"]


async def test_batches_ask_for_a_reply_only_to_fill_the_window_or_as_a_heartbeat() -> None:
    """Replies on request (``quiet_replies``; by default every batch asks, as the other tests
    here show: the recorder answers only batches that ask): with a window of two batches,
    no two batches in a row are quiet
    (the second fills the window: its reply acknowledges both); the last data batch of a
    burst, when quiet, is acknowledged by the next heartbeat's reply."""
    recorder, ledgers, port = Recorder(), Ledgers(), free_port()
    ledgers.views[A] = view([10])
    async with serving(recorder, port), forwarding(port, ledgers, heartbeat_s=0.5,
                                                   quiet_replies=True) as fwd:
        await wait_until_async(lambda: fwd.idle, timeout=10)
        start = recorder.batches
        for i in range(5):  # one batch each: published once the last was sent
            fwd.publish(A, DOMAIN, [StoreBlocks(10 + i, [11 + i])])
            await wait_until_async(lambda: fwd.queue_depth == 0, timeout=10)
        await wait_until_async(lambda: fwd.idle, timeout=10, what="the last batch acked")
    flags = recorder.quiet[start:]
    assert sum(flags) >= 2 and not any(a and b for a, b in itertools.pairwise(flags)), flags
    assert not flags[-1]  # the ack of everything came from a batch that asked
    stores = recorder.of(A)[-5:]  # every update arrived, in order
    assert [name for _, _, name, _ in stores] == ["store"] * 5
    assert [seq for _, seq, _, _ in stores] == list(range(stores[0][1], stores[0][1] + 5))


async def test_a_replica_that_never_replies_is_dropped_and_reconnected() -> None:
    recorder, ledgers, port = Recorder(mute=True), Ledgers(), free_port()
    ledgers.views[A] = view([1])
    async with serving(recorder, port), forwarding(
        port, ledgers, heartbeat_s=0.05, reply_timeout_s=0.3
    ) as fwd:
        await wait_until_async(lambda: recorder.streams >= 2, timeout=10, what="a reconnect")
        assert fwd.failures >= 1 and "no Sync reply" in fwd.last_error
        assert not fwd.idle  # nothing was ever acknowledged
    # each new stream starts over with a snapshot
    assert [name for _, _, name, _ in recorder.of(A)][:2] == ["snapshot", "snapshot"]


def test_heartbeat_must_be_shorter_than_the_reply_timeout() -> None:
    from cortex.ingest.errors import ConfigError

    with pytest.raises(ConfigError, match="heartbeat"):
        ForwarderConfig(heartbeat_s=2.0, reply_timeout_s=1.0)
    with pytest.raises(ConfigError, match="heartbeat"):
        ForwarderConfig(heartbeat_s=0.0)


@pytest.mark.parametrize("text", ["host", "host:", ":1", "host:0", "h:99999"])
def test_bad_index_addresses(text: str) -> None:
    from cortex.ingest.errors import ConfigError

    with pytest.raises(ConfigError):
        IndexTarget.parse(text)


def test_index_address_forms() -> None:
    assert IndexTarget.parse("[::1]:50051") == IndexTarget("::1", 50051)
    assert str(IndexTarget("::1", 5)) == "[::1]:5"


async def test_a_quiet_source_shares_the_first_batch_with_a_flooding_one() -> None:
    recorder, ledgers, port = Recorder(), Ledgers(), free_port()
    ledgers.views[A] = view([1])
    ledgers.views[B] = view([2])
    async with serving(recorder, port), forwarding(port, ledgers) as fwd:
        await wait_until_async(lambda: fwd.idle, timeout=10)
        first = recorder.batches
        fwd.publish(A, DOMAIN, [StoreBlocks(0, [key]) for key in range(10, 6010)])  # a backlog
        fwd.publish(B, DOMAIN, [StoreBlocks(2, [3])])  # published after all of it
        await wait_until_async(lambda: fwd.idle, timeout=10)
    b_store = next(i for i, u in enumerate(recorder.updates)
                   if u.source.worker_id == "b" and u.WhichOneof("op") == "store")
    assert recorder.batch_of[b_store] == first  # not behind A's 6,000 updates (12 batches)
    assert len([u for u in recorder.updates if u.source.worker_id == "a"]) == 6001
    assert recorder.batches - first >= 12


async def test_a_source_over_its_queue_bytes_becomes_a_snapshot_and_others_are_untouched(
) -> None:
    recorder, ledgers, port = Recorder(), Ledgers(), free_port()
    ledgers.views[A] = view([1])
    ledgers.views[B] = view([2])
    async with serving(recorder, port), forwarding(
        port, ledgers, source_queue_max_bytes=4096, queue_max_bytes=1 << 20
    ) as fwd:
        await wait_until_async(lambda: fwd.idle, timeout=10)
        for key in range(10, 60):  # 50 x 8 keys: ~5 KiB for A, no await in between
            fwd.publish(A, DOMAIN, [StoreBlocks(0, list(range(key * 8, key * 8 + 8)))])
            fwd.publish(B, DOMAIN, [StoreBlocks(2, [key])])
            assert fwd.queue_bytes <= 4096 + 50 * 56 + 1024
        ledgers.views[A] = view([1, 2, 3])
        await wait_until_async(lambda: fwd.idle, timeout=10)
    assert fwd.overflows == 1
    assert [name for _, _, name, _ in recorder.of(A)][-1] == "snapshot"
    b = [name for _, _, name, _ in recorder.of(B)]
    assert b == ["snapshot"] + ["store"] * 50


async def test_the_largest_queue_yields_when_the_replica_total_is_over() -> None:
    recorder, ledgers, port = Recorder(), Ledgers(), free_port()
    ledgers.views[A] = view([1])
    ledgers.views[B] = view([2])
    async with serving(recorder, port), forwarding(
        port, ledgers, source_queue_max_bytes=8192, queue_max_bytes=8192
    ) as fwd:
        await wait_until_async(lambda: fwd.idle, timeout=10)
        fwd.publish(B, DOMAIN, [StoreBlocks(2, [3])])  # small, first
        for key in range(10, 30):  # A grows the total past the replica's bound
            fwd.publish(A, DOMAIN, [StoreBlocks(0, list(range(key * 50, key * 50 + 50)))])
        await wait_until_async(lambda: fwd.idle, timeout=10)
    assert fwd.overflows == 1
    assert [name for _, _, name, _ in recorder.of(B)] == ["snapshot", "store"]
    assert [name for _, _, name, _ in recorder.of(A)][-1] == "snapshot"


async def test_epochs_start_above_what_the_replica_holds_when_the_clock_stepped_back(
) -> None:
    held = 1_900_000_000_000_000  # an epoch (µs) from an ingest whose clock was ahead
    recorder, ledgers, port = Recorder(held_epochs=[5, held, 7]), Ledgers(), free_port()
    ledgers.views[A] = view([1])
    ledgers.dead.append((B, DOMAIN, "gone"))
    clock = EpochClock(wall_us=lambda: 1_000_000_000_000_000)  # hours behind
    async with serving(recorder, port), forwarding(port, ledgers, epochs=clock) as fwd:
        await wait_until_async(lambda: fwd.idle, timeout=10)
        fwd.publish(A, DOMAIN, [Snapshot([], [], LedgerState.READY, "seq_reset")])
        await wait_until_async(lambda: fwd.idle, timeout=10)
    epochs = [u.epoch for u in recorder.updates]
    assert len(epochs) == 3 and min(epochs) > held
    assert fwd.epoch_floor_failures == 0
    a = [epoch for epoch, _, _, _ in recorder.of(A)]
    assert a[1] > a[0]  # and still strictly increasing


async def test_an_index_without_workers_leaves_epochs_to_the_wall_clock() -> None:
    recorder, ledgers, port = Recorder(held_epochs=None), Ledgers(), free_port()
    ledgers.views[A] = view([1])
    async with serving(recorder, port), forwarding(port, ledgers) as fwd:
        await wait_until_async(lambda: fwd.idle, timeout=10)
    assert fwd.epoch_floor_failures == 1 and len(recorder.of(A)) == 1


def test_the_epoch_clock_never_goes_back_nor_overflows() -> None:
    wall = [100]
    clock = EpochClock(wall_us=lambda: wall[0])
    assert [clock.next(), clock.next()] == [100, 101]
    wall[0] = 50  # stepped back
    assert clock.next() == 102
    clock.raise_floor(1000)
    assert clock.next() == 1001
    clock.raise_floor(10)  # a lower floor changes nothing
    assert clock.next() == 1002
    clock.raise_floor(2**64 + 5)  # a replica claiming more than a uint64
    assert clock.next() == 2**64 - 1 == clock.next()


async def test_a_guarded_index_takes_updates_only_with_its_peer_token(tmp_path: Path) -> None:
    (tmp_path / "peer").write_text("ingest-peer-token")
    config = IndexConfig(host="127.0.0.1", port=0, metrics_port=None,
                         peer_token_file=str(tmp_path / "peer"))
    ledgers = Ledgers()
    ledgers.views[A] = view([1, 2, 3])
    async with IndexServer(config) as index:
        port = index.port
        for token in (None, "wrong"):
            forwarder = IndexForwarder(
                IndexTarget("127.0.0.1", port), ingest_id="t", ledgers=ledgers, token=token,
                config=ForwarderConfig(backoff_min_s=0.02, backoff_max_s=0.1))
            task = asyncio.create_task(forwarder.run())
            try:
                await wait_until_async(lambda f=forwarder: f.failures >= 2, timeout=10)
                assert "UNAUTHENTICATED" in forwarder.last_error
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        assert not index.core.view.places  # nothing got in
        forwarder = IndexForwarder(
            IndexTarget("127.0.0.1", port), ingest_id="t", ledgers=ledgers,
            token="ingest-peer-token", config=ForwarderConfig(backoff_min_s=0.02))
        task = asyncio.create_task(forwarder.run())
        try:
            await wait_until_async(lambda: index.core.view.blocks_of(A) == 3, timeout=10)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def test_a_stream_failure_while_stopping_leaves_no_unretrieved_task_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The index resets the stream (the reply task ends with StreamTerminatedError) as the
    ingest stops (the forwarder is cancelled while it stops its sender): the error is the
    stream's, not asyncio's "Task exception was never retrieved"."""
    unretrieved: list[dict[str, object]] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _, context: unretrieved.append(context))
    recorder, ledgers, port = Recorder(), Ledgers(), free_port()
    sender_stopping, sender_may_stop = asyncio.Event(), asyncio.Event()

    async def reset_by_index(_: object) -> None:
        raise StreamTerminatedError("Stream reset by remote party, error_code: 0")

    async def slow_to_stop(_: object) -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            sender_stopping.set()
            await sender_may_stop.wait()
            raise

    try:
        async with serving(recorder, port):
            forwarder = IndexForwarder(IndexTarget("127.0.0.1", port), ingest_id="t",
                                       ledgers=ledgers)
            monkeypatch.setattr(forwarder, "_recv_loop", reset_by_index)
            monkeypatch.setattr(forwarder, "_send_loop", slow_to_stop)
            task = asyncio.create_task(forwarder.run())
            await asyncio.wait_for(sender_stopping.wait(), timeout=10)
            task.cancel()  # the ingest stops now
            await asyncio.sleep(0)
            sender_may_stop.set()
            await asyncio.gather(task, return_exceptions=True)
            assert task.cancelled()
            del task, forwarder  # their frames hold the reply task
        gc.collect()  # an unretrieved task error is reported when the task is collected
        await asyncio.sleep(0)
        assert [c["message"] for c in unretrieved] == []
    finally:
        loop.set_exception_handler(None)
