"""A real load balancer in front of router replicas: HAProxy from the distribution, round robin.

Operators run several router replicas behind an L7 balancer that knows nothing about
prompts; the benchmark does the same on 127.0.0.1. HAProxy (Debian: ``apt-get install
haproxy``) forwards every request to the next replica in turn and streams responses as they
arrive (``http-no-delay``: no coalescing of small SSE writes). It runs in the foreground
(``-db``) as a child of the benchmark, so it stops with it.
"""

from __future__ import annotations

import functools
import shutil
from collections.abc import Sequence
from pathlib import Path

from cortex.devcluster.cluster import probe_http
from cortex.devcluster.supervisor import Child, ChildExited, Supervisor
from cortex.testing import free_port, wait_until

__all__ = ["HAPROXY_INSTALL", "BalancerMissing", "haproxy_binary", "haproxy_config",
           "start_haproxy"]

HAPROXY_INSTALL = "apt-get install -y haproxy"


class BalancerMissing(RuntimeError):
    """No ``haproxy`` on PATH: the replica variants cannot run (the report says so)."""


def haproxy_binary() -> str | None:
    """The ``haproxy`` program, or ``None`` when it is not installed."""
    return shutil.which("haproxy")


def haproxy_config(port: int, backends: Sequence[str], timeout_s: float) -> str:
    """An HAProxy configuration: ``127.0.0.1:port`` round robin over ``backends``
    (``http://host:port`` URLs); ``timeout_s`` bounds a whole request (s)."""
    servers = [f"    server r{i} {url.removeprefix('http://')}"
               for i, url in enumerate(backends)]
    ms = int(timeout_s * 1000)
    return "\n".join([
        "global", "    maxconn 4096", "",
        "defaults", "    mode http", "    balance roundrobin", "    option http-no-delay",
        "    timeout connect 5s", f"    timeout client {ms}ms", f"    timeout server {ms}ms",
        "",
        "frontend routers", f"    bind 127.0.0.1:{port}", "    default_backend replicas", "",
        "backend replicas", *servers, ""])


def _ready(child: Child, url: str, first: str) -> bool:
    if not child.alive():
        raise ChildExited(f"haproxy exited: {child.log_tail(800)}")
    return probe_http(url + "/v1/models") and probe_http(first + "/v1/models")


def start_haproxy(supervisor: Supervisor, backends: Sequence[str], log_dir: Path,
                  timeout_s: float = 300.0) -> tuple[str, Child]:
    """Start HAProxy in front of ``backends``; its URL and process once it forwards.
    :class:`BalancerMissing` when the program is not installed."""
    binary = haproxy_binary()
    if binary is None:
        raise BalancerMissing(f"haproxy is not installed (Debian: `{HAPROXY_INSTALL}`)")
    port = free_port()
    config = log_dir / "haproxy.cfg"
    config.write_text(haproxy_config(port, backends, timeout_s), encoding="utf-8")
    child = supervisor.start("haproxy", [binary, "-db", "-f", str(config)])
    url = f"http://127.0.0.1:{port}"
    wait_until(functools.partial(_ready, child, url, backends[0]), 30, 0.05, "haproxy")
    return url, child
