"""Timeouts that end hangs, against real sims that hang or stall (``cortex.sim`` faults).

A worker that never sends a first byte costs a request its first-byte timeout and one retry
elsewhere; a stream that goes silent ends with an SSE error event and its upstream request
cancelled; workers that all answer 429/503 make the client's answer 429/503, not 502.
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest

from cortex.gateway.config.gateway import BreakerConfig, ModelConfig, UpstreamConfig
from cortex.gateway.server import GatewayServer
from cortex.sim.server import SimServer
from cortex.testing import wait_until_async

from ..conftest import BLOCK, MODEL, StartGateway, StartSim, spec_of

pytestmark = pytest.mark.timeout(60)

TIMEOUT_S = 0.5
FAST = ModelConfig(name=MODEL, block_size=BLOCK, first_byte_timeout_s=TIMEOUT_S,
                   response_timeout_s=TIMEOUT_S, stream_idle_timeout_s=TIMEOUT_S)
"""Per-model timeouts (the upstream defaults stay at 60/300/30 s)."""
PATIENT = BreakerConfig(failures=100)  # the breaker never opens: every request meets the hang


def chat(text: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": text}],
            **extra}


async def metric(http: aiohttp.ClientSession, gw: GatewayServer, prefix: str) -> float:
    async with http.get(gw.url + "/metrics") as resp:
        text = await resp.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(prefix))


async def two_workers(start_sim: StartSim, start_gateway: StartGateway, **sections: Any
                      ) -> tuple[SimServer, SimServer, GatewayServer]:
    hung, good = await start_sim(), await start_sim()
    gw = await start_gateway([spec_of(hung, "hung"), spec_of(good, "good")], models=(FAST,),
                             breaker=PATIENT, **sections)
    return hung, good, gw


@pytest.mark.parametrize("stream", [False, True])
async def test_a_worker_that_never_answers_costs_one_timeout_and_one_retry(
    stream: bool, start_sim: StartSim, start_gateway: StartGateway,
    http: aiohttp.ClientSession,
) -> None:
    hung, _, gw = await two_workers(start_sim, start_gateway)
    hung.set_faults(http_down=True)  # accepts, never answers; its /health still passes
    served: dict[str, int] = {}
    for i in range(6):  # routing alternates new prompts: some try the hung worker first
        async with http.post(gw.url + "/v1/chat/completions",
                             json=chat(f"question {i}", stream=stream)) as resp:
            assert resp.status == 200
            await resp.read()
            attempts = int(resp.headers["x-cortex-attempts"])
            assert resp.headers["x-cortex-assigned-worker"] == "good"
            served[resp.headers["x-request-id"]] = attempts
    assert set(served.values()) <= {1, 2} and 2 in served.values()
    timeouts = await metric(http, gw, 'cortex_gateway_upstream_errors_total{kind="timeout",'
                                      'worker="hung"}')
    assert timeouts == sum(a - 1 for a in served.values())  # each retry: one timeout there
    hung.clear_faults()


async def test_first_byte_timeouts_open_the_breaker(
    start_sim: StartSim, start_gateway: StartGateway, http: aiohttp.ClientSession,
) -> None:
    hung = await start_sim()
    gw = await start_gateway([spec_of(hung, "hung")], models=(FAST,),
                             breaker=BreakerConfig(failures=2, open_s=60),
                             upstream=UpstreamConfig(max_attempts=1))
    hung.set_faults(stall_stream_after=0)  # headers, then silence
    for _ in range(2):
        async with http.post(gw.url + "/v1/chat/completions",
                             json=chat("x", stream=True)) as resp:
            body = await resp.json()
            assert (resp.status, body["error"]["code"]) == (504, "upstream_timeout")
    async with http.get(gw.url + "/health/ready") as resp:
        assert (await resp.json())["workers"]["routable"] == 0  # the breaker is open
    async with http.post(gw.url + "/v1/chat/completions", json=chat("x")) as resp:
        assert resp.status == 503  # not even tried: no client waits on it any more
    hung.clear_faults()


async def test_a_stream_that_stalls_ends_with_an_error_event_and_is_cancelled(
    start_sim: StartSim, start_gateway: StartGateway, http: aiohttp.ClientSession,
) -> None:
    hung, _, gw = await two_workers(start_sim, start_gateway)
    hung.set_faults(stall_stream_after=2)
    for i in range(6):
        async with http.post(gw.url + "/v1/chat/completions",
                             json=chat(f"stream {i}", stream=True, max_tokens=40)) as resp:
            assert resp.status == 200
            events = [e.removeprefix("data: ") for e in (await resp.read()).decode()
                      .split("\n\n") if e.strip()]
            if resp.headers["x-cortex-assigned-worker"] != "hung":
                assert events[-1] == "[DONE]"
                continue
            assert events[-1] == "[DONE]"
            assert json.loads(events[-2])["error"]["code"] == "upstream_timeout"
            assert len(events) >= 3  # what came before the stall reached the client
            break
    else:
        pytest.fail("no stream was routed to the stalling worker")
    # the gateway closed its connection: the stalled engine request lets go
    await wait_until_async(lambda: not hung.engine.running, timeout=10, what="cancelled")
    assert await metric(http, gw, 'cortex_gateway_upstream_errors_total{kind="timeout",'
                                  'worker="hung"}') == 1
    hung.clear_faults()


@pytest.mark.parametrize(("statuses", "expected"), [((429, 429), 429), ((429, 503), 503),
                                                    ((503, 503), 503)])
async def test_workers_that_are_all_busy_make_a_busy_answer_not_a_502(
    statuses: tuple[int, int], expected: int, start_sim: StartSim,
    start_gateway: StartGateway, http: aiohttp.ClientSession,
) -> None:
    sims = [await start_sim() for _ in statuses]
    for sim, status in zip(sims, statuses, strict=True):
        sim.set_faults(error_rate=1.0, error_status=status)
    gw = await start_gateway([spec_of(s, f"w{i}") for i, s in enumerate(sims)],
                             breaker=PATIENT)
    async with http.post(gw.url + "/v1/chat/completions", json=chat("busy?")) as resp:
        body = await resp.json()
        assert resp.status == expected
        assert resp.headers["retry-after"] == "1"
        assert body["error"]["code"] == ("rate_limited" if expected == 429 else "overloaded")
