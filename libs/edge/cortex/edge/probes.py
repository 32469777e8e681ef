"""Blocking health probes and small I/O helpers: HTTP, gRPC health, Redis ``PING``, a port's
availability. Every image's health check (docker/healthcheck.py) runs them, so they live in
the library every service has; the dev-cluster launcher and the benchmarks use them too."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import socket
import urllib.error
import urllib.request
from collections.abc import Coroutine, Mapping
from typing import Any, TypeVar

__all__ = ["bindable", "http_call", "probe_grpc_health", "probe_http", "redis_ping", "run_async"]

T = TypeVar("T")


def probe_http(url: str, timeout: float = 2.0) -> bool:
    """True when ``GET url`` answers 2xx."""
    status, _ = http_call(url, timeout=timeout)
    return status is not None and 200 <= status < 300


def probe_grpc_health(host: str, port: int, service: str = "", timeout: float = 2.0) -> bool:
    """True when the ``grpc.health.v1`` check of ``service`` answers ``SERVING``."""
    return run_async(_grpc_health(host, port, service, timeout))


async def _grpc_health(host: str, port: int, service: str, timeout: float) -> bool:
    from grpclib.client import Channel
    from grpclib.exceptions import GRPCError, StreamTerminatedError
    from grpclib.health.v1.health_grpc import HealthStub
    from grpclib.health.v1.health_pb2 import HealthCheckRequest, HealthCheckResponse

    channel = Channel(host, port)
    try:
        reply = await asyncio.wait_for(
            HealthStub(channel).Check(HealthCheckRequest(service=service)), timeout)
    except (OSError, GRPCError, StreamTerminatedError, TimeoutError):
        return False
    finally:
        channel.close()
    serving: bool = reply.status == HealthCheckResponse.SERVING
    return serving


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to completion on a private loop in a helper thread (works whether or not
    the caller runs an event loop)."""
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="cortex-up") as pool:
        return pool.submit(asyncio.run, coro).result()


def http_call(url: str, method: str = "GET", headers: Mapping[str, str] | None = None,
          timeout: float = 2.0) -> tuple[int | None, Any]:
    """``(status, decoded JSON body or text)``; ``(None, reason)`` when nothing answered."""
    request = urllib.request.Request(url, method=method, headers=dict(headers or {}))
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            status, raw = response.status, response.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
        exc.close()
    except (OSError, urllib.error.URLError) as exc:
        return None, str(exc)
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


def redis_ping(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True
