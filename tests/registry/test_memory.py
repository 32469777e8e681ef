"""MemoryRegistry: lease arithmetic with an injected clock, notifications, outage switch."""

from __future__ import annotations

import asyncio

import pytest

from cortex.hashing import Engine
from cortex.registry import Assertion, MemoryRegistry, RegistryUnavailable, WorkerSpec
from cortex.testing import wait_until_async


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def worker(worker_id: str = "w1") -> WorkerSpec:
    return WorkerSpec(id=worker_id, url="http://h:1", engine=Engine.VLLM, model="m")


async def test_lease_expires_and_renew_extends() -> None:
    clock = Clock()
    reg = MemoryRegistry(default_ttl_s=10, clock=clock)
    await reg.register(worker())
    clock.now += 9
    assert await reg.renew("w1") is True
    clock.now += 9
    assert await reg.get("w1") == worker()
    assert (await reg.list()).ttl_s["w1"] == pytest.approx(1.0)
    clock.now += 2
    assert await reg.get("w1") is None
    assert await reg.renew("w1") is False
    assert not (await reg.list()).workers


async def test_static_entry_never_expires_and_deregister() -> None:
    clock = Clock()
    reg = MemoryRegistry(clock=clock)
    await reg.register(worker(), ttl_s=0)
    clock.now += 1e6
    listing = await reg.list()
    assert listing.ttl_s == {"w1": None}
    assert await reg.deregister("w1") is True
    assert await reg.deregister("w1") is False


async def test_changes_and_unavailable() -> None:
    reg = MemoryRegistry()
    seen: list[str] = []

    async def consume() -> None:
        async for worker_id in reg.changes():
            seen.append(worker_id)

    task = asyncio.create_task(consume())
    await asyncio.sleep(0)  # let the consumer subscribe (one scheduling step, not a delay)
    await reg.register(worker("a"))
    await reg.deregister("a")
    await wait_until_async(lambda: len(seen) >= 2, timeout=5)
    assert seen == ["a", "a"]
    reg.available = False
    with pytest.raises(RegistryUnavailable):
        await reg.list()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_reassert_renews_recreates_and_yields_to_a_tombstone() -> None:
    clock = Clock()
    reg = MemoryRegistry(default_ttl_s=10, clock=clock)
    spec = worker()
    assert await reg.reassert(spec) is Assertion.CREATED
    moved = spec.with_changes(url="http://h:2")
    assert await reg.reassert(moved) is Assertion.RENEWED  # the stored spec wins
    assert await reg.get("w1") == spec
    assert await reg.reassert(moved, replace=True) is Assertion.REPLACED
    assert await reg.get("w1") == moved
    reg.wipe()  # Redis restarted empty
    assert await reg.reassert(spec) is Assertion.CREATED
    assert await reg.remove("w1", reason="decommissioned") is True
    assert await reg.get("w1") is None
    assert await reg.reassert(spec) is Assertion.TOMBSTONED
    assert await reg.reassert(spec, replace=True) is Assertion.TOMBSTONED
    listing = await reg.list()
    assert not listing.workers
    assert listing.tombstones["w1"].reason == "decommissioned"
    assert listing.tombstones["w1"].ttl_s is None
    await reg.register(spec)  # an operator adds it again: the tombstone goes
    assert not (await reg.list()).tombstones
    assert await reg.reassert(spec) is Assertion.RENEWED


async def test_a_tombstone_with_a_ttl_expires_and_a_lapsed_worker_can_be_removed() -> None:
    clock = Clock()
    reg = MemoryRegistry(default_ttl_s=10, clock=clock)
    assert await reg.remove("gone", tombstone_ttl_s=60) is False  # no lease: still kept out
    assert await reg.reassert(worker("gone")) is Assertion.TOMBSTONED
    assert (await reg.list()).tombstones["gone"].ttl_s == pytest.approx(60)
    clock.now += 61
    assert await reg.reassert(worker("gone")) is Assertion.CREATED
    with pytest.raises(ValueError, match="tombstone_ttl_s"):
        await reg.remove("gone", tombstone_ttl_s=0)
