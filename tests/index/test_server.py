"""The Index service over real gRPC on 127.0.0.1: Sync, Match, Workers, Stats, health,
metrics, graceful stop, restart and resync."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import aiohttp
import pytest
from grpclib.client import Channel
from grpclib.const import Cardinality, Status
from grpclib.exceptions import GRPCError, StreamTerminatedError
from grpclib.health.v1.health_grpc import HealthStub
from grpclib.health.v1.health_pb2 import HealthCheckRequest, HealthCheckResponse
from grpclib.reflection.v1.reflection_grpc import ServerReflectionStub
from grpclib.reflection.v1.reflection_pb2 import ServerReflectionRequest

from cortex.hashing import Engine, HashDomain
from cortex.index.config import IndexConfig
from cortex.index.server import IndexServer
from cortex.ledger import cores
from cortex.ledger import tree as tree_module
from cortex.ledger.client import IndexStub, match_request
from cortex.ledger.codec import pb
from cortex.ledger.model import Source
from cortex.ledger.tree import RadixHashTree
from cortex.testing import wait_until_async
from cortex.testing.index_sync import SYNC_METHOD, LedgerUpdates, SyncSession

DOMAIN = HashDomain("llama-3-8b", 16, Engine.SGLANG)
ROOT = DOMAIN.root_key()
READY, SYNCING = pb.LEDGER_STATE_READY, pb.LEDGER_STATE_SYNCING


def prompt(n_blocks: int, offset: int = 0) -> list[int]:
    return [(offset * 7919 + i) % 50_000 for i in range(n_blocks * DOMAIN.block_size)]


def by_worker(reply: pb.MatchResponse) -> dict[tuple[str, int], tuple[int, int, int]]:
    return {
        (m.worker_id, m.dp_rank): (m.matched_blocks, m.matched_tokens, int(m.state))
        for m in reply.matches
    }


async def test_sync_then_match_by_keys_and_by_tokens(
    index_server: IndexServer, channel: Channel, stub: IndexStub
) -> None:
    tokens = prompt(6)
    keys = DOMAIN.keys(tokens)
    w0, w1 = LedgerUpdates("w0", DOMAIN), LedgerUpdates("w1", DOMAIN, dp_rank=1)
    async with SyncSession(channel) as session:
        reply = await session.send([
            w0.snapshot([], []), w0.store(ROOT, keys[:4]), w0.store(keys[3], keys[4:]),
            w1.snapshot([ROOT, keys[0]], keys[:2]),
        ])
    assert reply.applied_batches == 1 and not reply.resync
    assert reply.index_id == index_server.index_id
    by_keys = await stub.match(match_request(DOMAIN.model, block_keys=keys))
    assert by_worker(by_keys) == {("w0", 0): (6, 96, 2), ("w1", 1): (2, 32, 2)}
    assert by_keys.query_blocks == 6 and by_keys.index_version == reply.index_version
    assert by_keys.domain == pb.Domain(model=DOMAIN.model, block_size=16,
                                       engine=pb.ENGINE_KIND_SGLANG)
    # token ids: the index keys them itself; a partial trailing block is not keyed
    by_tokens = await stub.match(match_request(DOMAIN.model, token_ids=tokens[:-5]))
    assert by_worker(by_tokens) == {("w0", 0): (5, 80, 2), ("w1", 1): (2, 32, 2)}
    assert by_tokens.query_blocks == 5
    # the repeated field and its packed twin agree
    plain = await stub.match(pb.MatchRequest(model=DOMAIN.model, token_ids=tokens))
    packed = await stub.match(match_request(DOMAIN.model, token_ids=tokens))
    assert by_worker(plain)[("w0", 0)] == (6, 96, 2)
    assert by_worker(plain) == by_worker(packed)
    # candidate filter and cap
    only = await stub.match(match_request(DOMAIN.model, block_keys=keys,
                                          candidate_workers=["w1"], max_blocks=1))
    assert by_worker(only) == {("w1", 1): (1, 16, 2)}
    # a LoRA chain has another root: no match
    lora = await stub.match(match_request(DOMAIN.model, token_ids=tokens, lora_name="sql"))
    assert {m.matched_blocks for m in lora.matches} == {0}


async def test_unknown_model_answers_empty(stub: IndexStub) -> None:
    reply = await stub.match(match_request("nobody", block_keys=[1, 2, 3]))
    assert reply.matches == [] and reply.query_blocks == 3
    reply = await stub.match(match_request("nobody", token_ids=list(range(64)), block_size=16))
    assert reply.query_blocks == 4


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (pb.MatchRequest(block_keys=[1]), "model is required"),
        (pb.MatchRequest(model="m", engine=7), "engine"),  # type: ignore[arg-type]
        (pb.MatchRequest(model="m", block_keys_le=b"\x01\x02\x03"), "multiple of 8"),
        (pb.MatchRequest(model="m", token_ids_le=b"\x01\x02\x03"), "multiple of 4"),
        (pb.MatchRequest(model="m", block_keys=list(range(70_000))), "exceed the limit"),
    ],
)
async def test_malformed_match_is_invalid_argument(
    stub: IndexStub, request_: pb.MatchRequest, message: str
) -> None:
    with pytest.raises(GRPCError) as info:
        await stub.match(request_)
    assert info.value.status is Status.INVALID_ARGUMENT
    assert message in (info.value.message or "")
    assert "Traceback" not in (info.value.message or "")


async def test_ambiguous_domain_needs_block_size_or_engine(
    channel: Channel, stub: IndexStub
) -> None:
    vllm = HashDomain(DOMAIN.model, 16, Engine.VLLM)
    big = HashDomain(DOMAIN.model, 32, Engine.SGLANG)
    a, b, c = LedgerUpdates("a", DOMAIN), LedgerUpdates("b", vllm), LedgerUpdates("c", big)
    keys_v = vllm.keys(prompt(2))
    async with SyncSession(channel) as session:
        await session.send([a.snapshot([], []), b.chain_snapshot([(vllm.root_key(), keys_v)]),
                            c.snapshot([], [])])
    with pytest.raises(GRPCError) as info:
        await stub.match(match_request(DOMAIN.model, token_ids=prompt(2)))
    assert info.value.status is Status.INVALID_ARGUMENT
    assert "3 hash domains" in (info.value.message or "")
    with pytest.raises(GRPCError):
        await stub.match(match_request(DOMAIN.model, token_ids=prompt(2), block_size=16))
    reply = await stub.match(match_request(DOMAIN.model, token_ids=prompt(2), block_size=16,
                                           engine=int(pb.ENGINE_KIND_VLLM)))
    assert by_worker(reply) == {("b", 0): (2, 32, 2)}
    reply = await stub.match(match_request(DOMAIN.model, token_ids=prompt(2), block_size=32))
    assert by_worker(reply) == {("c", 0): (0, 0, 2)}


async def test_sequencing_duplicates_gaps_stale_epochs_and_resync(
    channel: Channel, stub: IndexStub
) -> None:
    keys = DOMAIN.keys(prompt(8))
    w = LedgerUpdates("w", DOMAIN)
    async with SyncSession(channel) as session:
        first = [w.snapshot([], []), w.store(ROOT, keys[:2])]
        await session.send(first)
        version = (await stub.stats(pb.StatsRequest())).index_version
        # a replayed batch is applied once
        reply = await session.send(first)
        assert reply.index_version == version and not reply.resync
        # a gap: seq 4 arrives after 2 -> SYNCING, resync requested, update dropped
        w.seq += 1
        reply = await session.send([w.store(keys[1], keys[2:4])])
        assert [s.worker_id for s in reply.resync] == ["w"]
        workers = await stub.workers(pb.WorkersRequest())
        assert workers.workers[0].state == SYNCING
        match = await stub.match(match_request(DOMAIN.model, block_keys=keys))
        assert by_worker(match) == {("w", 0): (2, 32, int(SYNCING))}
        # the snapshot re-establishes the ledger (same epoch, later seq)
        reply = await session.send([w.chain_snapshot([(ROOT, keys[:5])])])
        assert not reply.resync
        # a stale epoch is rejected, a duplicate snapshot too
        old = LedgerUpdates("w", DOMAIN, epoch=0)
        reply = await session.send([old.snapshot([], [])])
        match = await stub.match(match_request(DOMAIN.model, block_keys=keys))
        assert by_worker(match) == {("w", 0): (5, 80, int(READY))}
        # a higher epoch without a snapshot discards the old epoch's blocks
        w.epoch, w.seq = 2, 0
        reply = await session.send([w.store(keys[4], keys[5:6])])
        assert [s.worker_id for s in reply.resync] == ["w"]
        match = await stub.match(match_request(DOMAIN.model, block_keys=keys))
        assert by_worker(match) == {("w", 0): (0, 0, int(SYNCING))}
        reply = await session.send([w.chain_snapshot([(ROOT, keys)], epoch=3)])
        match = await stub.match(match_request(DOMAIN.model, block_keys=keys))
        assert by_worker(match) == {("w", 0): (8, 128, int(READY))}
        # state changes, clear, remove source
        await session.send([w.set_state(pb.LEDGER_STATE_STALE, "gap")])
        info = (await stub.workers(pb.WorkersRequest(model=DOMAIN.model))).workers[0]
        assert (info.state, info.reason, info.blocks, info.epoch) == (
            pb.LEDGER_STATE_STALE, "gap", 8, 3)
        await session.send([w.clear()])
        assert (await stub.workers(pb.WorkersRequest())).workers[0].blocks == 0
        await session.send([w.remove_source()])
        info = (await stub.workers(pb.WorkersRequest())).workers[0]
        assert info.state == pb.LEDGER_STATE_REMOVED
        match = await stub.match(match_request(DOMAIN.model, block_keys=keys))
        assert match.matches == []


async def test_quiet_batches_are_answered_only_to_ask_for_a_resync(
    index_server: IndexServer, channel: Channel, stub: IndexStub
) -> None:
    """A quiet batch gets no reply unless it is the stream's first or a source must be
    re-snapshotted; every batch is applied and the next reply's ack counts them all."""
    keys = DOMAIN.keys(prompt(6))
    w = LedgerUpdates("w", DOMAIN)
    quiet = "cortex_index_quiet_batches_total"
    quiet_before = index_server.metrics.registry.get_sample_value(quiet) or 0.0
    async with SyncSession(channel) as session:
        await session.post([w.snapshot([], [])], quiet=True)  # the first: answered
        first = await session.reply()
        assert first.applied_batches == 1 and first.index_id == index_server.index_id
        await session.post([w.store(ROOT, keys[:2])], quiet=True)
        await session.post([w.store(keys[1], keys[2:4])], quiet=True)
        w.seq += 1  # a gap: the quiet batch is answered with the resync
        await session.post([w.store(keys[4], keys[5:6])], quiet=True)
        resync = await session.reply()
        assert resync.applied_batches == 4 and [s.worker_id for s in resync.resync] == ["w"]
        await session.post([w.chain_snapshot([(ROOT, keys[:4])])], quiet=True)
        reply = await session.send([])  # asks: its ack counts the quiet one before it
        assert reply.applied_batches == 6 and not reply.resync
    match = await stub.match(match_request(DOMAIN.model, block_keys=keys))
    assert by_worker(match) == {("w", 0): (4, 64, int(READY))}
    assert index_server.metrics.registry.get_sample_value(quiet) - quiet_before == 3


async def test_malformed_updates_are_rejected_and_resynced(
    channel: Channel, stub: IndexStub
) -> None:
    w = LedgerUpdates("w", DOMAIN)
    keys = DOMAIN.keys(prompt(3))
    async with SyncSession(channel) as session:
        await session.send([w.chain_snapshot([(ROOT, keys)])])
        bad = w.store(ROOT, keys)
        bad.store.keys_le = b"\x00" * 5
        reply = await session.send([bad, pb.LedgerUpdate(seq=9)])  # bad keys, no source
        assert [s.worker_id for s in reply.resync] == ["w"]
        not_parents_first = w.snapshot([keys[1], ROOT], [keys[2], keys[1]])
        reply = await session.send([not_parents_first])
        assert [s.worker_id for s in reply.resync] == ["w"]
        # the stream survived; a good snapshot repairs the source
        reply = await session.send([w.chain_snapshot([(ROOT, keys)])])
        assert not reply.resync
    match = await stub.match(match_request(DOMAIN.model, block_keys=keys))
    assert by_worker(match) == {("w", 0): (3, 48, int(READY))}


async def test_repeated_key_fields_apply_like_the_le_twins(
    channel: Channel, stub: IndexStub
) -> None:
    """Senders other than Cortex's own write keys in the ``repeated fixed64`` fields."""
    keys = DOMAIN.keys(prompt(6))
    twins = LedgerUpdates("twins", DOMAIN)
    source = pb.Source(worker_id="repeated", dp_rank=1)
    domain = pb.Domain(model=DOMAIN.model, block_size=16, engine=1)

    def repeated(seq: int, **op: object) -> pb.LedgerUpdate:
        return pb.LedgerUpdate(source=source, domain=domain, epoch=1, seq=seq,
                               **op)  # type: ignore[arg-type]

    async with SyncSession(channel) as session:
        reply = await session.send([
            twins.snapshot([ROOT, keys[0]], keys[:2]),
            twins.store(keys[1], keys[2:6]),
            twins.remove(keys[4:5]),
            repeated(1, snapshot=pb.Snapshot(parent_keys=[ROOT, keys[0]], keys=keys[:2])),
            repeated(2, store=pb.StoreBlocks(parent_key=keys[1], keys=keys[2:6])),
            repeated(3, remove=pb.RemoveBlocks(keys=keys[4:5])),
        ])
    assert not reply.resync
    match = await stub.match(match_request(DOMAIN.model, block_keys=keys))
    assert by_worker(match) == {("twins", 0): (4, 64, int(READY)),
                                ("repeated", 1): (4, 64, int(READY))}


async def test_undecodable_batch_ends_only_its_stream(channel: Channel, stub: IndexStub) -> None:
    w = LedgerUpdates("w", DOMAIN)
    keys = DOMAIN.keys(prompt(2))
    async with SyncSession(channel) as good:
        await good.send([w.snapshot([], [])])
        async with channel.request(SYNC_METHOD, Cardinality.STREAM_STREAM, pb.UpdateBatch,
                                   pb.SyncReply, timeout=10) as bad:
            # LedgerCodec sends bytes as they are: not an UpdateBatch
            await bad.send_message(b"\x12\x02\x0a\x05", end=True)  # type: ignore[arg-type]
            with pytest.raises(GRPCError) as raised:
                await bad.recv_message()
        reply = await good.send([w.store(ROOT, keys)])
    assert raised.value.status is Status.INVALID_ARGUMENT
    assert raised.value.message == "malformed UpdateBatch"
    assert reply.applied_batches == 2 and not reply.resync
    match = await stub.match(match_request(DOMAIN.model, block_keys=keys))
    assert by_worker(match) == {("w", 0): (2, 32, int(READY))}


async def test_stats_workers_health_and_metrics(
    index_server: IndexServer, channel: Channel, stub: IndexStub
) -> None:
    keys = DOMAIN.keys(prompt(4))
    w = LedgerUpdates("w", DOMAIN)
    async with SyncSession(channel) as session:
        await session.send([w.chain_snapshot([(ROOT, keys)])])
    await stub.match(match_request(DOMAIN.model, block_keys=keys))
    stats = await stub.stats(pb.StatsRequest())
    assert (stats.blocks, stats.holdings, stats.index_id) == (5, 4, index_server.index_id)
    assert stats.bytes_estimate > 0
    assert stats.bytes_budget == index_server.config.memory_budget_bytes
    assert stats.domains[0].domain.model == DOMAIN.model and stats.domains[0].sources == 1
    health = HealthStub(channel)
    for service in ("", "cortex.index.v1.Index"):
        status = await health.Check(HealthCheckRequest(service=service))
        assert status.status == HealthCheckResponse.SERVING
    async with ServerReflectionStub(channel).ServerReflectionInfo.open() as reflect:
        await reflect.send_message(ServerReflectionRequest(list_services=""))
        await reflect.send_message(
            ServerReflectionRequest(file_containing_symbol="cortex.index.v1.Index"), end=True)
        listed, described = [await reflect.recv_message() for _ in range(2)]
    assert listed is not None and described is not None
    assert "cortex.index.v1.Index" in {s.name for s in listed.list_services_response.service}
    (proto,) = described.file_descriptor_response.file_descriptor_proto
    assert b"ReplicaBatch" in proto  # a grpcurl-style client can read the whole contract
    url = f"http://127.0.0.1:{index_server.metrics_port}/metrics"
    async with aiohttp.ClientSession() as http, http.get(url) as response:
        text = await response.text()
    assert response.status == 200
    for name in ("cortex_index_blocks{", "cortex_index_match_requests_total{outcome=\"ok\"} 1.0",
                 "cortex_index_updates_total{", "cortex_index_sources{state=\"ready\"} 1.0",
                 "cortex_index_bytes_estimate", "cortex_index_evictions_total",
                 f'cortex_index_ledger_core{{core="{cores.active()}"}} 1.0'):
        assert name in text, name


async def test_graceful_stop_ends_streams_with_unavailable(
    make_config: Callable[..., IndexConfig],
) -> None:
    server = IndexServer(make_config(metrics_port=None))
    await server.start()
    channel = Channel("127.0.0.1", server.port)
    try:
        stub = IndexStub(channel)
        feed = stub.changes(pb.ChangesRequest())
        first = await anext(feed)  # the feed is open
        assert not first.reset
        with pytest.raises((GRPCError, StreamTerminatedError)) as info:
            async with SyncSession(channel) as session:
                await session.send([])
                stop = asyncio.ensure_future(server.stop())
                await session.send([])
                await session.send([])
        if isinstance(info.value, GRPCError):
            assert info.value.status is Status.UNAVAILABLE
        with pytest.raises((GRPCError, StreamTerminatedError)):
            await anext(feed)
        await asyncio.wait_for(stop, 10)
    finally:
        channel.close()
        await server.stop()
    assert "stopped" in repr(server)


async def test_restarted_index_reports_syncing_until_snapshots_arrive(
    make_config: Callable[..., IndexConfig],
) -> None:
    """Ingest keeps streaming across an index restart: the new process starts empty, asks
    for snapshots (index_id changed), reports SYNCING, and converges on the snapshots."""
    keys = DOMAIN.keys(prompt(6))
    w0, w1 = LedgerUpdates("w0", DOMAIN), LedgerUpdates("w1", DOMAIN)
    first = IndexServer(make_config(metrics_port=None))
    async with first:
        port = first.port
        channel = Channel("127.0.0.1", port)
        try:
            async with SyncSession(channel) as session:
                before = await session.send([w0.chain_snapshot([(ROOT, keys)]),
                                             w1.chain_snapshot([(ROOT, keys[:3])])])
        finally:
            channel.close()
        old_version = before.index_version
    second = IndexServer(make_config(port=port, metrics_port=None))
    async with second:
        assert second.index_id != first.index_id and second.core.version > old_version
        channel = Channel("127.0.0.1", port)
        try:
            stub = IndexStub(channel)
            # a gateway resuming its change feed from the old process is told to reset
            feed = stub.changes(pb.ChangesRequest(since_version=old_version))
            assert (await anext(feed)).reset
            async with SyncSession(channel) as session:
                reply = await session.send([w0.store(keys[5], keys[:0] or [12345]),
                                            w1.remove(keys[2:3])])
                assert reply.index_id == second.index_id
                assert {s.worker_id for s in reply.resync} == {"w0", "w1"}
                workers = await stub.workers(pb.WorkersRequest())
                assert {(i.source.worker_id, i.state) for i in workers.workers} == {
                    ("w0", SYNCING), ("w1", SYNCING)}
                # ingest answers with snapshots (new epoch); the index converges
                reply = await session.send([w0.chain_snapshot([(ROOT, keys)], epoch=2),
                                            w1.chain_snapshot([(ROOT, keys[:2])], epoch=2)])
                assert not reply.resync
            match = await stub.match(match_request(DOMAIN.model, block_keys=keys))
            assert by_worker(match) == {("w0", 0): (6, 96, int(READY)),
                                        ("w1", 0): (2, 32, int(READY))}

            async def ready() -> bool:
                infos = (await stub.workers(pb.WorkersRequest())).workers
                return all(i.state == READY for i in infos)

            await wait_until_async(ready, timeout=5, what="all workers READY")
        finally:
            channel.close()


async def test_match_reports_offload_tiers_and_the_shared_tier(
    channel: Channel, stub: IndexStub
) -> None:
    """A rank's device prefix stays `matched_blocks`; host and disk add the blocks that follow
    (cheapest tier first), a device block after a gap adds nothing, and the shared tier is
    one cluster-level count."""
    keys = DOMAIN.keys(prompt(8))
    w0 = LedgerUpdates("w0", DOMAIN)
    host = LedgerUpdates("w0", DOMAIN, tier=pb.TIER_HOST)
    disk = LedgerUpdates("w0", DOMAIN, tier=pb.TIER_DISK)
    w1_host = LedgerUpdates("w1", DOMAIN, tier=pb.TIER_HOST)
    shared = LedgerUpdates("w2", DOMAIN, tier=pb.TIER_SHARED)
    async with SyncSession(channel) as session:
        await session.send([
            w0.snapshot([], []), w0.store(ROOT, keys[:2]), w0.store(keys[5], keys[6:7]),
            host.snapshot([], []), host.store(ROOT, keys[:4]),
            disk.snapshot([], []), disk.store(keys[2], keys[3:6]),
            w1_host.snapshot([], []), w1_host.store(ROOT, keys[:3]),
            shared.snapshot([], []), shared.store(ROOT, keys[:5]),
        ])
    reply = await stub.match(match_request(DOMAIN.model, block_keys=keys))
    ranks = {m.worker_id: m for m in reply.matches}
    assert set(ranks) == {"w0", "w1"}  # the shared tier's source is no worker's match
    w0_match = ranks["w0"]
    assert (w0_match.matched_blocks, w0_match.state) == (2, READY)
    assert [(t.tier, t.blocks, t.tokens) for t in w0_match.tiers] == [
        (pb.TIER_HOST, 2, 32), (pb.TIER_DISK, 2, 32)]
    w1_match = ranks["w1"]  # host only: no device prefix, no device state
    assert (w1_match.matched_blocks, w1_match.state) == (0, pb.LEDGER_STATE_UNSPECIFIED)
    assert [(t.tier, t.blocks) for t in w1_match.tiers] == [(pb.TIER_HOST, 3)]
    assert reply.shared_blocks == 5
    # a removal of one medium removes from that tier only
    async with SyncSession(channel) as session:
        await session.send([host.remove(keys[2:3])])
    reply = await stub.match(match_request(DOMAIN.model, block_keys=keys))
    w0_match = {m.worker_id: m for m in reply.matches}["w0"]
    assert w0_match.matched_blocks == 2
    assert list(w0_match.tiers) == []  # block 2 is nowhere now: the run stops there


async def test_removed_and_cleared_ledgers_are_swept_in_steps_never_credited(
    index_server: IndexServer, channel: Channel, stub: IndexStub,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(RadixHashTree, "sync_clear_max", 8)  # 200 blocks count as large
    monkeypatch.setattr(tree_module, "SWEEP_SLOTS", 16)
    keys = DOMAIN.keys(prompt(200))
    big, gone, other = (LedgerUpdates(w, DOMAIN) for w in ("big", "gone", "other"))
    async with SyncSession(channel) as session:
        await session.send([big.snapshot([], []), big.store(ROOT, keys),
                            gone.snapshot([], []), gone.store(ROOT, keys),
                            other.snapshot([], []), other.store(ROOT, keys[:3])])
        view = index_server.core.view
        steps = []
        sweep = view.sweep
        monkeypatch.setattr(view, "sweep", lambda: steps.append(1) or sweep())
        await session.send([big.clear(), big.store(ROOT, keys[:2]), gone.remove_source()])
        # the answer right after: the cleared ledger counts only what came after the clear
        reply = await stub.match(match_request(DOMAIN.model, block_keys=keys))
        assert by_worker(reply) == {("big", 0): (2, 32, 2), ("other", 0): (3, 48, 2)}
        await wait_until_async(lambda: not view.retiring, timeout=5.0)
    assert view.blocks_of(Source("big")) == 2 and view.retired == 0
    assert view.blocks == 4  # the root placeholder and the three blocks still held
    assert len(steps) >= 2 * 200 // 16  # a bounded step per loop turn
