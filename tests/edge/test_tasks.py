"""stop_tasks: background tasks never outlive their owner, even when the owner is cancelled."""

from __future__ import annotations

import asyncio

import pytest

from cortex.edge.tasks import stop_tasks


async def spin(turns: int = 5) -> None:
    for _ in range(turns):
        await asyncio.sleep(0)


async def test_waits_for_a_slow_cleanup_even_when_the_caller_is_cancelled() -> None:
    release = asyncio.Event()
    cleaned: list[str] = []

    async def worker(name: str) -> None:
        try:
            await asyncio.Event().wait()
        finally:
            await release.wait()  # e.g. closing a connection takes a round trip
            cleaned.append(name)

    tasks = [asyncio.create_task(worker(n)) for n in ("a", "b")]
    await spin()
    stopper = asyncio.create_task(stop_tasks(tasks))
    await spin()
    stopper.cancel()
    await spin()
    assert not stopper.done() and cleaned == []  # still waiting for both cleanups
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await stopper  # the caller's cancellation, once they are done
    assert sorted(cleaned) == ["a", "b"] and all(t.cancelled() for t in tasks)


async def test_failures_while_stopping_are_retrieved_and_done_tasks_skipped() -> None:
    async def fails_on_cancel() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            raise RuntimeError("cleanup failed")

    async def done() -> None:
        return None

    finished = asyncio.create_task(done())
    await finished
    failing = asyncio.create_task(fails_on_cancel())
    await spin()
    await stop_tasks([finished, failing])  # no error: they were told to stop
    assert isinstance(failing.exception(), RuntimeError)
    await stop_tasks([])
