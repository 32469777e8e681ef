"""Load shedding and slow clients: admission queue, body deadline, connection cap.

Raw sockets stand in for misbehaving clients; a slow sim keeps requests in service.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from cortex.gateway.config.gateway import (
    AdmissionConfig,
    GatewayConfig,
    ModelConfig,
    ServerConfig,
    UpstreamConfig,
)
from cortex.gateway.errors import ConfigError, ServiceUnavailable
from cortex.gateway.http.messages import Admission
from cortex.testing import wait_until_async

from ..conftest import DECODE_ONLY, MODEL, TOKEN, StartGateway, StartSim, spec_of

pytestmark = pytest.mark.timeout(60)


def chat(text: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], **extra}


async def test_a_full_queue_is_a_429_and_a_long_wait_a_503_both_with_retry_after(
    start_sim: StartSim, start_gateway: StartGateway, http: aiohttp.ClientSession,
) -> None:
    # 20 ms a token: 150 tokens hold the slot 3 s, past the queue's 2 s timeout, which in
    # turn leaves a loaded machine time to send the third request while the second waits
    sim = await start_sim(timing=DECODE_ONLY)
    admission = AdmissionConfig(max_concurrent_requests=1, queue_size=1, queue_timeout_s=2.0,
                                retry_after_s=2)
    gw = await start_gateway([spec_of(sim, "w")], admission=admission)
    slow = asyncio.create_task(http.post(gw.url + "/v1/chat/completions",
                                         json=chat("long", max_tokens=150, ignore_eos=True)))
    await wait_until_async(lambda: gw.gateway.admission.active == 1, timeout=10,
                           what="the slot taken")
    queued = asyncio.create_task(http.post(gw.url + "/v1/chat/completions", json=chat("q")))
    await wait_until_async(lambda: gw.gateway.admission.waiting == 1, timeout=10,
                           what="one request queued")
    async with http.post(gw.url + "/v1/chat/completions", json=chat("one too many")) as resp:
        body = await resp.json()
        assert (resp.status, body["error"]["code"]) == (429, "queue_full")
        assert resp.headers["retry-after"] == "2"
    async with await queued as resp:
        body = await resp.json()
        assert (resp.status, body["error"]["code"]) == (503, "queue_timeout")
        assert resp.headers["retry-after"] == "2"
    async with await slow as resp:
        assert resp.status == 200
    async with http.post(gw.url + "/v1/chat/completions", json=chat("later")) as resp:
        assert resp.status == 200  # the slot came back
    async with http.get(gw.url + "/metrics") as resp:
        text = await resp.text()
    assert 'cortex_gateway_admission_rejected_total{code="queue_full"} 1.0' in text
    assert 'cortex_gateway_admission_rejected_total{code="queue_timeout"} 1.0' in text
    assert ('cortex_gateway_requests_total{endpoint="/v1/chat/completions",model="unknown",'
            'status="429"} 1.0') in text
    assert "cortex_gateway_admission_active 0.0" in text


async def test_a_queued_request_gets_the_slot_in_order_and_cancellation_frees_it() -> None:
    admission = Admission(AdmissionConfig(max_concurrent_requests=1, queue_size=4,
                                          queue_timeout_s=30))
    await admission.acquire()
    order: list[str] = []

    async def waiter(name: str) -> None:
        await admission.acquire()
        order.append(name)

    first = asyncio.create_task(waiter("first"))
    gone = asyncio.create_task(waiter("gone"))
    second = asyncio.create_task(waiter("second"))
    await wait_until_async(lambda: admission.waiting == 3, timeout=5)
    gone.cancel()  # a client that left while queued
    await asyncio.gather(gone, return_exceptions=True)
    admission.release()
    await first
    admission.release()
    await second
    assert order == ["first", "second"]
    admission.release()
    assert (admission.active, admission.waiting) == (0, 0)
    with pytest.raises(ServiceUnavailable):
        full = Admission(AdmissionConfig(max_concurrent_requests=1, queue_size=0))
        await full.acquire()
        await full.acquire()


async def test_a_body_that_never_arrives_is_cut_with_a_408(
    start_gateway: StartGateway,
) -> None:
    server = ServerConfig(host="127.0.0.1", port=0, admin_token=TOKEN, body_timeout_s=0.3)
    gw = await start_gateway([], server=server)
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    try:
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                     b"application/json\r\ncontent-length: 1000\r\n\r\n{\"mod")  # then nothing
        await writer.drain()
        async with asyncio.timeout(10):
            answer = await reader.read()  # until the gateway closes the connection
    finally:
        writer.close()
    assert answer.startswith(b"HTTP/1.1 408")
    assert b"request_timeout" in answer and b"connection: close" in answer.lower()
    assert gw.gateway.admission.active == 0


async def test_connections_over_the_cap_are_refused_at_once(
    start_gateway: StartGateway, http: aiohttp.ClientSession,
) -> None:
    server = ServerConfig(host="127.0.0.1", port=0, admin_token=TOKEN, max_connections=3)
    gw = await start_gateway([], server=server)
    listener = gw.listener
    assert listener is not None
    idle = [await asyncio.open_connection("127.0.0.1", gw.port) for _ in range(3)]
    await wait_until_async(lambda: listener.open == 3, timeout=10, what="three accepted")
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    async with asyncio.timeout(10):
        refused = await reader.read()
    writer.close()
    assert refused.startswith(b"HTTP/1.1 503") and b"retry-after: 1" in refused
    assert listener.refused == 1
    done_reader, done_writer = idle.pop()  # one of them sends a request and is done
    done_writer.write(b"GET /health/live HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
    async with asyncio.timeout(10):
        assert (await done_reader.read()).startswith(b"HTTP/1.1 200")
    done_writer.close()
    await wait_until_async(lambda: listener.open == 2, timeout=10, what="a place freed")
    async with http.get(gw.url + "/health/live") as resp:
        assert resp.status == 200
    for _, w in idle:
        w.close()


def test_read_timeout_must_outlast_the_longest_request() -> None:
    with pytest.raises(ConfigError, match=r"server\.read_timeout_s"):
        GatewayConfig(models=(ModelConfig(name="m"),), server=ServerConfig(read_timeout_s=60),
                      upstream=UpstreamConfig(request_timeout_s=120))


def test_the_gateway_cli_sets_admission_like_sglang_router(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    import argparse

    from cortex.gateway import cli

    seen: dict[str, Any] = {}

    async def serve(config: GatewayConfig, env: dict[str, str],
                    epp: tuple[str, int] | None = None, *_stop: Any) -> None:
        seen["config"], seen["epp"] = config, epp

    monkeypatch.setattr(cli, "_serve", serve)
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    path = tmp_path / "gw.json"
    path.write_text('{"models": [{"name": "m"}]}')
    args = parser.parse_args(["gateway", "--config", str(path), "--max-concurrent-requests",
                              "64", "--queue-size", "8", "--queue-timeout-secs", "5"])
    assert cli.run(args) == 0
    assert seen["config"].admission == AdmissionConfig(max_concurrent_requests=64,
                                                       queue_size=8, queue_timeout_s=5)
    assert seen["epp"] is None
    # the endpoint picker beside it (docs/kubernetes.md)
    args = parser.parse_args(["gateway", "--config", str(path), "--epp-port", "9002"])
    assert cli.run(args) == 0 and seen["epp"] == ("0.0.0.0", 9002)
    args = parser.parse_args(["gateway", "--config", str(path), "--epp-port", "70000"])
    assert cli.run(args) == 2
