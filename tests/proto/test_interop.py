"""A plain grpcio client — what another scheduler generates from the same .proto — against
the real index: every RPC of the contract, both key encodings, errors.

grpcio's blocking client runs in a worker thread so the event loop keeps serving.
"""

from __future__ import annotations

import asyncio
import queue
import struct
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import numpy as np
import pytest

from cortex.hashing import Engine, HashDomain
from cortex.testing.grpcio_stubs import GrpcioStubs

pytestmark = pytest.mark.timeout(30)
MASK64 = 2**64 - 1
TIMEOUT = 10.0  # s, per call
DOMAIN = HashDomain("llama", 16, Engine.VLLM)


async def call(grpcio: GrpcioStubs, port: int, fn: Callable[[Any, Any], Any]) -> Any:
    """Run ``fn(stub, pb2)`` with a fresh grpcio channel, off the event loop."""

    def run() -> Any:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            return fn(grpcio.grpc.IndexStub(channel), grpcio.pb2)

    return await asyncio.to_thread(run)


def tokens() -> list[int]:
    # 4,096 tokens, a third of them >= 2**21 (4-5 byte varints on the wire)
    rng = np.random.default_rng(11)
    small = rng.integers(0, 2**17, 4096, dtype=np.uint64)
    large = rng.integers(2**21, 2**32, 4096, dtype=np.uint64)
    mixed: list[int] = np.where(np.arange(4096) % 3 == 0, large, small).tolist()
    return mixed


def sync(stub: Any, pb2: Any, batches: list[list[Any]]) -> list[Any]:
    """Send each batch and wait for its ack before the next: an interleaved stream."""
    outbox: queue.Queue[Any] = queue.Queue()

    def requests() -> Iterator[Any]:
        while (batch := outbox.get(timeout=TIMEOUT)) is not None:
            yield batch

    replies = stub.Sync(requests(), timeout=TIMEOUT)
    acks = []
    for updates in batches:
        outbox.put(pb2.UpdateBatch(ingest_id="grpcio-ingest", updates=updates))
        acks.append(next(replies))
    outbox.put(None)
    assert list(replies) == []
    return acks


def update(pb2: Any, worker: str, seq: int, **op: Any) -> Any:
    return pb2.LedgerUpdate(
        source=pb2.Source(worker_id=worker, dp_rank=1),
        domain=pb2.Domain(model=DOMAIN.model, block_size=16, engine=pb2.ENGINE_KIND_VLLM),
        epoch=5, seq=seq, **op)


async def test_sync_then_match_workers_and_stats(grpcio_modules: GrpcioStubs,
                                                 index_port: int) -> None:
    prompt = tokens()
    keys = DOMAIN.keys(prompt)
    root = DOMAIN.root_key()

    def run(stub: Any, pb2: Any) -> Any:
        acks = sync(stub, pb2, [
            [update(pb2, "w1", 0, snapshot=pb2.Snapshot(parent_keys=[root], keys=keys[:1]))],
            [update(pb2, "w1", 1, store=pb2.StoreBlocks(parent_key=keys[0], keys=keys[1:100])),
             update(pb2, "w1", 2, store=pb2.StoreBlocks(
                 parent_key=keys[99], keys_le=struct.pack("<2Q", *keys[100:102])))],
            [update(pb2, "w2", 7)],  # no op: rejected, the rest of the stream goes on
        ])
        by_tokens = stub.Match(pb2.MatchRequest(model=DOMAIN.model, token_ids=prompt,
                                                block_size=16), timeout=TIMEOUT)
        by_keys = stub.Match(pb2.MatchRequest(
            model=DOMAIN.model, block_keys=[4],  # both forms set: the bytes twin wins
            block_keys_le=struct.pack(f"<{len(keys)}Q", *keys)), timeout=TIMEOUT)
        workers = stub.Workers(pb2.WorkersRequest(model=DOMAIN.model), timeout=TIMEOUT)
        stats = stub.Stats(pb2.StatsRequest(), timeout=TIMEOUT)
        return acks, by_tokens, by_keys, workers, stats

    acks, by_tokens, by_keys, workers, stats = await call(grpcio_modules, index_port, run)
    assert [a.applied_batches for a in acks] == [1, 2, 3]
    assert [(s.worker_id, s.dp_rank) for s in acks[2].resync] == [("w2", 1)]
    for reply in (by_tokens, by_keys):
        assert [(m.worker_id, m.dp_rank, m.matched_blocks, m.matched_tokens, m.state)
                for m in reply.matches] == [("w1", 1, 102, 1632, 2), ("w2", 1, 0, 0, 1)]
        assert (reply.domain.model, reply.domain.block_size, reply.domain.engine) == (
            DOMAIN.model, 16, 2)
    assert by_tokens.query_blocks == 256
    assert [(w.source.worker_id, w.blocks, w.epoch, w.seq, w.state) for w in workers.workers
            ] == [("w1", 102, 5, 2, 2), ("w2", 0, 0, 0, 1)]  # w2 rejected: SYNCING, no epoch
    assert (stats.blocks, stats.holdings) == (103, 102)  # the root placeholder is a node


async def test_keys_near_2_64_round_trip(grpcio_modules: GrpcioStubs, index_port: int) -> None:
    keys = [MASK64 - i for i in range(256)]

    def run(stub: Any, pb2: Any) -> Any:
        sync(stub, pb2, [[update(pb2, "w", 0, snapshot=pb2.Snapshot(
            parent_keys=[MASK64 - 1000, *keys[:-1]], keys=keys))]])
        return stub.Match(pb2.MatchRequest(model=DOMAIN.model, block_keys=keys),
                          timeout=TIMEOUT)

    reply = await call(grpcio_modules, index_port, run)
    assert [(m.worker_id, m.matched_blocks) for m in reply.matches] == [("w", 256)]


async def test_errors_reach_grpcio_as_invalid_argument(grpcio_modules: GrpcioStubs,
                                                       index_port: int) -> None:
    def run(stub: Any, pb2: Any) -> Any:
        errors = []
        for request in (pb2.MatchRequest(), pb2.MatchRequest(model="m", block_keys_le=b"\x01")):
            with pytest.raises(grpc.RpcError) as raised:
                stub.Match(request, timeout=TIMEOUT)
            errors.append(raised.value)
        channel = grpc.insecure_channel(f"127.0.0.1:{index_port}")
        with channel:
            raw = channel.unary_unary("/cortex.index.v1.Index/Match")
            with pytest.raises(grpc.RpcError) as raised:
                raw(b"\x12\x05\x80\x80", timeout=TIMEOUT)  # a packed field cut short
            errors.append(raised.value)
        return errors

    missing, ragged, malformed = await call(grpcio_modules, index_port, run)
    assert (missing.code(), missing.details()) == (grpc.StatusCode.INVALID_ARGUMENT,
                                                   "model is required")
    assert ragged.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "multiple of 8" in ragged.details()
    assert (malformed.code(), malformed.details()) == (grpc.StatusCode.INVALID_ARGUMENT,
                                                       "malformed MatchRequest")


async def test_change_feed_and_replica_streams(grpcio_modules: GrpcioStubs,
                                               index_port: int) -> None:
    keys = DOMAIN.keys(list(range(64)))

    def run(stub: Any, pb2: Any) -> Any:
        sync(stub, pb2, [[update(pb2, "w", 0, snapshot=pb2.Snapshot(
            parent_keys=[DOMAIN.root_key(), *keys[:-1]], keys=keys))]])
        feed = stub.Changes(pb2.ChangesRequest(), timeout=TIMEOUT)
        first = next(feed)  # a heartbeat: the feed is open
        sync(stub, pb2, [[update(pb2, "w", 1, remove=pb2.RemoveBlocks(keys=[keys[3]]))]])
        removal = next(b for b in feed if b.removed_keys_le)
        feed.cancel()
        requests: queue.Queue[Any] = queue.Queue()
        requests.put(pb2.ReplicaRequest(models=[DOMAIN.model], replica_id="grpcio"))
        replica = stub.Replicate(iter(requests.get, None), timeout=TIMEOUT)
        snapshot = next(replica)
        live = next(replica)  # a heartbeat
        replica.cancel()
        return first, removal, snapshot, live

    first, removal, snapshot, live = await call(grpcio_modules, index_port, run)
    assert first.to_version >= first.from_version
    assert [s.worker_id for s in removal.removed_blocks_sources] == ["w"]
    assert struct.unpack("<Q", removal.removed_keys_le) == (keys[3],)
    assert (snapshot.seq, snapshot.snapshot, snapshot.synced) == (1, True, True)
    assert [(s.source.worker_id, s.state) for s in snapshot.sources] == [("w", 2)]
    assert sum(len(c.keys_le) for c in snapshot.trees) // 8 >= 4
    assert (live.seq, live.snapshot, live.index_id) == (2, False, snapshot.index_id)
