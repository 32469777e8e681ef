"""RedisRegistry against a real private redis-server."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

import pytest
import redis.asyncio as aioredis

from cortex.registry import Assertion, RedisRegistry, RegistryUnavailable, WorkerSpec
from cortex.testing import RedisServer, free_port, wait_until_async


def worker(worker_id: str = "w1", **overrides: object) -> WorkerSpec:
    fields: dict[str, object] = {
        "id": worker_id, "url": "http://127.0.0.1:9000", "engine": "sglang", "model": "m",
        "kv_events": "tcp://127.0.0.1:5557",
    }
    fields.update(overrides)
    return WorkerSpec(**fields)  # type: ignore[arg-type]


async def test_register_get_list_ttl_and_deregister(redis_server: RedisServer) -> None:
    async with RedisRegistry(redis_server.url) as reg:
        await reg.register(worker("a"), ttl_s=30)
        await reg.register(worker("b", engine="vllm"), ttl_s=0)
        assert await reg.get("a") == worker("a")
        listing = await reg.list()
        assert set(listing.workers) == {"a", "b"}
        assert 25 < (listing.ttl_s["a"] or 0) <= 30
        assert listing.ttl_s["b"] is None
        assert await reg.deregister("a") is True
        assert await reg.deregister("a") is False
        assert await reg.get("a") is None
        assert await reg.renew("b", ttl_s=5) is True
        assert 0 < ((await reg.list()).ttl_s["b"] or 0) <= 5


async def test_lease_expires_without_renewal(redis_server: RedisServer) -> None:
    async with RedisRegistry(redis_server.url) as reg:
        await reg.register(worker("a"), ttl_s=0.3)
        await reg.register(worker("b"), ttl_s=0.3)

        async def a_gone() -> bool:
            assert await reg.renew("b", ttl_s=0.3)
            return await reg.get("a") is None

        await wait_until_async(a_gone, timeout=5, what="lease of a to expire")
        assert await reg.renew("a") is False
        assert set((await reg.list()).workers) == {"b"}


async def test_invalid_entries_are_skipped_and_reported(redis_server: RedisServer) -> None:
    client = aioredis.Redis.from_url(redis_server.url)
    try:
        await client.set("cortex:v1:worker:junk", b"\xff not json")
        await client.set("cortex:v1:worker:other", worker("someone-else").to_json())
    finally:
        await client.aclose()
    async with RedisRegistry(redis_server.url) as reg:
        await reg.register(worker("good"))
        listing = await reg.list()
        assert set(listing.workers) == {"good"}
        assert set(listing.invalid) == {"junk", "other"}
        assert await reg.get("junk") is None


async def test_namespaces_do_not_mix(redis_server: RedisServer) -> None:
    async with (
        RedisRegistry(redis_server.url) as one,
        RedisRegistry(redis_server.url, namespace="staging:") as two,
    ):
        await one.register(worker("a"))
        assert not (await two.list()).workers


async def test_changes_channel_reports_put_and_del(redis_server: RedisServer) -> None:
    async with RedisRegistry(redis_server.url) as reg:
        seen: list[str] = []
        subscribed = asyncio.Event()

        async def consume() -> None:
            iterator = reg.changes()
            subscribed.set()
            async for worker_id in iterator:
                seen.append(worker_id)

        task = asyncio.create_task(consume())
        await subscribed.wait()

        async def registered() -> bool:
            # the SUBSCRIBE may land after the first publish: register until one is seen
            if not seen:
                await reg.register(worker("a"))
            return bool(seen)

        await wait_until_async(registered, timeout=5, what="a put notification")
        await reg.deregister("a")
        await wait_until_async(lambda: seen[-1:] == ["a"] and len(seen) >= 2, timeout=5)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_reassert_renews_recreates_and_never_overrides_a_tombstone(
    redis_server: RedisServer,
) -> None:
    async with RedisRegistry(redis_server.url) as reg:
        spec = worker("a")
        assert await reg.reassert(spec, ttl_s=30) is Assertion.CREATED
        moved = spec.with_changes(url="http://127.0.0.1:9001")
        assert await reg.reassert(moved, ttl_s=5) is Assertion.RENEWED
        assert await reg.get("a") == spec  # renewal keeps the stored spec
        assert 0 < ((await reg.list()).ttl_s["a"] or 0) <= 5
        assert await reg.reassert(moved, ttl_s=0, replace=True) is Assertion.REPLACED
        assert await reg.get("a") == moved
        assert (await reg.list()).ttl_s["a"] is None

        assert await reg.remove("a", reason="decommissioned") is True
        assert await reg.reassert(spec, ttl_s=30) is Assertion.TOMBSTONED
        assert await reg.reassert(spec, ttl_s=30, replace=True) is Assertion.TOMBSTONED
        listing = await reg.list()
        assert "a" not in listing.workers
        assert listing.tombstones["a"].reason == "decommissioned"
        assert listing.tombstones["a"].ttl_s is None
        assert await reg.remove("never-registered", tombstone_ttl_s=0.3) is False
        await reg.register(spec, ttl_s=30)  # an explicit add clears the tombstone
        assert set((await reg.list()).tombstones) == {"never-registered"}
        assert await reg.reassert(spec, ttl_s=30) is Assertion.RENEWED

        async def stone_expired() -> bool:
            return "never-registered" not in (await reg.list()).tombstones

        await wait_until_async(stone_expired, timeout=5, what="the tombstone's TTL")
        assert await reg.reassert(worker("never-registered")) is Assertion.CREATED


async def test_changed_since_sees_every_write_and_every_lapse_and_nothing_else(
    redis_server: RedisServer,
) -> None:
    async with RedisRegistry(redis_server.url) as reg:
        listing = await reg.list()
        assert not await reg.changed_since(listing)  # an empty registry, read again

        async def changed_by(write: Awaitable[object]) -> bool:
            nonlocal listing
            await write
            moved = await reg.changed_since(listing)
            listing = await reg.list()
            return moved

        assert await changed_by(reg.register(worker("a"), ttl_s=30))
        assert await changed_by(reg.register(worker("b"), ttl_s=30))
        assert not await changed_by(reg.renew("a", ttl_s=20))  # a lease's time only
        assert not await changed_by(reg.reassert(worker("a"), ttl_s=30))  # renewed
        moved = worker("a", url="http://127.0.0.1:9001")
        assert await changed_by(reg.reassert(moved, ttl_s=30, replace=True))
        assert listing.workers["a"] == moved
        assert await changed_by(reg.remove("c", tombstone_ttl_s=30))
        assert await changed_by(reg.deregister("a"))
        assert await changed_by(reg.reassert(worker("a"), ttl_s=30))  # created again
        assert not await reg.changed_since(listing)

        async def lapsed() -> bool:
            return await reg.changed_since(listing)

        await reg.renew("b", ttl_s=0.2)  # b's lease lapses: no write
        await wait_until_async(lapsed, timeout=5, what="b's lapse seen")
        listing = await reg.list()
        assert set(listing.workers) == {"a"}
        client = aioredis.Redis.from_url(redis_server.url)
        try:  # c's tombstone lapses
            await client.pexpire("cortex:v1:tombstone:c", 200)
            await wait_until_async(lapsed, timeout=5, what="c's lapse seen")
            listing = await reg.list()
            assert not listing.tombstones
            # a writer that keeps no count (an older release) is missed here: the
            # watcher's periodic full listing covers it
            await client.set("cortex:v1:worker:d", worker("d").to_json())
        finally:
            await client.aclose()
        assert not await reg.changed_since(listing)
        assert set((await reg.list()).workers) == {"a", "d"}


async def test_a_listing_parses_only_entries_it_has_not_seen(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with RedisRegistry(redis_server.url) as reg:
        for name in ("a", "b", "c"):
            await reg.register(worker(name), ttl_s=30)
        parsed: list[bytes] = []
        from_json = WorkerSpec.from_json
        monkeypatch.setattr(WorkerSpec, "from_json",
                            staticmethod(lambda raw: parsed.append(raw) or from_json(raw)))
        first = await reg.list()
        assert len(parsed) == 3
        await reg.register(worker("b", url="http://127.0.0.1:9009"), ttl_s=30)
        second = await reg.list()
        assert len(parsed) == 4  # only b's new entry
        assert second.workers["a"] is first.workers["a"]
        assert second.workers["b"] == worker("b", url="http://127.0.0.1:9009")


async def test_an_unreadable_tombstone_still_keeps_its_worker_out(
    redis_server: RedisServer,
) -> None:
    client = aioredis.Redis.from_url(redis_server.url)
    try:
        await client.set("cortex:v1:tombstone:w", b"\xff not json")
    finally:
        await client.aclose()
    async with RedisRegistry(redis_server.url) as reg:
        assert (await reg.list()).tombstones["w"].reason == "unreadable tombstone"
        assert await reg.reassert(worker("w")) is Assertion.TOMBSTONED


async def test_reassert_works_after_redis_restarted_empty(redis_server: RedisServer) -> None:
    # the restarted server has no script cache either: the script is loaded again
    async with RedisRegistry(redis_server.url) as reg:
        assert await reg.reassert(worker("a"), ttl_s=30) is Assertion.CREATED
        await asyncio.to_thread(redis_server.stop)
        await asyncio.to_thread(redis_server.start)

        async def recreated() -> bool:
            try:
                return await reg.reassert(worker("a"), ttl_s=30) is Assertion.CREATED
            except RegistryUnavailable:  # the old connection breaks once
                return False

        await wait_until_async(recreated, timeout=5, what="the lease written again")
        assert await reg.get("a") == worker("a")


async def test_unreachable_redis_raises_registry_unavailable() -> None:
    async with RedisRegistry(f"redis://127.0.0.1:{free_port()}/0", op_timeout_s=0.5) as reg:
        with pytest.raises(RegistryUnavailable, match="list failed"):
            await reg.list()
        with pytest.raises(RegistryUnavailable):
            await reg.register(worker())


def test_bad_url_is_registry_unavailable() -> None:
    with pytest.raises(RegistryUnavailable, match="bad redis URL"):
        RedisRegistry("http://not-redis")


def test_repr_hides_password() -> None:
    reg = RedisRegistry("redis://user:secret@127.0.0.1:1/0")
    assert "secret" not in repr(reg)


async def _cancel_after(task: asyncio.Task[object], steps: int) -> bool:
    """Cancel ``task`` after ``steps`` loop iterations; False when it finished first."""
    for _ in range(steps):
        await asyncio.sleep(0)
    if task.done():
        return False
    task.cancel()
    await asyncio.wait({task}, timeout=5)
    assert task.done(), f"cancelled after {steps} steps, still running"
    return True


async def test_a_cancelled_command_is_cancelled_at_every_point(redis_server: RedisServer) -> None:
    # redis-py writes under asyncio.wait_for, which on Python 3.11 swallows a cancellation
    # landing as the write completes: the command returned normally and the caller went on
    # (a watcher stopping hung forever). Every interleaving must end in CancelledError: the
    # write completes within the first few loop iterations; later ones wait for the reply.
    async with RedisRegistry(redis_server.url) as reg:
        await reg.register(worker("a"), ttl_s=30)
        for steps in range(64):
            task: asyncio.Task[object] = asyncio.create_task(reg.get("a"))
            if not await _cancel_after(task, steps):
                break  # answered before the cancel: every later point is past the command
            assert task.cancelled(), f"cancel after {steps} steps was lost: {task.result()!r}"
        assert await reg.get("a") == worker("a")  # the client is still usable


async def test_a_cancelled_channel_reader_ends_at_every_point(redis_server: RedisServer) -> None:
    async with RedisRegistry(redis_server.url) as reg:

        async def read() -> None:
            async for _ in reg.changes():
                pass

        for steps in range(48):
            task: asyncio.Task[object] = asyncio.create_task(read())
            assert await _cancel_after(task, steps)
            assert task.cancelled(), f"cancel after {steps} steps was lost"
