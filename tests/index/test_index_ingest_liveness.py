"""Ingest liveness over real gRPC: the sources of an ingest that is gone (its Sync stream
ended) or silent stop being READY after the grace, are announced on the Changes feed, and
turn READY again on the ingest's snapshots; a reconnect within the grace changes nothing;
two ingests never affect each other."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Callable

import aiohttp
from grpclib.client import Channel

from cortex.hashing import Engine, HashDomain
from cortex.index.config import IndexConfig
from cortex.index.server import IndexServer
from cortex.ledger.client import IndexStub, match_request
from cortex.ledger.codec import pb
from cortex.testing import wait_until_async
from cortex.testing.index_sync import LedgerUpdates, SyncSession

DOMAIN = HashDomain("m", 4, Engine.SGLANG)
ROOT = DOMAIN.root_key()
KEYS = DOMAIN.keys(list(range(12)))
GRACE = 1.5
READY, SYNCING = pb.LEDGER_STATE_READY, pb.LEDGER_STATE_SYNCING


async def states(stub: IndexStub) -> dict[str, tuple[pb.LedgerState, int]]:
    """Per worker: (state, matched blocks) of a Match for KEYS."""
    reply = await stub.match(match_request(DOMAIN.model, block_keys=KEYS))
    return {m.worker_id: (m.state, m.matched_blocks) for m in reply.matches}


async def reasons(stub: IndexStub) -> dict[str, str]:
    return {w.source.worker_id: w.reason for w in (await stub.workers(pb.WorkersRequest())).workers}


async def heartbeat(session: SyncSession, stop: asyncio.Event, every_s: float = 0.1) -> None:
    """What an idle ingest does: an empty batch every ``every_s``."""
    while not stop.is_set():
        await session.send([])
        try:
            async with asyncio.timeout(every_s):
                await stop.wait()
        except TimeoutError:
            pass


async def cleared_feed(stub: IndexStub) -> AsyncGenerator[str, None]:
    """Worker ids the Changes feed announces as cleared / no longer READY."""
    async for batch in stub.changes(pb.ChangesRequest()):
        for source in batch.cleared_sources:
            yield source.worker_id


async def test_a_gone_ingest_loses_credit_after_the_grace_and_regains_it_on_snapshots(
    make_config: Callable[..., IndexConfig],
) -> None:
    async with IndexServer(make_config(ingest_grace_s=GRACE)) as srv:
        channel = Channel("127.0.0.1", srv.port)
        try:
            stub = IndexStub(channel)
            feed = cleared_feed(stub)
            w = LedgerUpdates("w", DOMAIN)
            async with SyncSession(channel, ingest_id="ingest-0") as session:
                await session.send([w.chain_snapshot([(ROOT, KEYS)])])
                ended = time.monotonic()  # before the stream ends: the index hears it later
            # the stream is over: the ingest died (or stopped)
            assert (await states(stub))["w"] == (READY, 3)  # within the grace: still trusted
            announced = asyncio.ensure_future(anext(feed))
            await wait_until_async(
                lambda: srv.core.owners.is_lost("ingest-0"), timeout=GRACE + 10, what="loss"
            )
            assert time.monotonic() - ended >= GRACE  # never before the grace
            assert (await states(stub))["w"] == (SYNCING, 0)
            assert (await reasons(stub))["w"] == "ingest_lost"
            assert await asyncio.wait_for(announced, 10) == "w"  # gateway caches drop it
            # the ingest restarts: a new stream, a snapshot in a new epoch
            async with SyncSession(channel, ingest_id="ingest-0") as session:
                reply = await session.send([w.chain_snapshot([(ROOT, KEYS)], epoch=2)])
                assert reply.resync == []  # the snapshot it owed came with its first batch
                assert (await states(stub))["w"] == (READY, 3)
            async with aiohttp.ClientSession() as http:
                url = f"http://127.0.0.1:{srv.metrics_port}/metrics"
                async with http.get(url) as resp:
                    text = await resp.text()
            assert "cortex_index_ingest_losses_total 1.0" in text
            assert "cortex_index_ingest_lost_sources_total 1.0" in text
            await feed.aclose()
        finally:
            channel.close()


async def test_a_silent_stream_is_a_lost_ingest_until_it_talks_again(
    make_config: Callable[..., IndexConfig],
) -> None:
    async with IndexServer(make_config(ingest_grace_s=GRACE)) as srv:
        channel = Channel("127.0.0.1", srv.port)
        try:
            stub = IndexStub(channel)
            w = LedgerUpdates("w", DOMAIN)
            async with SyncSession(channel, ingest_id="wedged") as session:
                await session.send([w.chain_snapshot([(ROOT, KEYS)])])
                # the stream stays open but nothing arrives (a wedged or partitioned ingest)
                await wait_until_async(
                    lambda: srv.core.owners.is_lost("wedged"), timeout=GRACE + 10, what="loss"
                )
                assert (await states(stub))["w"] == (SYNCING, 0)
                # its next message, even a heartbeat, asks it for the snapshot it owes
                reply = await session.send([])
                assert [(s.worker_id, s.dp_rank) for s in reply.resync] == [("w", 0)]
                # a live update of the old epoch cannot be trusted either: asked again
                reply = await session.send([w.store(KEYS[-1], [5])])
                assert [s.worker_id for s in reply.resync] == ["w"]
                await session.send([w.chain_snapshot([(ROOT, KEYS)], epoch=2)])
                assert (await states(stub))["w"] == (READY, 3)
                assert (await reasons(stub))["w"] == ""
        finally:
            channel.close()


async def test_reconnect_within_the_grace_and_two_ingests_do_not_interfere(
    make_config: Callable[..., IndexConfig],
) -> None:
    async with IndexServer(make_config(ingest_grace_s=GRACE)) as srv:
        channel = Channel("127.0.0.1", srv.port)
        try:
            stub = IndexStub(channel)
            a, b = LedgerUpdates("a", DOMAIN), LedgerUpdates("b", DOMAIN)
            async with SyncSession(channel, ingest_id="shard-a") as session:
                await session.send([a.chain_snapshot([(ROOT, KEYS)])])
            async with SyncSession(channel, ingest_id="shard-b") as session:
                await session.send([b.chain_snapshot([(ROOT, KEYS[:2])])])
            # both streams ended; shard-a reconnects at once (a restart), shard-b never does
            stop = asyncio.Event()
            async with SyncSession(channel, ingest_id="shard-a") as session:
                await session.send([a.chain_snapshot([(ROOT, KEYS)], epoch=2)])
                beats = asyncio.ensure_future(heartbeat(session, stop))
                try:
                    await wait_until_async(
                        lambda: srv.core.owners.is_lost("shard-b"), timeout=GRACE + 10,
                        what="shard-b lost",
                    )
                    # shard-b's grace ran out; shard-a's source never left READY
                    assert await states(stub) == {"a": (READY, 3), "b": (SYNCING, 0)}
                    assert (await reasons(stub))["b"] == "ingest_lost"
                    assert srv.core.owners.lost_ingests == 1
                    assert not srv.core.owners.is_lost("shard-a")
                finally:
                    stop.set()
                    await beats
        finally:
            channel.close()


async def test_grace_zero_keeps_the_old_behaviour(
    make_config: Callable[..., IndexConfig],
) -> None:
    async with IndexServer(make_config(ingest_grace_s=0.0)) as srv:
        channel = Channel("127.0.0.1", srv.port)
        try:
            w = LedgerUpdates("w", DOMAIN)
            async with SyncSession(channel, ingest_id="i") as session:
                await session.send([w.chain_snapshot([(ROOT, KEYS)])])
            assert srv.core.owners.owner(srv.core.workers()[0].source) == "i"
            assert srv.core.owners.next_deadline() is None
            assert (await states(IndexStub(channel)))["w"] == (READY, 3)
        finally:
            channel.close()
