"""The inference handler's own pieces, on the event loop alone (ASGI messages by hand):
the request id every answer carries and the race between the exchange and the client
going away. The exchange over HTTP is test_gateway_http's."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from cortex.gateway.api.inference import race_disconnect, request_id_of
from cortex.gateway.http.asgi import Message
from cortex.gateway.http.messages import Request

pytestmark = pytest.mark.timeout(10)


def request(headers: list[tuple[bytes, bytes]]) -> Request:
    async def receive() -> Message:
        raise AssertionError("not read")

    return Request({"method": "POST", "path": "/v1/completions", "headers": headers}, receive)


def test_a_sane_client_request_id_is_kept_else_a_fresh_one_for_the_whole_request() -> None:
    assert request_id_of(request([(b"x-request-id", b"client-7")])) == "client-7"
    for bad in (b"", b"x" * 129, b"bad\x01id"):
        req = request([(b"x-request-id", bad)])
        fresh = request_id_of(req)
        assert len(fresh) == 32 and int(fresh, 16) >= 0
        assert request_id_of(req) == fresh  # asked again: the same id
    assert request_id_of(request([])) != request_id_of(request([]))


class Client:
    """An ASGI ``receive`` that says ``http.disconnect`` once ``leave`` is set."""

    def __init__(self) -> None:
        self.leave = asyncio.Event()

    async def __call__(self) -> Message:
        await self.leave.wait()
        return {"type": "http.disconnect"}


async def test_work_that_ends_first_is_not_a_disconnect() -> None:
    done: list[bool] = []

    async def work() -> None:
        await asyncio.sleep(0)
        done.append(True)

    assert await race_disconnect(Client(), work()) is False
    assert done == [True]


async def test_a_client_leaving_cancels_the_work() -> None:
    client = Client()
    cancelled = asyncio.Event()
    started = asyncio.Event()

    async def work() -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def leave_once_started() -> None:
        await started.wait()
        client.leave.set()

    leaver = asyncio.create_task(leave_once_started())
    assert await race_disconnect(client, work()) is True
    await leaver
    assert cancelled.is_set()
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0  # the cancellation was taken back


async def test_a_client_that_leaves_after_the_last_byte_is_not_gone() -> None:
    # it read [DONE] and closed while the work still did its bookkeeping
    client = Client()
    answered = asyncio.Event()
    booked: list[bool] = []

    async def work() -> None:
        answered.set()
        client.leave.set()
        for _ in range(3):
            await asyncio.sleep(0)  # the disconnect arrives meanwhile
        booked.append(True)

    assert await race_disconnect(client, work(), ended=answered.is_set) is False
    assert booked == [True]
    gone = Client()
    gone.leave.set()
    assert await race_disconnect(gone, asyncio.Event().wait(), ended=lambda: False) is True


async def test_a_cancellation_from_elsewhere_propagates() -> None:
    started = asyncio.Event()

    async def work() -> None:
        started.set()
        await asyncio.Event().wait()

    async def serve() -> Any:
        return await race_disconnect(Client(), work())

    server = asyncio.create_task(serve())
    await started.wait()
    server.cancel()  # the server going away, not the client
    with pytest.raises(asyncio.CancelledError):
        await server
