import socket
from pathlib import Path

import pytest

from cortex.testing import RedisServer, free_port, wait_until
from cortex.testing.procs import _port_slice


def test_redis_server_answers_ping_and_stops(redis_server: RedisServer) -> None:
    with socket.create_connection(("127.0.0.1", redis_server.port), timeout=2) as sock:
        sock.sendall(b"PING\r\n")
        assert sock.recv(16) == b"+PONG\r\n"
    assert redis_server.port != 6379
    redis_server.stop()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", redis_server.port), timeout=0.5)


def test_wait_until_times_out_with_a_clear_message() -> None:
    with pytest.raises(TimeoutError, match="the impossible"):
        wait_until(lambda: False, timeout=0.05, what="the impossible")


def test_free_ports_are_bindable_distinct_and_outside_the_ephemeral_range() -> None:
    low, high = (int(v) for v in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    for port in ports:
        assert not low <= port <= high
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_parallel_test_workers_draw_ports_from_disjoint_slices(monkeypatch: pytest.MonkeyPatch
                                                               ) -> None:
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "3")
    slices = []
    for worker in ("gw0", "gw1", "gw2"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        slices.append(set(_port_slice()))
    assert all(slices)
    assert not slices[0] & slices[1] and not slices[1] & slices[2] and not slices[0] & slices[2]
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    assert all(free_port() in slices[1] for _ in range(20))


async def test_serve_app_answers_on_127_0_0_1_and_stops() -> None:
    import aiohttp
    from aiohttp import web

    from cortex.testing import serve_app

    async def hello(_: web.Request) -> web.Response:
        return web.Response(text="hi")

    app = web.Application()
    app.router.add_get("/", hello)
    async with serve_app(app) as url, aiohttp.ClientSession() as http:
        assert url.startswith("http://127.0.0.1:")
        async with http.get(url) as resp:
            assert await resp.text() == "hi"
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=0.5)
