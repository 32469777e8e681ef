"""A worker's reported KV capacity: asked until it answers (a real HTTP server on
127.0.0.1), and the ledger bound made of it (pure)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from cortex.hashing import Engine
from cortex.ingest.capacity import ask_capacity, block_bound
from cortex.registry import WorkerSpec

_SERVER_INFO = {"max_total_num_tokens": 4096, "page_size": 16}


def test_the_bound_adds_the_margin_and_the_configured_tiers() -> None:
    assert block_bound(8192, 0.25, 0) == 10240
    assert block_bound(8192, 0.25, 100_000) == 110240
    assert block_bound(None, 0.25, 100_000) == 0  # unknown: no bound


@pytest.fixture
async def worker() -> AsyncIterator[tuple[str, list[int]]]:
    """An SGLang-like worker whose ``/server_info`` answers the statuses queued in the
    list it yields (then 200); ``/get_server_info`` is 404, as on SGLang >= 0.4.7."""
    statuses: list[int] = []

    async def server_info(_: web.Request) -> web.Response:
        status = statuses.pop(0) if statuses else 200
        return (web.json_response(_SERVER_INFO) if status == 200
                else web.Response(status=status))

    app = web.Application()
    app.router.add_get("/server_info", server_info)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield f"http://127.0.0.1:{port}", statuses
    await runner.cleanup()


async def _ask(url: str, pauses: list[float]) -> int | None:
    async def sleep(seconds: float) -> None:
        pauses.append(seconds)

    spec = WorkerSpec(id="w", url=url, engine=Engine.SGLANG, model="m")
    async with aiohttp.ClientSession() as http:
        return await ask_capacity(http, spec, dict, first_s=0.5, max_s=1.5, sleep=sleep)


async def test_a_worker_answering_5xx_or_401_is_asked_again_with_growing_pauses(
        worker: tuple[str, list[int]]) -> None:
    url, statuses = worker
    statuses.extend([503, 500, 401, 403])
    pauses: list[float] = []
    assert await _ask(url, pauses) == 4096 // 16
    assert pauses == [0.5, 1.0, 1.5, 1.5]  # doubling, capped
    assert statuses == []


async def test_a_worker_not_listening_yet_is_asked_again() -> None:
    async with aiohttp.ClientSession() as http:  # a port nobody listens on, then nothing
        spec = WorkerSpec(id="w", url="http://127.0.0.1:9", engine=Engine.SGLANG, model="m")
        pauses: list[float] = []

        async def sleep(seconds: float) -> None:
            pauses.append(seconds)
            if len(pauses) == 3:
                raise TimeoutError("stop asking")

        with pytest.raises(TimeoutError):
            await ask_capacity(http, spec, dict, first_s=0.1, max_s=10.0, sleep=sleep)
    assert pauses == [0.1, 0.2, 0.4]


async def test_an_answer_that_does_not_say_is_final(worker: tuple[str, list[int]]) -> None:
    url, statuses = worker
    statuses.extend([404])  # /server_info 404, /get_server_info 404: an engine that does not say
    pauses: list[float] = []
    assert await _ask(url, pauses) is None
    assert pauses == []
