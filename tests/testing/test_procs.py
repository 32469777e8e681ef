import socket

import pytest

from cortex.testing import RedisServer, free_port, wait_until


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


def test_free_port_is_bindable() -> None:
    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
