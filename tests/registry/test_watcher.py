"""RegistryWatcher: diffs, channel wake-ups, lease expiry, outage and reconciliation."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import redis.asyncio as aioredis

from cortex.hashing import Engine
from cortex.registry import (
    LeaseKeeper,
    MemoryRegistry,
    RedisRegistry,
    RegistryDiff,
    RegistryHealth,
    RegistryWatcher,
    WorkerSpec,
    diff_specs,
)
from cortex.testing import RedisServer, wait_until_async


def worker(worker_id: str, model: str = "m") -> WorkerSpec:
    return WorkerSpec(id=worker_id, url="http://127.0.0.1:1", engine=Engine.VLLM, model=model)


def test_diff_specs() -> None:
    old = {"a": worker("a"), "b": worker("b")}
    new = {"b": worker("b", model="m2"), "c": worker("c")}
    diff = diff_specs(old, new)
    assert set(diff.added) == {"c"}
    assert set(diff.removed) == {"a"}
    assert diff.changed == {"b": (worker("b"), worker("b", model="m2"))}
    assert not diff_specs(old, dict(old))
    assert "added=['c']" in repr(diff)


async def next_diff(diffs: AsyncIterator[RegistryDiff]) -> RegistryDiff:
    async with asyncio.timeout(10):
        return await anext(diffs)


async def test_memory_registry_diffs_and_degraded() -> None:
    reg = MemoryRegistry()
    await reg.register(worker("a"))
    async with RegistryWatcher(reg, interval_s=0.05) as watcher:
        assert watcher.health is RegistryHealth.OK
        diffs = watcher.diffs()
        assert set((await next_diff(diffs)).added) == {"a"}
        await reg.register(worker("b"))
        assert set((await next_diff(diffs)).added) == {"b"}
        reg.available = False
        await wait_until_async(lambda: watcher.degraded, timeout=5, what="degraded")
        assert set(watcher.workers) == {"a", "b"}  # last known registry kept
        reg.available = True
        await reg.deregister("a")
        diff = await next_diff(diffs)
        assert set(diff.removed) == {"a"}
        assert watcher.health is RegistryHealth.OK


async def test_a_new_tombstone_wakes_waiters_and_is_in_the_view() -> None:
    reg = MemoryRegistry()
    async with RegistryWatcher(reg, interval_s=0.05, use_channel=False) as watcher:
        version = watcher.version
        await reg.remove("gone", reason="by hand")  # no lease: only the tombstone changes
        async with asyncio.timeout(10):
            await watcher.wait_changed(version)
        assert set(watcher.tombstones) == {"gone"}
        assert watcher.tombstones["gone"].reason == "by hand"


async def test_channel_wakes_the_watcher_before_the_poll_interval(
    redis_server: RedisServer,
) -> None:
    async with (
        RedisRegistry(redis_server.url) as reg,
        RegistryWatcher(reg, interval_s=30.0) as watcher,
    ):
        diffs = watcher.diffs()
        client = aioredis.Redis.from_url(redis_server.url)
        try:

            async def subscribed() -> bool:
                counts = await client.pubsub_numsub(reg.channel)
                return bool(counts and counts[0][1] >= 1)

            await wait_until_async(subscribed, timeout=10, what="channel subscription")
        finally:
            await client.aclose()
        await reg.register(worker("a"))
        await wait_until_async(lambda: "a" in watcher.workers, timeout=10, what="wake-up")
        assert set((await next_diff(diffs)).added) == {"a"}


async def test_lease_expiry_is_seen_by_polling(redis_server: RedisServer) -> None:
    async with (
        RedisRegistry(redis_server.url) as reg,
        RegistryWatcher(reg, interval_s=0.1, use_channel=False) as watcher,
    ):
        await reg.register(worker("a"), ttl_s=0.3)
        await wait_until_async(lambda: "a" in watcher.workers, timeout=5)
        await wait_until_async(lambda: "a" not in watcher.workers, timeout=5, what="expiry")


async def test_polls_list_the_registry_only_when_it_changed(redis_server: RedisServer) -> None:
    async with (
        RedisRegistry(redis_server.url) as reg,
        RegistryWatcher(reg, interval_s=0.05, use_channel=False, full_every=1000) as watcher,
    ):
        await reg.register(worker("a"), ttl_s=60)
        await wait_until_async(lambda: "a" in watcher.workers, timeout=5)
        polls, listings, errors = watcher.polls, watcher.listings, watcher.poll_errors

        def relisted() -> int:  # listings beyond those a failed poll calls for
            return watcher.listings - listings - (watcher.poll_errors - errors)

        await wait_until_async(lambda: watcher.polls >= polls + 10, timeout=5, what="polls")
        assert relisted() == 0  # nothing changed: nothing was listed
        await reg.register(worker("b"), ttl_s=60)
        await wait_until_async(lambda: "b" in watcher.workers, timeout=5)
        await reg.renew("b", ttl_s=0.2)
        await wait_until_async(lambda: "b" not in watcher.workers, timeout=5, what="b lapsing")
        assert relisted() == 2


async def test_a_write_that_keeps_no_count_is_seen_by_the_periodic_listing(
    redis_server: RedisServer,
) -> None:
    async with (
        RedisRegistry(redis_server.url) as reg,
        RegistryWatcher(reg, interval_s=0.05, use_channel=False, full_every=5) as watcher,
    ):
        await reg.register(worker("a"), ttl_s=60)
        await wait_until_async(lambda: "a" in watcher.workers, timeout=5)
        client = aioredis.Redis.from_url(redis_server.url)
        try:  # as a release before the change count would write it
            await client.set("cortex:v1:worker:old", worker("old").to_json())
        finally:
            await client.aclose()
        polls = watcher.polls
        await wait_until_async(lambda: "old" in watcher.workers, timeout=5, what="old")
        assert watcher.polls - polls <= 6


async def test_redis_outage_keeps_last_view_then_reconciles(redis_server: RedisServer) -> None:
    async with (
        RedisRegistry(redis_server.url, op_timeout_s=0.5) as reg,
        RegistryWatcher(reg, interval_s=0.1) as watcher,
    ):
        await reg.register(worker("a"), ttl_s=60)
        await reg.register(worker("b"), ttl_s=60)
        await wait_until_async(lambda: set(watcher.workers) == {"a", "b"}, timeout=5)
        redis_server.stop()  # the data is gone too: the server is not persistent
        await wait_until_async(lambda: watcher.degraded, timeout=10, what="degraded")
        assert set(watcher.workers) == {"a", "b"}
        redis_server.start()
        await reg.register(worker("c"), ttl_s=60)
        await wait_until_async(
            lambda: watcher.health is RegistryHealth.OK and set(watcher.workers) == {"c"},
            timeout=10, what="reconciliation",
        )


async def test_lease_keeper_renews_and_deregisters(redis_server: RedisServer) -> None:
    async with RedisRegistry(redis_server.url) as reg:
        async with LeaseKeeper(reg, worker("a"), ttl_s=0.3) as keeper:
            await wait_until_async(lambda: keeper.renewals >= 3, timeout=5, what="renewals")
            assert await reg.get("a") == worker("a")
            await reg.deregister("a")  # e.g. Redis forgot it: the keeper restores it

            async def back() -> bool:
                return await reg.get("a") is not None

            await wait_until_async(back, timeout=5, what="re-registration")
            await reg.remove("a")  # an operator removed it for good: the keeper yields
            await wait_until_async(lambda: keeper.tombstoned, timeout=5, what="tombstone seen")
            assert await reg.get("a") is None
        assert await reg.get("a") is None
