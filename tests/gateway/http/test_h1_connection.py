"""Connection deadlines and bounds (cortex.gateway.http.h1, .listener) on real sockets on
127.0.0.1: closed and idle connections give their place back at once or after
``server.header_timeout_s``; one address cannot take every place; oversized headers are 431;
a client that stops reading loses its connection after ``server.write_timeout_s``."""

from __future__ import annotations

import asyncio
import socket

import aiohttp
import pytest

from cortex.gateway.config.gateway import ServerConfig, UpstreamConfig
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
