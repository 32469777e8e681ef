"""Readiness and shutdown of a real ``cortex gateway`` process: not ready first, then drain.

Readiness says whether the process serves, not whether the fleet does; SIGTERM turns it 503
while requests are still served for ``server.drain_delay_s``, then the listener closes and
the streams in flight finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp

from cortex.testing import free_port, wait_until_async

from ..conftest import DECODE_ONLY, MODEL, StartSim, spec_of

DRAIN_DELAY_S = 2.0


@contextlib.contextmanager
def gateway_process(config: dict[str, Any], tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    path = tmp_path / "gateway.json"
    path.write_text(json.dumps(config))
    proc = subprocess.Popen([sys.executable, "-m", "cortex.edge.main", "gateway", "--config",
                             str(path), "--log-format", "json"],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        if proc.stderr is not None:
            proc.stderr.close()


async def get(http: aiohttp.ClientSession, url: str) -> tuple[int, Any]:
    async with http.get(url) as resp:
        return resp.status, await resp.json()


def config_of(workers: list[dict[str, Any]], port: int) -> dict[str, Any]:
    return {"models": [{"name": MODEL, "block_size": 16}],
            "server": {"host": "127.0.0.1", "port": port, "drain_delay_s": DRAIN_DELAY_S,
                       "graceful_timeout_s": 20.0},
            "health": {"interval_s": 0.2, "timeout_s": 1.0},
            "registry": {"poll_interval_s": 0.2}, "workers": workers}


async def test_readiness_is_the_process_and_sigterm_drains_before_closing(
    start_sim: StartSim, http: aiohttp.ClientSession, tmp_path: Path,
) -> None:
    sim = await start_sim(timing=DECODE_ONLY)  # 20 ms a token
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with gateway_process(config_of([spec_of(sim, "w1").to_dict()], port), tmp_path) as proc:
        async def serving() -> bool:
            with contextlib.suppress(aiohttp.ClientError):
                status, body = await get(http, url + "/health/ready")
                return status == 200 and body["workers"]["routable"] == 1
            return False

        await wait_until_async(serving, timeout=30, interval=0.05, what="the gateway ready")
        status, health = await get(http, url + "/health")
        assert status == 200 and health["fleet"] in ("ready", "degraded")

        # a stream that outlives the drain delay: ~150 tokens at 20 ms
        body = {"model": MODEL, "max_tokens": 150, "ignore_eos": True, "stream": True,
                "messages": [{"role": "user", "content": "a long answer please"}]}
        async with http.post(url + "/v1/chat/completions", json=body) as stream:
            assert stream.status == 200
            await stream.content.readline()  # the stream is under way
            proc.send_signal(signal.SIGTERM)

            async def not_ready() -> bool:
                status, ready = await get(http, url + "/health/ready")
                return status == 503 and ready["status"] == "draining"

            await wait_until_async(not_ready, timeout=5, interval=0.02, what="readiness 503")
            # still served while load balancers notice, each answer closing its connection
            async with http.post(url + "/v1/chat/completions", json={
                    "model": MODEL, "max_tokens": 2,
                    "messages": [{"role": "user", "content": "still there?"}]}) as resp:
                assert resp.status == 200 and resp.headers["Connection"] == "close"
            async with http.get(url + "/metrics") as resp:
                assert "cortex_gateway_draining 1.0" in await resp.text()

            async def refused() -> bool:
                try:
                    async with aiohttp.ClientSession() as fresh, fresh.get(url + "/health"):
                        return False
                except aiohttp.ClientError:
                    return True

            await wait_until_async(refused, timeout=DRAIN_DELAY_S + 5, interval=0.05,
                                   what="the listener closed")
            assert proc.poll() is None  # the stream in flight holds the process
            rest = (await stream.read()).decode()
        assert rest.rstrip().endswith("data: [DONE]")
        assert await asyncio.to_thread(proc.wait, 20) == 0


async def test_a_gateway_without_a_routable_worker_stays_ready_and_answers_json_503(
    http: aiohttp.ClientSession, tmp_path: Path,
) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    dead = {"id": "gone", "url": f"http://127.0.0.1:{free_port()}", "engine": "sglang",
            "model": MODEL}
    with gateway_process(config_of([dead], port), tmp_path):
        async def up() -> bool:
            with contextlib.suppress(aiohttp.ClientError):
                return (await get(http, url + "/health/ready"))[0] == 200
            return False

        await wait_until_async(up, timeout=30, interval=0.05, what="the gateway listening")
        status, ready = await get(http, url + "/health/ready")
        assert status == 200 and ready["status"] == ready["fleet"] == "unavailable"
        assert ready["workers"] == {"total": 1, "healthy": 0, "routable": 0}
        async with http.post(url + "/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": "hi"}]}) as resp:
            assert resp.status == 503
            assert (await resp.json())["error"]["code"] == "no_available_worker"
        async with http.get(url + "/metrics") as resp:
            metrics = await resp.text()
        assert "cortex_gateway_ready 0.0" in metrics
        assert "cortex_gateway_routable_workers 0.0" in metrics

