"""Command lines of the peer routers Cortex is compared with."""

from __future__ import annotations

import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from cortex.testing.procs import free_port

__all__ = ["peer_program", "sglang_router_argv", "vllm_router_argv"]


def peer_program(name: str) -> str:
    """``name`` from this interpreter's environment, else from PATH."""
    binary = Path(sys.executable).with_name(name)
    return str(binary) if binary.exists() else (shutil.which(name) or name)


def sglang_router_argv(
    port: int,
    policy: str,
    worker_urls: Sequence[str] = (),
    *,
    pd_args: Sequence[str] | None = None,
    host: str = "127.0.0.1",
    extra: Sequence[str] = (),
) -> list[str]:
    """``sglang-router launch`` on ``host:port`` in front of ``worker_urls``.

    ``pd_args`` replaces ``--worker-urls`` for a PD pool (``--pd-disaggregation
    --prefill URL [BOOTSTRAP_PORT] … --decode URL …``). The router's Prometheus
    exporter gets a free loopback port of its own: its default (29000) would make
    two routers on one machine collide.
    """
    program = peer_program("sglang-router")
    targets = list(pd_args) if pd_args is not None else ["--worker-urls", *worker_urls]
    return [
        program, "launch",
        "--host", host, "--port", str(port),
        "--policy", policy,
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
        "--log-level", "warn",
        *targets,
        *extra,
    ]


def vllm_router_argv(port: int, policy: str, worker_urls: Sequence[str], *,
                     host: str = "127.0.0.1") -> list[str]:
    """``vllm-router`` (the vLLM project's Rust router, PyPI) on ``host:port`` in front of
    ``worker_urls``, its exporter on a free loopback port, defaults otherwise."""
    return [
        peer_program("vllm-router"),
        "--host", host, "--port", str(port),
        "--policy", policy,
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
        "--log-level", "warning",
        "--worker-urls", *worker_urls,
    ]
