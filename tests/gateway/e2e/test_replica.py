"""The gateway's ledger replica with real processes on 127.0.0.1: an index fed over its Sync
stream (playing ingest), a gateway replicating it, a sim to route to.

Routing reads the replica without any RPC while it is synced; it follows every change; it
degrades to gRPC Match and then load only when the index is gone beyond the grace, says so
in the decision and readiness, and resyncs when the index comes back (also when the gateway
started first); snapshots larger than one message and the index's evictions arrive intact,
and blocks the replica matched survive eviction (least recently *matched*).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from grpclib.client import Channel
from grpclib.server import Server

from cortex.gateway.server import GatewayServer
from cortex.hashing import Engine, HashDomain
from cortex.index.config import IndexConfig as IndexServerConfig
from cortex.index.server import IndexServer
from cortex.index.service import IndexService
from cortex.ledger import cores
from cortex.ledger.client import stream_channel
from cortex.ledger.cores import node_bytes
from cortex.ledger.grpc import LedgerCodec
from cortex.ledger.tree import RadixHashTree
from cortex.testing import free_port, wait_until_async
from cortex.testing.index_sync import LedgerUpdates, SyncSession

from ..conftest import MODEL, TOKEN, StartGateway, StartSim, gateway_index, spec_of

pytestmark = pytest.mark.timeout(60)
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
DOMAIN = HashDomain(MODEL, 16, Engine.SGLANG)


def prompt(tag: int, blocks: int) -> list[int]:
    return [(tag * 7919 + i) % 50_000 + 1 for i in range(blocks * 16 + 1)]


def index_config(port: int = 0, **overrides: Any) -> IndexServerConfig:
    base: dict[str, Any] = {"host": "127.0.0.1", "port": port, "metrics_port": None,
                            "replica_heartbeat_s": 0.1, "resync_retry_s": 0.0}
    base.update(overrides)
    return IndexServerConfig(**base)


@contextlib.asynccontextmanager
async def ingest(index: IndexServer | str, worker: str = "w0", *, frames: bool = False
                 ) -> AsyncIterator[tuple[SyncSession, LedgerUpdates]]:
    """A Sync stream into ``index`` (a server or its target) and an update builder for
    ``worker``'s ledger."""
    channel = stream_channel(index if isinstance(index, str) else index.target, frames=frames)
    try:
        async with SyncSession(channel, ingest_id="test-ingest") as session:
            yield session, LedgerUpdates(worker, DOMAIN)
    finally:
        channel.close()


async def explain(http: aiohttp.ClientSession, gateway: GatewayServer, tokens: list[int]
                  ) -> dict[str, Any]:
    async with http.post(gateway.url + "/admin/explain", headers=ADMIN,
                         json={"model": MODEL, "prompt": tokens, "max_tokens": 1}) as resp:
        assert resp.status == 200, await resp.text()
        result: dict[str, Any] = await resp.json()
        return result


def credit(explained: dict[str, Any], worker: str = "w0") -> int:
    return int(next(c["index_tokens"] for c in explained["candidates"] if c["worker"] == worker))


async def ready(http: aiohttp.ClientSession, gateway: GatewayServer) -> dict[str, Any]:
    async with http.get(gateway.url + "/health/ready") as resp:
        body: dict[str, Any] = await resp.json()
        return body


async def replica_gateway(start_sim: StartSim, start_gateway: StartGateway, target: str,
                          **index: Any) -> GatewayServer:
    sim = await start_sim()
    config = gateway_index(target, replica_touch_interval_s=0.1, **index)
    return await start_gateway([spec_of(sim, "w0")], index=config)


@pytest.mark.parametrize("frames", [True, False], ids=["frames", "grpc"])
async def test_routing_reads_the_replica_without_rpc_and_follows_changes(
    start_sim: StartSim, start_gateway: StartGateway, http: aiohttp.ClientSession,
    monkeypatch: pytest.MonkeyPatch, frames: bool,
) -> None:
    monkeypatch.setattr(RadixHashTree, "sync_clear_max", 4)  # 7 blocks: a large clear
    tokens = prompt(1, 8)
    keys = DOMAIN.keys(tokens)
    async with (IndexServer(index_config()) as index,
                ingest(index, frames=frames) as (session, w0)):
        await session.send([w0.chain_snapshot([(DOMAIN.root_key(), keys)])])
        gateway = await replica_gateway(start_sim, start_gateway, index.target, frames=frames)

        async def credited(tokens_held: int) -> bool:
            found = await explain(http, gateway, tokens)
            return found["match_source"] == "replica" and credit(found) == tokens_held

        await wait_until_async(lambda: credited(128), timeout=10, what="the replica synced")
        await session.send([w0.remove(keys[5:6])])
        await wait_until_async(lambda: credited(80), timeout=5, what="a removal replicated")
        await session.send([w0.clear(), w0.store(DOMAIN.root_key(), keys[:1])])
        await wait_until_async(lambda: credited(16), timeout=5, what="a clear replicated")
        replica = gateway.gateway.replica
        assert replica is not None  # the cleared ledger is swept off in the background
        await wait_until_async(lambda: not replica.replica.view.retiring, timeout=5,
                               what="the replica swept the cleared ledger")
        assert replica.replica.view.blocks == 2 and await credited(16)
        await session.send([w0.set_state(3, "gap")])  # STALE: no credit
        await wait_until_async(lambda: credited(0), timeout=5, what="a state replicated")
        index_metrics = index.metrics.render().decode()
        assert "cortex_index_match_requests_total{" not in index_metrics
        for call in ("Sync", "Replicate"):  # each stream over the transport asked for
            assert (f'cortex_index_frames_calls_total{{method="{call}"}}' in index_metrics
                    ) is frames
        body = await ready(http, gateway)
        assert body["replica"] == "synced" and "no_replica" not in body["degraded"]
        assert body["ledger_core"] == cores.active() == "native"  # the default where built
        async with http.get(gateway.url + "/metrics") as resp:
            assert 'cortex_gateway_ledger_core{core="native"} 1.0' in await resp.text()


async def test_a_removal_reaches_the_replica_without_waiting_for_the_flush_timer(
    start_sim: StartSim, start_gateway: StartGateway, http: aiohttp.ClientSession,
) -> None:
    """Stores may wait for ``replica_flush_s``; a loss may not (an engine's eviction races
    the response it ends, and the next request must not be credited with the block).
    With a flush timer far beyond the test's waits, the removal arrives at once, and the
    store journaled before it with it."""
    tokens = prompt(5, 8)
    keys = DOMAIN.keys(tokens)
    async with IndexServer(index_config(replica_flush_s=60.0)) as index, \
            ingest(index) as (session, w0):
        await session.send([w0.chain_snapshot([(DOMAIN.root_key(), keys[:4])])])
        gateway = await replica_gateway(start_sim, start_gateway, index.target)

        async def credited(tokens_held: int) -> bool:
            found = await explain(http, gateway, tokens)
            return found["match_source"] == "replica" and credit(found) == tokens_held

        await wait_until_async(lambda: credited(64), timeout=10, what="the replica synced")
        await session.send([w0.store(keys[3], keys[4:])])  # journaled; the timer runs
        await session.send([w0.remove(keys[6:7])])
        await wait_until_async(lambda: credited(96), timeout=5,
                               what="the removal (and the store before it) replicated")


async def test_a_gateway_started_before_the_index_syncs_when_it_comes(
    start_sim: StartSim, start_gateway: StartGateway, http: aiohttp.ClientSession,
) -> None:
    port = free_port()
    tokens = prompt(2, 4)
    gateway = await replica_gateway(start_sim, start_gateway, f"127.0.0.1:{port}")
    alone = await explain(http, gateway, tokens)
    assert (alone["match_source"], alone["decision"]["mode"], alone["decision"]["reason"]) == (
        "none", "load_aware", "index_unavailable")
    assert {"no_index", "no_replica"} <= set((await ready(http, gateway))["degraded"])
    async with IndexServer(index_config(port)) as index, ingest(index) as (session, w0):
        await session.send([w0.chain_snapshot([(DOMAIN.root_key(), DOMAIN.keys(tokens))])])

        async def synced() -> bool:
            found = await explain(http, gateway, tokens)
            return found["match_source"] == "replica" and credit(found) == 64

        await wait_until_async(synced, timeout=15, what="the late index replicated")
        assert "no_index" not in (await ready(http, gateway))["degraded"]


async def test_an_index_lost_beyond_the_grace_degrades_then_resyncs(
    start_sim: StartSim, start_gateway: StartGateway, http: aiohttp.ClientSession,
) -> None:
    tokens = prompt(3, 4)
    keys = DOMAIN.keys(tokens)
    port = free_port()
    async with IndexServer(index_config(port)) as index, ingest(index) as (session, w0):
        await session.send([w0.chain_snapshot([(DOMAIN.root_key(), keys)])])
        gateway = await replica_gateway(start_sim, start_gateway, index.target,
                                        replica_grace_s=0.5, retry_after_ms=100.0)

        async def mode(source: str, tokens_held: int) -> bool:
            found = await explain(http, gateway, tokens)
            return found["match_source"] == source and credit(found) == tokens_held

        await wait_until_async(lambda: mode("replica", 64), timeout=10, what="synced")
    # the index is gone: within the grace the last view answers, then nothing does
    await wait_until_async(lambda: mode("none", 0), timeout=5, what="the grace to run out")
    assert "no_index" in (await ready(http, gateway))["degraded"]
    async with IndexServer(index_config(port)) as index:
        # a new, empty index: the replica resyncs to it (no credit) ...
        await wait_until_async(lambda: mode("replica", 0), timeout=10, what="resynced")
        async with ingest(index) as (session, w0):  # ... until ingest re-sends the ledger
            await session.send([w0.chain_snapshot([(DOMAIN.root_key(), keys[:2])],
                                                  epoch=2)])
            await wait_until_async(lambda: mode("replica", 32), timeout=5, what="re-sent")


async def test_a_snapshot_larger_than_one_message_arrives_whole(
    start_sim: StartSim, start_gateway: StartGateway, http: aiohttp.ClientSession,
) -> None:
    tokens = prompt(4, 3000)  # 3,000 blocks: ~60 KiB of columns, in 4 KiB batches
    keys = DOMAIN.keys(tokens)
    async with IndexServer(index_config(replica_chunk_bytes=4096)) as index, \
            ingest(index) as (session, w0):
        await session.send([w0.chain_snapshot([(DOMAIN.root_key(), keys)])])
        gateway = await replica_gateway(start_sim, start_gateway, index.target)

        async def whole() -> bool:
            found = await explain(http, gateway, tokens)
            return found["match_source"] == "replica" and credit(found) == 3000 * 16

        await wait_until_async(whole, timeout=15, what="the big snapshot")
        metrics = index.metrics.render().decode()
        sent = next(float(line.split()[-1]) for line in metrics.splitlines()
                    if line.startswith("cortex_index_replica_snapshot_bytes_total"))
        assert sent > 10 * 4096


async def test_evictions_reach_the_replica_and_matched_blocks_survive_them(
    start_sim: StartSim, start_gateway: StartGateway, http: aiohttp.ClientSession,
) -> None:
    matched, old, new = prompt(5, 40), prompt(6, 40), prompt(7, 40)
    chains = {name: DOMAIN.keys(t) for name, t in (("matched", matched), ("old", old),
                                                    ("new", new))}
    budget = 100 * node_bytes(1)  # room for two 40-block chains (+ root), not three
    async with IndexServer(index_config(memory_budget_bytes=budget, low_watermark=0.9)) \
            as index, ingest(index) as (session, w0):
        root = DOMAIN.root_key()
        # "matched" is stored first: without the gateway's touches it would be evicted first
        await session.send([w0.chain_snapshot([(root, chains["matched"])])])
        await session.send([w0.store(root, chains["old"])])
        gateway = await replica_gateway(start_sim, start_gateway, index.target)
        tree = index.core.trees[DOMAIN]

        async def reported() -> bool:  # the replica matched it and told the index
            found = await explain(http, gateway, matched)
            young = tree.recency_of(chains["matched"][-1]) > tree.recency_of(chains["old"][-1])
            return found["match_source"] == "replica" and credit(found) == 640 and young

        await wait_until_async(reported, timeout=10, what="the touches at the index")
        await session.send([w0.store(root, chains["new"])])  # over the budget: evict

        async def evicted() -> bool:
            by_chain = {n: credit(await explain(http, gateway, t))
                        for n, t in (("matched", matched), ("old", old), ("new", new))}
            return by_chain == {"matched": 640, "old": 0, "new": 640}

        await wait_until_async(evicted, timeout=5, what="the eviction replicated")
        assert index.core.evictions >= 40


async def test_a_guarded_index_replicates_to_the_gateway_holding_its_token(
    tmp_path: Any, start_sim: StartSim, start_gateway: StartGateway,
    http: aiohttp.ClientSession,
) -> None:
    token = tmp_path / "peer.token"
    token.write_text("s3cret-peer-token")
    tokens = prompt(8, 4)
    async with IndexServer(index_config(peer_token_file=str(token))) as index:
        host, _, port = index.target.rpartition(":")
        channel = Channel(host, int(port), codec=LedgerCodec())
        w0 = LedgerUpdates("w0", DOMAIN)
        async with SyncSession(channel, token="s3cret-peer-token") as session:
            await session.send([w0.chain_snapshot([(DOMAIN.root_key(), DOMAIN.keys(tokens))])])
        channel.close()
        trusted = await replica_gateway(start_sim, start_gateway, index.target,
                                        token_file=str(token))
        stranger = await replica_gateway(start_sim, start_gateway, index.target)

        async def synced() -> bool:
            found = await explain(http, trusted, tokens)
            return found["match_source"] == "replica" and credit(found) == 64

        await wait_until_async(synced, timeout=10, what="the trusted gateway's replica")
        body = await ready(http, stranger)
        assert "no_replica" in body["degraded"]
        assert index.tokens.refused > 0



async def test_an_index_that_speaks_only_grpc_is_replicated_over_grpc(
    start_sim: StartSim, start_gateway: StartGateway, http: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # the index's service behind grpclib's own server: HTTP/2 only, as an older index
    # or a proxy that passes nothing else
    index = IndexServer(index_config())
    service = IndexService(index.core, index.config, index.metrics, index.index_id)
    server = Server([service], codec=LedgerCodec())
    port = free_port()
    await server.start("127.0.0.1", port)
    target = f"127.0.0.1:{port}"
    tokens = prompt(9, 4)
    try:
        async with ingest(target) as (session, w0):
            await session.send([w0.chain_snapshot([(DOMAIN.root_key(), DOMAIN.keys(tokens))])])
            gateway = await replica_gateway(start_sim, start_gateway, target)

            async def credited() -> bool:
                found = await explain(http, gateway, tokens)
                return found["match_source"] == "replica" and credit(found) == 64

            await wait_until_async(credited, timeout=10, what="the replica synced over gRPC")
        replica = gateway.gateway.replica
        assert replica is not None and not replica.frames
        assert "does not answer Cortex frames" in caplog.text
    finally:
        server.close()
        await server.wait_closed()
