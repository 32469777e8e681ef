"""Failures end to end: a worker crash and an index restart, each on a fresh cluster."""

from __future__ import annotations

import time
from collections.abc import Iterator

import aiohttp
import pytest

from cortex.devcluster.cluster import LocalCluster
from cortex.testing import metric_sum, wait_until_async

from .conftest import LEASE_TTL_S, Client, acceptance_spec, chat, long_prompt

pytestmark = pytest.mark.slow


@pytest.fixture
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with LocalCluster(acceptance_spec(), tmp_path_factory.mktemp("cluster")) as c:
        yield c


async def test_a_killed_worker_is_removed_within_the_lease_and_gets_no_request_after(
    cluster: LocalCluster, http: aiohttp.ClientSession,
) -> None:
    client = Client(cluster, http)
    system = long_prompt("crash")
    body = chat(system, "who holds this?")
    victim = (await client.chat(body)).worker
    await client.wait_indexed(body, victim)
    survivor = next(w for w in cluster.workers if w != victim)

    killed_at = time.monotonic()
    cluster.kill_worker(victim)
    # in the window before removal requests still succeed: a failed connect moves on
    during = await client.chat(body)
    assert during.status == 200 and during.worker == survivor

    state = cluster.state()

    async def forgotten_everywhere() -> bool:
        """Out of the gateway's pool, the ingest's sources and the index's ledgers."""
        if victim in await client.workers():
            return False
        async with http.get(state["ingest"]["health_url"]) as resp:
            if f"{victim}#0" in (await resp.json())["sources"]:
                return False
        index = await client.text(state["index"]["metrics_url"])
        return metric_sum(index, "cortex_index_sources", 'state="ready"') == 1

    await wait_until_async(forgotten_everywhere, timeout=LEASE_TTL_S + 5, interval=0.05,
                           what=f"every service to forget {victim}")
    elapsed = time.monotonic() - killed_at
    # the lease was renewed at most one probe interval before the kill; the services poll
    # the registry every lease/4 s, plus scheduling slack on a loaded machine
    assert elapsed <= LEASE_TTL_S + LEASE_TTL_S / 4 + 1.0, elapsed

    metrics_url = cluster.gateway_urls[0] + "/metrics"

    async def errors_to_victim() -> float:
        return metric_sum(await client.text(metrics_url),
                          "cortex_gateway_upstream_errors_total", f'worker="{victim}"')

    errors_before = await errors_to_victim()
    after = [await client.chat(chat(system, f"after {i}")) for i in range(20)]
    assert [r.status for r in after] == [200] * 20
    assert {r.worker for r in after} == {survivor}
    assert await errors_to_victim() == errors_before  # nothing was even attempted
    explained = await client.explain(body)
    assert [c["worker"] for c in explained["candidates"]] == [survivor]


async def test_a_restarted_index_reconverges_without_restarting_anything_else(
    cluster: LocalCluster, http: aiohttp.ClientSession,
) -> None:
    client = Client(cluster, http)
    system = long_prompt("index-restart")
    body = chat(system, "remember me")
    holder = (await client.chat(body)).worker
    await client.wait_indexed(body, holder)
    before = {name: cluster.process(name).pid for name in
              ("redis", "ingest", "gateway-0", *cluster.workers)}
    old_index = cluster.process("index").pid

    cluster.restart_index(wait=False)

    assert cluster.process("index").pid != old_index
    state = cluster.state()
    assert state["index"] is not None
    index_metrics = state["index"]["metrics_url"]

    async def new_index_holds_every_ledger() -> bool:
        try:
            metrics = await client.text(index_metrics)
        except aiohttp.ClientError:
            return False
        return (metric_sum(metrics, "cortex_index_blocks") > 0
                and metric_sum(metrics, "cortex_index_sources", 'state="ready"') == 2)

    # the new index starts empty: the ingest re-sends every ledger, the gateway reconnects
    await wait_until_async(new_index_holds_every_ledger, timeout=20, interval=0.05,
                           what="the restarted index to get both ledgers back")
    cluster.wait_ready(timeout_s=20)
    gateway_metrics = cluster.gateway_urls[0] + "/metrics"

    async def replica_resynced() -> bool:  # a second snapshot: the new index's
        metrics = await client.text(gateway_metrics)
        return metric_sum(metrics, "cortex_gateway_replica_snapshots_total") >= 2

    await wait_until_async(replica_resynced, timeout=20, interval=0.05,
                           what="the gateway's replica to resync from the new index")
    explained = await client.explain(chat(system, "a question never asked"))
    assert explained["match_source"] == "replica"
    assert {c["worker"]: c["index_tokens"] > 0 for c in explained["candidates"]}[holder]
    assert {name: cluster.process(name).pid for name in before} == before
    assert cluster.crashed() == []

    replies = [await client.chat(chat(system, f"after restart {i}")) for i in range(10)]
    assert {r.worker for r in replies} == {holder}
    assert {r.mode for r in replies} == {"exact_kv"}
    assert all(0 < r.hit_tokens <= (r.cached_tokens or 0) for r in replies)



async def test_the_dev_cluster_index_takes_ledger_writes_only_from_its_peers(
    cluster: LocalCluster, http: aiohttp.ClientSession,
) -> None:
    from grpclib.const import Status
    from grpclib.exceptions import GRPCError

    from cortex.hashing import Engine, HashDomain
    from cortex.ledger.client import index_channel
    from cortex.ledger.grpc import read_token
    from cortex.testing.index_sync import LedgerUpdates, SyncSession

    client = Client(cluster, http)
    body = chat(long_prompt("peers"), "who holds this?")
    holder = (await client.chat(body)).worker
    await client.wait_indexed(body, holder)  # ingest's token works
    state = cluster.state()["index"]
    domain = HashDomain(cluster.spec.model, cluster.spec.block_size, Engine.SGLANG)
    channel = index_channel(state["grpc"])
    try:
        forged = LedgerUpdates(holder, domain, epoch=2**62)
        with pytest.raises(GRPCError) as refused:
            async with SyncSession(channel) as session:  # no token: the reported attack
                await session.send([forged.snapshot([], [])])
        assert refused.value.status is Status.UNAUTHENTICATED
        assert read_token(state["token_file"])
    finally:
        channel.close()
    explained = await client.explain(body)  # the holder's real ledger is untouched
    assert {c["worker"]: c["index_tokens"] > 0 for c in explained["candidates"]}[holder]
