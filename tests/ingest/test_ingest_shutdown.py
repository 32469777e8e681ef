"""The ingest's shutdown path when nothing answers: a worker whose event and replay endpoints
refuse connections or accept them and never speak, and an index that is down or accepts and
never answers. Stopping is prompt and complete — also when the stop itself is cancelled —
leaving no task, ZMQ socket or context, gRPC channel, Redis client or port behind."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import socket
import time
from collections.abc import AsyncIterator

import pytest

from cortex.hashing import Engine
from cortex.ingest.config import IngestConfig
from cortex.ingest.forwarder import ForwarderConfig, ForwarderState, IndexTarget
from cortex.ingest.ops import SourceId
from cortex.ingest.service import IngestService
from cortex.registry import RedisRegistry, WorkerSpec
from cortex.testing import RedisServer, free_port, wait_until_async


@contextlib.asynccontextmanager
async def silent_listener() -> AsyncIterator[int]:
    """A loopback TCP port that accepts connections and never sends a byte."""
    held: list[asyncio.StreamWriter] = []

    async def hold(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        for writer in held:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
        await server.wait_closed()


def port_is_free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


@pytest.mark.parametrize("cancel_stop", [False, True], ids=["stop", "cancelled-stop"])
@pytest.mark.parametrize("peers", ["refused", "silent"])
async def test_stop_is_prompt_and_complete_when_nothing_answers(
    redis_server: RedisServer, peers: str, cancel_stop: bool
) -> None:
    async with contextlib.AsyncExitStack() as stack:
        if peers == "silent":
            events, replay, index = [
                await stack.enter_async_context(silent_listener()) for _ in range(3)
            ]
        else:
            events, replay, index = free_port(), free_port(), free_port()
        async with RedisRegistry(redis_server.url) as registry:
            await registry.register(WorkerSpec(
                id="w", url="http://127.0.0.1:1", engine=Engine.VLLM, model="m",
                kv_events=f"tcp://127.0.0.1:{events}", replay=f"tcp://127.0.0.1:{replay}",
                block_size=4,
            ), ttl_s=60)
        config = IngestConfig(
            index=(IndexTarget("127.0.0.1", index),), redis_url=redis_server.url,
            metrics_host="127.0.0.1", metrics_port=0, poll_interval_s=0.1,
            replay_timeout_s=0.3,
            forwarder=ForwarderConfig(backoff_min_s=0.05, backoff_max_s=0.1,
                                      connect_timeout_s=0.5, heartbeat_s=0.1,
                                      reply_timeout_s=0.5),
        )
        before = asyncio.all_tasks()
        service = IngestService(config)  # owns its Redis client
        await service.__aenter__()
        ctx = service._ctx
        assert ctx is not None and service.metrics_port is not None
        forwarder = service.forwarders[0]
        await wait_until_async(lambda: "w" in service.sessions, timeout=10, what="session")
        await wait_until_async(lambda: forwarder.failures >= 2, timeout=10, what="retries")
        runner = service.runners[SourceId("w", 0)]
        if peers == "silent":  # TCP connects, ZMTP never starts: a replay is tried, times out
            stats = runner.tracker.stats
            await wait_until_async(lambda: sum(stats.replays.values()) >= 1, timeout=10,
                                   what="a replay attempt")
        assert forwarder.state is not ForwarderState.STREAMING

        started = time.monotonic()
        stopping = asyncio.ensure_future(service.__aexit__(None, None, None))
        if cancel_stop:
            await asyncio.sleep(0)  # the stop is under way
            stopping.cancel()
        await asyncio.wait({stopping}, timeout=10)
        assert stopping.done(), "stop hung"
        assert stopping.cancelled() if cancel_stop else stopping.result() is None
        assert time.monotonic() - started < 5

        assert ctx.closed and service._ctx is None
        assert not service.sessions and not service.runners
        assert asyncio.all_tasks() - before == set(), asyncio.all_tasks() - before
        assert forwarder.state is ForwarderState.STOPPED
        assert port_is_free(service.metrics_port)
        gc.collect()  # an unclosed socket / context / transport would warn (an error) now
