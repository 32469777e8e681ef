"""HAProxy in front of router replicas: its configuration, and a real one alternating between
two sims on 127.0.0.1 (each answer names the sim that served it)."""

from __future__ import annotations

import itertools
import json
import urllib.request
from pathlib import Path

import pytest

from cortex.bench.routing.balancer import haproxy_binary, haproxy_config, start_haproxy
from cortex.devcluster.supervisor import Supervisor
from cortex.sim.process import started_sims
from cortex.sim.routes import SERVED_BY_HEADER


def test_config_is_round_robin_over_every_backend_on_loopback() -> None:
    text = haproxy_config(4321, ["http://127.0.0.1:1001", "http://127.0.0.1:1002"], 2.5)
    lines = [line.strip() for line in text.splitlines()]
    assert "bind 127.0.0.1:4321" in lines and "balance roundrobin" in lines
    assert "option http-no-delay" in lines and "mode http" in lines
    assert [line for line in lines if line.startswith("server ")] == [
        "server r0 127.0.0.1:1001", "server r1 127.0.0.1:1002"]
    assert "timeout server 2500ms" in lines


def _served_by(url: str) -> str:
    body = json.dumps({"model": "cortex-sim", "prompt": "balanced", "max_tokens": 2}).encode()
    request = urllib.request.Request(url + "/v1/completions", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as resp:
        assert resp.status == 200
        return str(resp.headers[SERVED_BY_HEADER])


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.skipif(haproxy_binary() is None, reason="haproxy not installed (apt-get install"
                    " -y haproxy); the benchmark reports the replica variants as skipped")
def test_haproxy_alternates_between_replicas(tmp_path: Path) -> None:
    argv = ("--engine", "sglang", "--port", "0", "--kv-events-port", "0", "--zero-cost",
            "--log-level", "warning")
    with started_sims(argv, argv) as sims, Supervisor(tmp_path) as supervisor:
        url, child = start_haproxy(supervisor, [s.url for s in sims], tmp_path, timeout_s=10)
        assert child.alive() and url.startswith("http://127.0.0.1:")
        ports = [_served_by(url) for _ in range(6)]
    expected = {str(s.url.rsplit(":", 1)[1]) for s in sims}
    assert set(ports) == expected
    assert all(a != b for a, b in itertools.pairwise(ports))  # strict alternation
