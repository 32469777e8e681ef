"""Connection deadlines and bounds (cortex.gateway.http.admission, .listener) on real
sockets on 127.0.0.1: closed and idle connections give their place back at once or after
``server.header_timeout_s``; one address cannot take every place; oversized headers are 431;
a client that stops reading loses its connection after ``server.write_timeout_s``."""

from __future__ import annotations

import asyncio
import socket
from types import SimpleNamespace

import aiohttp
import pytest
from hypercorn.asyncio.worker_context import EventWrapper
from hypercorn.events import RawData, Updated

from cortex.gateway.config.gateway import ServerConfig, UpstreamConfig
from cortex.gateway.http.admission import ConnectionDeadlines, GuardedConnection, IdleWatch
from cortex.gateway.server import GatewayServer
from cortex.testing import wait_until_async

from ..conftest import MODEL, TOKEN, StartGateway, StartSim, gateway_config, spec_of

pytestmark = pytest.mark.timeout(60)


def server_config(**limits: float) -> ServerConfig:
    return ServerConfig(host="127.0.0.1", port=0, admin_token=TOKEN, graceful_timeout_s=2.0,
                        **limits)  # type: ignore[arg-type]


def metric(gw: GatewayServer, name: str, labels: dict[str, str] | None = None) -> float:
    value = gw.gateway.metrics.registry.get_sample_value(name, labels or {})
    return 0.0 if value is None else value


async def test_a_connection_closed_before_a_request_frees_its_place_at_once(
    start_gateway: StartGateway, http: aiohttp.ClientSession,
) -> None:
    # keep-alive and header deadlines far away: only the peer's close can free the place
    gw = await start_gateway(server=server_config(
        max_connections=5, header_timeout_s=50, keep_alive_timeout_s=50))
    listener = gw.listener
    for _ in range(20):  # four times the cap
        _, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        writer.close()
        await writer.wait_closed()
    await wait_until_async(lambda: listener.open == 0, timeout=5, what="every place back")
    async with http.get(gw.url + "/health/live") as resp:
        assert resp.status == 200
    assert listener.refused == 0


async def test_a_connection_silent_past_the_header_timeout_is_closed_and_counted(
    start_gateway: StartGateway,
) -> None:
    gw = await start_gateway(server=server_config(header_timeout_s=0.3))
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    async with asyncio.timeout(10):
        assert await reader.read() == b""  # closed without an answer
    writer.close()
    await wait_until_async(lambda: gw.listener.open == 0, timeout=5, what="place back")
    assert metric(gw, "cortex_gateway_connections_timed_out_total", {"phase": "header"}) == 1


async def test_a_connection_silent_past_the_read_timeout_is_closed(
    start_gateway: StartGateway,
) -> None:
    # header and keep-alive deadlines far away: only the read timeout can close it
    gw = await start_gateway(
        server=server_config(read_timeout_s=0.5, header_timeout_s=50, keep_alive_timeout_s=50),
        upstream=UpstreamConfig(request_timeout_s=0.2))
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    try:
        writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")  # never finished
        async with asyncio.timeout(10):
            assert await reader.read() == b""
    finally:
        writer.close()
    await wait_until_async(lambda: gw.listener.open == 0, timeout=5, what="place back")


async def test_the_header_timeout_does_not_cut_a_kept_alive_connection(
    start_gateway: StartGateway,
) -> None:
    gw = await start_gateway(server=server_config(header_timeout_s=0.2))
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    request = b"GET /health/live HTTP/1.1\r\nhost: x\r\n\r\n"
    try:
        writer.write(request)
        async with asyncio.timeout(10):
            assert (await reader.readuntil(b"}")).startswith(b"HTTP/1.1 200")
        # idle between requests for five header timeouts: keep-alive applies, no close
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(reader.read(1), 1.0)
        writer.write(request)
        async with asyncio.timeout(10):
            assert (await reader.readuntil(b"}")).startswith(b"HTTP/1.1 200")
    finally:
        writer.close()
    assert metric(gw, "cortex_gateway_connections_timed_out_total", {"phase": "header"}) == 0


async def test_a_kept_alive_connection_idle_past_the_keep_alive_timeout_is_closed(
    start_gateway: StartGateway,
) -> None:
    # the header deadline far away: the keep-alive one, moved at each request, closes it
    gw = await start_gateway(server=server_config(header_timeout_s=50,
                                                  keep_alive_timeout_s=0.3))
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    try:
        for _ in range(3):
            writer.write(b"GET /health/live HTTP/1.1\r\nhost: x\r\n\r\n")
            async with asyncio.timeout(10):
                assert (await reader.readuntil(b"}")).startswith(b"HTTP/1.1 200")
        async with asyncio.timeout(10):
            assert await reader.read() == b""
    finally:
        writer.close()
    await wait_until_async(lambda: gw.listener.open == 0, timeout=5, what="place back")
    assert metric(gw, "cortex_gateway_connections_timed_out_total", {"phase": "header"}) == 0


async def test_the_keep_alive_timeout_does_not_cut_a_request_being_served(
    start_gateway: StartGateway,
) -> None:
    # the request's headers come with the connection: it is busy before its idle watch runs
    gw = await start_gateway(server=server_config(header_timeout_s=50,
                                                  keep_alive_timeout_s=0.2))
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    try:
        writer.write(b"POST /tokenize HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
                     b"\r\ncontent-length: 2\r\n\r\n{")
        # served (its body awaited) for five keep-alive timeouts: no close
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(reader.read(1), 1.0)
        writer.write(b"}")
        async with asyncio.timeout(10):
            assert (await reader.readuntil(b"\r\n")).startswith(b"HTTP/1.1 ")
    finally:
        writer.close()


async def test_a_shutdown_closes_idle_connections_at_once() -> None:
    # keep-alive and grace far longer than the test's bound: only the shutdown can close it
    config = gateway_config([], server=ServerConfig(
        host="127.0.0.1", port=0, admin_token=TOKEN, graceful_timeout_s=50,
        header_timeout_s=50, keep_alive_timeout_s=50))
    async with asyncio.timeout(20):
        gw = GatewayServer(config)
        await gw.__aenter__()
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        try:
            writer.write(b"GET /health/live HTTP/1.1\r\nhost: x\r\n\r\n")
            assert (await reader.readuntil(b"}")).startswith(b"HTTP/1.1 200")
            await gw.__aexit__(None, None, None)  # returns once every connection closed
            assert await reader.read() == b""
        finally:
            writer.close()


async def test_one_address_cannot_take_every_place(
    start_gateway: StartGateway, http: aiohttp.ClientSession,
) -> None:
    gw = await start_gateway(server=server_config(
        max_connections=10, max_connections_per_peer=2))
    held = [await asyncio.open_connection("127.0.0.1", gw.port) for _ in range(2)]
    await wait_until_async(lambda: gw.listener.open == 2, timeout=10, what="two accepted")
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    async with asyncio.timeout(10):
        refused = await reader.read()
    writer.close()
    assert refused.startswith(b"HTTP/1.1 503") and b"client address" in refused
    assert gw.listener.refused_peer == 1 and gw.listener.refused == 0
    assert metric(gw, "cortex_gateway_connections_refused_total", {"bound": "peer"}) == 1
    assert metric(gw, "cortex_gateway_connection_peers") == 1
    for _, w in held:
        w.close()
    await wait_until_async(lambda: gw.listener.open == 0, timeout=10, what="places back")
    async with http.get(gw.url + "/health/live") as resp:
        assert resp.status == 200


async def test_headers_over_the_bound_are_a_431(
    start_gateway: StartGateway, http: aiohttp.ClientSession,
) -> None:
    gw = await start_gateway(server=server_config(max_header_bytes=4096))
    async with http.get(gw.url + "/health/live", headers={"x-big": "a" * 3000}) as resp:
        assert resp.status == 200
    async with http.get(gw.url + "/health/live", headers={"x-big": "a" * 5000}) as resp:
        assert resp.status == 431
        assert (await resp.json())["error"]["code"] == "headers_too_large"
    # one far past the bound arrives in several reads: refused before it is whole
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    writer.write(b"GET /health/live HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 100_000
                 + b"\r\n\r\n")
    async with asyncio.timeout(10):
        answer = await reader.read()
    writer.close()
    assert answer.startswith(b"HTTP/1.1 431")


async def test_a_client_that_stops_reading_loses_its_connection(
    start_sim: StartSim, start_gateway: StartGateway,
) -> None:
    sim = await start_sim()
    gw = await start_gateway([spec_of(sim, "w")], server=server_config(
        write_timeout_s=0.5))
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window
    client.setblocking(False)
    await asyncio.get_running_loop().sock_connect(client, ("127.0.0.1", gw.port))
    body = (b'{"model": "%s", "stream": true, "max_tokens": 100000, "ignore_eos": true, '
            b'"messages": [{"role": "user", "content": "go"}]}' % MODEL.encode())
    client.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                   b"application/json\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
    try:  # then reads nothing
        await wait_until_async(
            lambda: metric(gw, "cortex_gateway_connections_timed_out_total",
                           {"phase": "write"}) == 1, timeout=30, what="the write deadline")
        await wait_until_async(lambda: gw.listener.open == 0, timeout=10, what="place back")
        await wait_until_async(lambda: gw.gateway.admission.active == 0, timeout=10,
                               what="the request ended")
    finally:
        client.close()


class _Transport:
    def __init__(self) -> None:
        self.closing = False
        self.buffered = 0  # bytes the client has not taken
        self.writes: list[bytes] = []

    def get_write_buffer_size(self) -> int:
        return self.buffered

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def is_closing(self) -> bool:
        return self.closing


class _Writer:
    """What GuardedConnection writes through: each ``write`` is one send."""

    def __init__(self) -> None:
        self.transport = _Transport()
        self.sends: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.sends.append(data)


async def test_bytes_written_in_one_turn_of_the_loop_go_out_in_one_send() -> None:
    writer = _Writer()
    deadlines = ConnectionDeadlines(1.0, 1.0, 1.0)
    conn = GuardedConnection(None, asyncio.get_running_loop(), None, None, None, None, writer,
                             deadlines=deadlines, on_timeout=lambda phase: None)
    await conn.protocol_send(RawData(b"HTTP/1.1 200 OK\r\n\r\n"))  # headers
    await conn.protocol_send(RawData(b"data: first\n\n"))  # the first event
    assert writer.sends == []  # not yet: the step goes on
    await asyncio.sleep(0)  # the loop turns: flushed, not held
    assert writer.sends == [b"HTTP/1.1 200 OK\r\n\r\ndata: first\n\n"]
    await conn.protocol_send(RawData(b"data: next\n\n"))
    await asyncio.sleep(0)
    assert writer.sends[1:] == [b"data: next\n\n"]
    await conn.protocol_send(RawData(b"late"))
    writer.transport.closing = True  # the connection closed meanwhile: nothing is written
    await asyncio.sleep(0)
    assert len(writer.sends) == 2


async def test_a_request_that_comes_before_the_idle_watch_runs_gets_no_deadline() -> None:
    # the first request's headers can be read before the idle watch's task first runs
    context = SimpleNamespace(terminated=EventWrapper())
    conn = GuardedConnection(None, asyncio.get_running_loop(), None, context, None, None,
                             _Writer(), deadlines=ConnectionDeadlines(50.0, 0.01, 1.0),
                             on_timeout=lambda phase: None)
    watch = conn.idle_task
    assert isinstance(watch, IdleWatch)
    async with asyncio.TaskGroup() as group:
        await watch.restart(SimpleNamespace(_task_group=group), None)  # a new connection
        await conn.protocol_send(Updated(idle=False))  # its request, before the watch ran
        await wait_until_async(lambda: watch.deadline is not None, timeout=5,
                               what="the watch waits")
        assert watch.deadline is not None and watch.deadline.when() is None
        await watch.restart(SimpleNamespace(_task_group=group), None)  # answered: idle
        assert watch.deadline is not None and watch.deadline.when() is not None
        await watch.end()


async def test_write_now_sends_at_once_joins_a_pending_flush_and_never_waits() -> None:
    writer = _Writer()
    conn = GuardedConnection(None, asyncio.get_running_loop(), None, None, None, None, writer,
                             deadlines=ConnectionDeadlines(1.0, 1.0, 1.0),
                             on_timeout=lambda phase: None)
    transport = writer.transport
    await conn.protocol_send(RawData(b"HTTP/1.1 200 OK\r\n\r\n"))  # headers, this turn
    assert conn.write_now(b"first") and transport.writes == []  # after them, in their flush
    await asyncio.sleep(0)
    assert writer.sends == [b"HTTP/1.1 200 OK\r\n\r\nfirst"]
    assert conn.write_now(b"next") and transport.writes == [b"next"]  # nothing pending
    transport.buffered = 1  # the client is behind: the ASGI send must wait for it
    assert not conn.write_now(b"held")
    transport.buffered, transport.closing = 0, True
    assert not conn.write_now(b"late")
    assert transport.writes == [b"next"] and len(writer.sends) == 1
