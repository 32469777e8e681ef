"""The Changes feed and the memory budget over real gRPC, plus a plain grpcio client."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpclib.client import Channel

from cortex.hashing import Engine, HashDomain
from cortex.index.config import IndexConfig
from cortex.index.server import IndexServer
from cortex.ledger.client import IndexStub, match_request
from cortex.ledger.codec import pb
from cortex.ledger.cores import node_bytes
from cortex.testing.grpcio_stubs import load_grpcio_stubs
from cortex.testing.index_sync import LedgerUpdates, SyncSession

DOMAIN = HashDomain("qwen", 4, Engine.VLLM)
ROOT = DOMAIN.root_key()


def keys_of(batch: pb.ChangeBatch) -> list[int]:
    return np.frombuffer(batch.removed_keys_le, "<u8").tolist()


async def next_real(feed: AsyncIterator[pb.ChangeBatch]) -> pb.ChangeBatch:
    """The next batch that announces something (skips heartbeats)."""
    while True:
        batch = await asyncio.wait_for(anext(feed), 10)
        if batch.reset or batch.removed_keys_le or batch.cleared_sources:
            return batch


async def test_feed_announces_removals_clears_and_state_loss(
    channel: Channel, stub: IndexStub
) -> None:
    keys = DOMAIN.keys(list(range(40)))
    w, v = LedgerUpdates("w", DOMAIN), LedgerUpdates("v", DOMAIN, dp_rank=3)
    feed = stub.changes(pb.ChangesRequest())
    hello = await anext(feed)
    assert not hello.reset and hello.from_version == hello.to_version
    async with SyncSession(channel) as session:
        await session.send([w.chain_snapshot([(ROOT, keys)]), v.chain_snapshot([(ROOT, keys)])])
        await session.send([w.store(keys[-1], [7, 8])])  # stores are not announced
        await session.send([w.remove(keys[8:]), w.remove([999])])
        removal = await next_real(feed)
        assert keys_of(removal) == keys[8:]
        assert [(s.worker_id, s.dp_rank) for s in removal.removed_blocks_sources] == [("w", 0)]
        assert removal.domain.model == "qwen" and removal.domain.engine == pb.ENGINE_KIND_VLLM
        assert removal.from_version >= hello.to_version and removal.to_version > hello.to_version
        await session.send([v.set_state(pb.LEDGER_STATE_STALE)])
        stale = await next_real(feed)
        assert [(s.worker_id, s.dp_rank) for s in stale.cleared_sources] == [("v", 3)]
        await session.send([w.clear()])
        cleared = await next_real(feed)
        assert [s.worker_id for s in cleared.cleared_sources] == ["w"]
        # a late subscriber catches up from a version
        late = stub.changes(pb.ChangesRequest(since_version=hello.to_version, model="qwen"))
        caught: list[pb.ChangeBatch] = []
        while not caught or caught[-1].to_version < cleared.to_version:
            caught.append(await asyncio.wait_for(anext(late), 10))
        assert caught[0].from_version == hello.to_version
        assert all(a.to_version == b.from_version for a, b in itertools.pairwise(caught))
        assert [k for b in caught for k in keys_of(b)] == keys[8:]
        assert {s.worker_id for b in caught for s in b.cleared_sources} == {"v", "w"}
        # another model's feed stays quiet
        other = stub.changes(pb.ChangesRequest(since_version=hello.to_version, model="x"))
        quiet = await asyncio.wait_for(anext(other), 10)
        assert not quiet.removed_keys_le and not quiet.cleared_sources and not quiet.reset


async def test_idle_feed_sends_heartbeats(stub: IndexStub) -> None:
    feed = stub.changes(pb.ChangesRequest())
    first = await anext(feed)
    second = await asyncio.wait_for(anext(feed), 10)
    assert second.from_version == first.to_version and not second.reset


async def test_subscriber_behind_the_ring_gets_a_reset(
    make_config: Callable[..., IndexConfig],
) -> None:
    keys = DOMAIN.keys(list(range(200)))
    async with IndexServer(make_config(changes_max_keys=8, metrics_port=None)) as server:
        channel = Channel("127.0.0.1", server.port)
        try:
            stub = IndexStub(channel)
            start = server.core.version
            w = LedgerUpdates("w", DOMAIN)
            async with SyncSession(channel) as session:
                await session.send([w.chain_snapshot([(ROOT, keys)])])
                await session.send([w.remove(keys[10:20])])
                await session.send([w.remove(keys[20:])])
            feed = stub.changes(pb.ChangesRequest(since_version=start))
            first = await anext(feed)
            assert first.reset and first.to_version == server.core.version
        finally:
            channel.close()


async def test_memory_budget_evicts_least_recently_matched_leaves(
    make_config: Callable[..., IndexConfig],
) -> None:
    per_node = node_bytes(1)
    budget = 400 * per_node
    config = make_config(memory_budget_bytes=budget, low_watermark=0.9, metrics_port=None)
    async with IndexServer(config) as server:
        channel = Channel("127.0.0.1", server.port)
        try:
            stub = IndexStub(channel)
            feed = stub.changes(pb.ChangesRequest())
            await anext(feed)
            w = LedgerUpdates("w", DOMAIN)
            hot = DOMAIN.keys(list(range(10_000, 10_000 + 4 * 50)))
            async with SyncSession(channel) as session:
                await session.send([w.snapshot([], []), w.store(ROOT, hot)])
                for i in range(20):
                    await stub.match(match_request(DOMAIN.model, block_keys=hot))
                    chain = DOMAIN.keys(list(range(i * 400, i * 400 + 4 * 50)))
                    await session.send([w.store(ROOT, chain)])
            stats = await stub.stats(pb.StatsRequest())
            assert stats.evictions > 0
            assert stats.bytes_estimate <= budget
            # the hot prefix, matched before every store, survived
            match = await stub.match(match_request(DOMAIN.model, block_keys=hot))
            assert match.matches[0].matched_blocks == 50
            # every evicted key was announced, and none of them still counts as held
            evicted: set[int] = set()
            while len(evicted) < stats.evictions:
                evicted.update(keys_of(await next_real(feed)))
            assert len(evicted) == stats.evictions
            assert not any(server.core.trees[DOMAIN].holds(w_src, k)
                           for w_src in server.core.trees[DOMAIN].sources for k in evicted)
        finally:
            channel.close()


@pytest.fixture(scope="module")
def grpcio_stubs(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    return load_grpcio_stubs(Path(tmp_path_factory.mktemp("grpcio")))


async def test_plain_grpcio_client_matches_by_token_ids(
    index_server: IndexServer, channel: Channel, grpcio_stubs
) -> None:  # type: ignore[no-untyped-def]
    pb2, pb2_grpc = grpcio_stubs.pb2, grpcio_stubs.grpc
    tokens = list(range(100, 100 + 4 * 9))
    keys = DOMAIN.keys(tokens)
    w = LedgerUpdates("w", DOMAIN, dp_rank=2)
    async with SyncSession(channel) as session:
        await session.send([w.chain_snapshot([(ROOT, keys[:7])])])

    def call() -> tuple[object, object, object]:
        with grpc.insecure_channel(index_server.target) as ch:
            stub = pb2_grpc.IndexStub(ch)
            by_tokens = stub.Match(pb2.MatchRequest(model="qwen", token_ids=tokens), timeout=10)
            by_keys = stub.Match(pb2.MatchRequest(model="qwen", block_keys=keys), timeout=10)
            try:
                stub.Match(pb2.MatchRequest(model=""), timeout=10)
            except grpc.RpcError as exc:
                error = (exc.code(), exc.details())
            return by_tokens, by_keys, error

    by_tokens, by_keys, error = await asyncio.to_thread(call)
    for reply in (by_tokens, by_keys):
        assert reply.query_blocks == 9  # type: ignore[attr-defined]
        [m] = reply.matches  # type: ignore[attr-defined]
        assert (m.worker_id, m.dp_rank, m.matched_blocks, m.matched_tokens, m.state) == (
            "w", 2, 7, 28, pb2.LEDGER_STATE_READY)
        assert reply.domain.engine == pb2.ENGINE_KIND_VLLM  # type: ignore[attr-defined]
    assert error == (grpc.StatusCode.INVALID_ARGUMENT, "model is required")
