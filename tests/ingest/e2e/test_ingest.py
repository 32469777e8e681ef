"""End to end: real Redis registry, real ZMQ publishers, real ingest, real index."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from cortex.hashing import Engine
from cortex.ingest.ops import SourceId
from cortex.ingest.service import IngestService
from cortex.ingest.shard import ShardSpec
from cortex.ledger.model import LedgerState
from cortex.ledger.model import LedgerState as IndexState
from cortex.registry import WorkerSpec
from cortex.sim.feed import EngineCache, PublisherConfig, SyntheticPublisher
from cortex.testing import wait_until_async

from ..conftest import Fleet, Rank, Worker, consecutive_ports


def stat(ingest: IngestService, worker_id: str, rank: int = 0) -> object:
    return ingest.trackers[(worker_id, rank)].stats


async def test_mixed_workload_ledger_equals_the_caches(fleet: Fleet) -> None:
    vllm = await fleet.add_worker("vllm-a", Engine.VLLM, block_size=4, capacity=300)
    sglang = await fleet.add_worker("sglang-b", Engine.SGLANG, dp_size=2, block_size=4,
                                    capacity=200, version="0.5.18")  # old replay format
    fleet.traffic(vllm, 50)
    fleet.traffic(sglang, 50)  # published before ingest starts: recovered by replay
    ingest = await fleet.ingest()
    for round_ in range(4):
        fleet.traffic(vllm, 60)
        fleet.traffic(sglang, 60)
        if round_ == 2:
            vllm.ranks[0].publish(vllm.ranks[0].cache.evict(40))
    await fleet.wait_converged(vllm, ingest)
    await fleet.wait_converged(sglang, ingest)
    assert all(t.state is LedgerState.READY for t in ingest.trackers.values())
    for tracker in ingest.trackers.values():
        assert tracker.stats.clears == {}
        assert tracker.stats.unknown_parent_blocks == 0
        assert tracker.stats.blocks["removed"] > 0  # evictions happened


async def test_gaps_are_repaired_by_replay(fleet: Fleet) -> None:
    worker = await fleet.add_worker("w")
    ingest = await fleet.ingest()
    await fleet.wait_converged(worker, ingest)
    rank = worker.ranks[0]
    for _ in range(3):
        fleet.traffic(worker, 10)
        rank.pub.drop_next(4)  # sent to the replay buffer only
        fleet.traffic(worker, 6)
        rank.pub.duplicate_next(2)
        fleet.traffic(worker, 10)
    await fleet.wait_converged(worker, ingest)
    stats = ingest.trackers[SourceId("w", 0)].stats
    assert stats.gaps >= 1
    assert stats.replays.get(("gap", "ok"), 0) >= 1
    assert stats.replays.get(("gap", "incomplete"), 0) == 0
    assert stats.clears == {}
    assert stats.duplicates >= 2


async def test_unrecoverable_gap_clears_then_reconverges(fleet: Fleet) -> None:
    worker = await fleet.add_worker("w")
    ingest = await fleet.ingest()
    fleet.traffic(worker, 30)
    await fleet.wait_converged(worker, ingest)
    rank = worker.ranks[0]
    rank.pub.drop_next(3)
    fleet.traffic(worker, 3)
    rank.pub.forget_buffer()  # the engine's buffer no longer holds the gap
    fleet.traffic(worker, 5)
    stats = ingest.trackers[SourceId("w", 0)].stats
    await wait_until_async(lambda: stats.clears.get("gap_unrepaired", 0) >= 1, timeout=10)
    assert stats.replays.get(("gap", "incomplete"), 0) >= 1
    srv = fleet.index[0]
    # a cleared ledger only under-estimates: never a key the engine does not hold
    await wait_until_async(lambda: ingest.synced, timeout=10)
    assert fleet.keys_in(srv, worker) <= rank.cache.expected_keys("test-model")
    assert ingest.state_of("w") is LedgerState.READY
    rank.publish(rank.cache.clear())  # an engine flush: from here on it converges exactly
    fleet.traffic(worker, 20)
    await fleet.wait_converged(worker, ingest)


async def test_publisher_restart_clears_the_ledger(fleet: Fleet) -> None:
    worker = await fleet.add_worker("w", Engine.SGLANG)
    ingest = await fleet.ingest()
    fleet.traffic(worker, 40)
    await fleet.wait_converged(worker, ingest)
    rank = worker.ranks[0]
    rank.pub.restart()  # new engine process: seq 0, empty cache, AllBlocksCleared first
    rank.cache.clear()
    rank.publish([])  # seq 0 carries nothing...
    fleet.traffic(worker, 5)  # ...then new stores
    stats = ingest.trackers[SourceId("w", 0)].stats
    await wait_until_async(lambda: stats.seq_resets >= 1, timeout=10)
    await fleet.wait_converged(worker, ingest)
    assert stats.clears.get("seq_reset", 0) >= 1


async def test_engine_flush_clears_the_ledger(fleet: Fleet) -> None:
    worker = await fleet.add_worker("w")
    ingest = await fleet.ingest()
    fleet.traffic(worker, 30)
    await fleet.wait_converged(worker, ingest)
    assert fleet.keys_in(fleet.index[0], worker)
    rank = worker.ranks[0]
    rank.publish(rank.cache.clear())
    await fleet.wait_converged(worker, ingest)
    assert fleet.keys_in(fleet.index[0], worker) == set()
    assert ingest.trackers[SourceId("w", 0)].stats.clears == {
        "all_blocks_cleared": 1
    }


async def test_lease_expiry_prunes_the_worker_from_the_index(fleet: Fleet) -> None:
    keep = await fleet.add_worker("keep")
    gone = await fleet.add_worker("gone", ttl_s=1.0)
    ingest = await fleet.ingest()
    fleet.traffic(keep, 10)
    fleet.traffic(gone, 10)
    await fleet.wait_converged(gone, ingest)
    srv = fleet.index[0]
    # nobody renews "gone": its lease expires
    await wait_until_async(lambda: fleet.index_state(srv, "gone") is IndexState.REMOVED,
                           timeout=10, what="gone pruned")
    assert fleet.keys_in(srv, gone) == set()
    assert SourceId("gone", 0) not in ingest.trackers
    await fleet.wait_converged(keep, ingest)


async def test_hostile_payloads_are_counted_and_the_stream_keeps_working(fleet: Fleet) -> None:
    worker = await fleet.add_worker("w", replay=False)
    ingest = await fleet.ingest()
    rank = worker.ranks[0]
    await rank.pub.wait_subscribed()
    rank.pub.send_raw([b"only one frame"])
    rank.pub.send_raw([b"", b"\x00\x01", b"seq frame too short"])
    rank.pub.send_raw([b"", b"\xff" * 8, b"reserved seq"])
    rank.pub.publish_payload(b"\xc1\xc1 not msgpack")  # a real seq with garbage
    rank.pub.publish_payload(b"\x93\x01\x02\x03")  # msgpack, not a batch
    fleet.traffic(worker, 30)
    await fleet.wait_converged(worker, ingest)
    runner = ingest.runners[SourceId("w", 0)]
    assert runner.bad_frames == 3
    assert runner.tracker.stats.decode_errors == 2


async def test_two_shards_split_the_fleet_without_overlap(fleet: Fleet) -> None:
    workers = [await fleet.add_worker(f"gpu-{i}") for i in range(8)]

    one = await fleet.ingest(shard=ShardSpec(0, 2), ingest_id="a")
    two = await fleet.ingest(shard=ShardSpec(1, 2), ingest_id="b")
    for worker in workers:
        fleet.traffic(worker, 10)
    for worker in workers:
        owner = one if worker.id in one.sessions else two
        await fleet.wait_converged(worker, owner)
    assert set(one.sessions).isdisjoint(two.sessions)
    assert set(one.sessions) | set(two.sessions) == {w.id for w in workers}
    assert one.sessions and two.sessions


async def test_dp_ranks_are_separate_sources(fleet: Fleet) -> None:
    worker = await fleet.add_worker("dp", dp_size=3)
    ingest = await fleet.ingest()
    for rank in range(3):
        fleet.traffic(worker, 10 + rank * 5, rank=rank)
    await fleet.wait_converged(worker, ingest)
    sizes = {len(fleet.keys_in(fleet.index[0], worker, rank)) for rank in range(3)}
    assert len(sizes) == 3  # different contents per rank


async def test_block_size_disagreeing_with_the_registry_is_misaligned(fleet: Fleet) -> None:
    worker = await fleet.add_worker("w", block_size=4, registered_block_size=8)
    ingest = await fleet.ingest()
    fleet.traffic(worker, 5)
    srv = fleet.index[0]
    await wait_until_async(lambda: fleet.index_state(srv, "w") is IndexState.MISALIGNED,
                           timeout=10, what="MISALIGNED at the index")
    view = next(v for v in srv.core.workers() if v.source.worker_id == "w")
    assert "events say 4" in view.reason and view.blocks == 0
    assert ingest.state_of("w") is LedgerState.MISALIGNED


async def test_index_down_is_retried_while_others_keep_receiving(fleet: Fleet) -> None:
    from cortex.index.server import IndexServer
    from cortex.testing import free_port

    from ..conftest import index_config

    port = free_port()
    second = IndexServer(index_config(port))
    await second.start()
    fleet.index.append(second)
    worker = await fleet.add_worker("w")
    ingest = await fleet.ingest()
    fleet.traffic(worker, 20)
    await fleet.wait_converged(worker, ingest)
    await second.stop()
    fleet.index.pop()
    fleet.traffic(worker, 20)
    await fleet.wait_converged(worker)  # the first replica keeps receiving
    restarted = await fleet.stack.enter_async_context(IndexServer(index_config(port)))
    fleet.index.append(restarted)
    fleet.traffic(worker, 5)
    await fleet.wait_converged(worker, ingest)  # snapshot on reconnect, then live updates
    forwarder = next(f for f in ingest.forwarders if f.target.port == port)
    assert forwarder.connects >= 2 and forwarder.failures >= 1


async def test_redis_outage_keeps_workers_and_reconciles(fleet: Fleet) -> None:
    stay = await fleet.add_worker("stay")
    ingest = await fleet.ingest(redis_timeout_s=0.3)
    fleet.traffic(stay, 10)
    await fleet.wait_converged(stay, ingest)
    fleet.redis.stop()
    await wait_until_async(lambda: ingest.degraded, timeout=10, what="degraded")
    fleet.traffic(stay, 10)  # still ingesting from the last known registry
    await fleet.wait_converged(stay, ingest)
    fleet.redis.start()  # empty: nothing is persistent
    newcomer = await fleet.add_worker("newcomer")
    await wait_until_async(lambda: not ingest.degraded and "newcomer" in ingest.sessions,
                           timeout=10, what="reconciled")
    assert "stay" not in ingest.sessions  # its entry did not survive the outage
    fleet.traffic(newcomer, 5)
    await fleet.wait_converged(newcomer, ingest)


async def test_metrics_and_health_endpoints(fleet: Fleet) -> None:
    worker = await fleet.add_worker("w")
    ingest = await fleet.ingest(metrics_port=0, metrics_host="127.0.0.1")
    fleet.traffic(worker, 10)
    await fleet.wait_converged(worker, ingest)
    base = f"http://127.0.0.1:{ingest.metrics_port}"
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{base}/metrics") as resp:
            text = await resp.text()
        async with session.get(f"{base}/health/ready") as resp:
            ready = await resp.json()
    assert 'cortex_ingest_blocks_total{dp_rank="0",op="stored",worker="w"}' in text
    assert 'cortex_ingest_source_state{dp_rank="0",state="READY",worker="w"} 1.0' in text
    assert 'cortex_ingest_tier_blocks{dp_rank="0",tier="device",worker="w"}' in text
    assert "cortex_ingest_lag_seconds_bucket" in text
    assert 'cortex_ingest_index_up{index="127.0.0.1:' in text
    assert ready["status"] == "ok" and ready["sources"] == {"w#0": "READY"}
    # the engine's stamp of the last applied batch, exactly (a watcher of the publisher's
    # own stream compares its stamps with it), and the index replica holding all of it
    stamped = 'cortex_ingest_last_batch_timestamp_seconds{dp_rank="0",worker="w"} '
    line = next(row for row in text.splitlines() if row.startswith(stamped))
    assert float(line[len(stamped):]) == ingest.trackers[SourceId("w", 0)].stats.last_batch_ts
    await wait_until_async(lambda: ingest.synced, timeout=10, what="the forwarder idle")
    async with aiohttp.ClientSession() as session, session.get(f"{base}/metrics") as resp:
        text = await resp.text()
    assert 'cortex_ingest_index_idle{index="127.0.0.1:' in text
    assert all(row.endswith(" 1.0") for row in text.splitlines()
               if row.startswith("cortex_ingest_index_idle{"))


async def test_engine_hashes_pass_the_alignment_check(fleet: Fleet) -> None:
    vllm = await fleet.add_worker("v", Engine.VLLM, block_size=16, hashes="engine")
    sglang = await fleet.add_worker("s", Engine.SGLANG, block_size=16, hashes="engine")
    ingest = await fleet.ingest(align_every=1)
    for worker in (vllm, sglang):
        fleet.traffic(worker, 20)
    await fleet.wait_converged(vllm, ingest)
    await fleet.wait_converged(sglang, ingest)
    for source in (SourceId("v", 0), SourceId("s", 0)):
        stats = ingest.trackers[source].stats
        assert stats.alignment_checks > 0
        assert stats.alignment_mismatches == {}
    await asyncio.sleep(0)


async def test_engine_process_restart_on_the_same_ports(fleet: Fleet) -> None:
    worker = await fleet.add_worker("w", Engine.SGLANG)
    ingest = await fleet.ingest()
    fleet.traffic(worker, 40)
    await fleet.wait_converged(worker, ingest)
    rank = worker.ranks[0]
    old = rank.pub
    await old.__aexit__(None, None, None)  # the engine process dies: sockets close
    runner = ingest.runners[SourceId("w", 0)]
    await wait_until_async(lambda: not runner.connected, timeout=10, what="disconnect seen")
    rank.pub = await fleet.stack.enter_async_context(SyntheticPublisher(PublisherConfig(
        engine=Engine.SGLANG, version="0.5.23", pub_port=old.pub_port,
        replay_port=old.replay_port)))
    rank.cache = EngineCache(Engine.SGLANG, 4, 400)
    rank.publish(rank.cache.clear())  # SGLang announces an empty cache at start-up
    fleet.traffic(worker, 20)
    await fleet.wait_converged(worker, ingest)
    stats = runner.tracker.stats
    assert stats.seq_resets >= 1 and runner.connects >= 2


async def test_worker_registered_before_its_engine_is_up(fleet: Fleet) -> None:
    pub_port, replay_port = consecutive_ports(1), consecutive_ports(1)
    spec = WorkerSpec(id="early", url="http://127.0.0.1:8000", engine=Engine.VLLM,
                      model="test-model", kv_events=f"tcp://127.0.0.1:{pub_port}",
                      replay=f"tcp://127.0.0.1:{replay_port}", block_size=4)
    await fleet.registry.register(spec)
    ingest = await fleet.ingest()
    await wait_until_async(lambda: "early" in ingest.sessions, timeout=10)
    assert ingest.state_of("early") is LedgerState.SYNCING  # no stream: nothing confirmed
    pub = await fleet.stack.enter_async_context(SyntheticPublisher(PublisherConfig(
        pub_port=pub_port, replay_port=replay_port)))
    worker = Worker(spec, [Rank(pub, EngineCache(Engine.VLLM, 4, 400))])
    fleet.traffic(worker, 20)  # the first batches may beat the connection: replay covers
    await fleet.wait_converged(worker, ingest)


async def test_a_worker_storing_past_its_reported_capacity_is_bounded(fleet: Fleet) -> None:
    """The capacity is read with the worker's credential, again after a 503 (a worker not
    ready yet); the source past it is refused and shown misbehaving on /metrics."""
    asked: list[str | None] = []

    async def metrics(request: web.Request) -> web.Response:  # a vLLM whose pool holds 8
        asked.append(request.headers.get("Authorization"))
        if len(asked) == 1:
            return web.Response(status=503)
        if request.headers.get("Authorization") != "Bearer k1":  # never: asked again, no bound
            return web.Response(status=401)
        return web.Response(text='vllm:cache_config_info{block_size="4",num_cpu_blocks="None",'
                                 'num_gpu_blocks="8"} 1.0\n')

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    fleet.stack.push_async_callback(runner.cleanup)
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    worker = await fleet.add_worker("w", url=f"http://127.0.0.1:{port}", credential="env:KEY")
    ingest = await fleet.ingest({"KEY": "k1"}, capacity_margin=0.25)
    source = SourceId("w", 0)
    await wait_until_async(lambda: source in ingest.trackers, timeout=10, what="the source")
    tracker = ingest.trackers[source]
    await wait_until_async(lambda: tracker.max_blocks == 10, timeout=10, what="the bound")
    fleet.traffic(worker, 40)
    await wait_until_async(lambda: tracker.misbehaving, timeout=10, what="stores refused")
    await wait_until_async(
        lambda: len(fleet.keys_in(fleet.index[0], worker)) == len(tracker.ledger),
        timeout=10, what="the index follows ingest")
    assert 0 < len(fleet.keys_in(fleet.index[0], worker)) <= 10
    assert tracker.stats.ignored_blocks["over_capacity"] > 0
    assert asked == ["Bearer k1", "Bearer k1"]  # a 503, then the answer: asked no more
    text = ingest.metrics.render().decode()
    assert 'cortex_ingest_source_over_capacity{dp_rank="0",worker="w"} 1.0' in text
    assert 'cortex_ingest_source_block_bound{dp_rank="0",worker="w"} 10.0' in text
