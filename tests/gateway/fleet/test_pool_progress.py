"""Wedged-worker detection (cortex.gateway.fleet.pool): the bookkeeping with a fake
clock, then real sims on 127.0.0.1 — a wedged worker (generation hangs, probes answer) and
a legitimately long non-streamed generation under a short ``wedge_after_s``."""

from __future__ import annotations

import aiohttp
import pytest

from cortex.gateway.config.gateway import UpstreamConfig
from cortex.gateway.fleet.progress import ProgressWatch
from cortex.sim.config import FaultConfig, TimingConfig

from ..conftest import MODEL, StartGateway, StartSim, spec_of

pytestmark = pytest.mark.timeout(60)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_worker_is_suspect_only_when_an_attempt_waited_and_it_sent_nothing() -> None:
    clock = Clock()
    watch = ProgressWatch(4.0, 8.0, clock)
    failed: list[str] = []
    with watch.waiting("w", lambda: failed.append("a")):
        clock.now += 3.9
        assert watch.suspects() == []
        clock.now += 0.2
        assert watch.suspects() == ["w"]
        watch.progressed("w")  # a byte of another request: it generates
        assert watch.suspects() == []
        clock.now += 4.0
        assert watch.suspects() == ["w"]
        assert watch.wedged("w") == 1
        assert failed == ["a"]
        assert watch.suspects() == []  # nothing waits on it any more
    assert repr(watch).startswith("ProgressWatch(watched=0")


def test_a_new_attempt_does_not_inherit_an_old_silence() -> None:
    clock = Clock()
    watch = ProgressWatch(4.0, 8.0, clock)
    with watch.waiting("w", lambda: None):
        clock.now += 10
        with watch.waiting("w", lambda: None):
            assert watch.suspects() == ["w"]  # the first attempt waited long enough
    with watch.waiting("w", lambda: None):
        assert watch.suspects() == []  # the worker's silence began with this attempt


def test_off_when_wedge_after_is_zero() -> None:
    watch = ProgressWatch(0.0, 8.0)
    with watch.waiting("w", lambda: None):
        assert watch.suspects() == []
    assert repr(watch).startswith("ProgressWatch(watched=0")


FAST = UpstreamConfig(wedge_after_s=0.3, wedge_probe_timeout_s=0.5)  # response_timeout 600 s


def chat(max_tokens: int) -> dict[str, object]:
    return {"model": MODEL, "max_tokens": max_tokens, "ignore_eos": True,
            "messages": [{"role": "user", "content": "tell me a long story"}]}


def wedged(gw: object, worker: str) -> float:
    value = gw.gateway.metrics.registry.get_sample_value(  # type: ignore[attr-defined]
        "cortex_gateway_upstream_wedged_total", {"worker": worker})
    return 0.0 if value is None else value


async def test_a_wedged_worker_fails_a_waiting_request_over_in_seconds(
    start_sim: StartSim, start_gateway: StartGateway,
) -> None:
    stuck = await start_sim(faults=FaultConfig(http_down=True))  # health and load answer
    gw = await start_gateway([spec_of(stuck, "stuck")], upstream=FAST)
    timeout = aiohttp.ClientTimeout(total=15)  # far below response_timeout_s (600 s)
    async with aiohttp.ClientSession(timeout=timeout) as http, http.post(
            gw.url + "/v1/chat/completions", json=chat(8)) as resp:
        assert resp.status == 502
    assert wedged(gw, "stuck") == 1


async def test_a_wedged_workers_request_is_retried_on_a_live_one(
    start_sim: StartSim, start_gateway: StartGateway,
) -> None:
    stuck = await start_sim(faults=FaultConfig(http_down=True))
    live = await start_sim()
    gw = await start_gateway([spec_of(stuck, "stuck"), spec_of(live, "live")], upstream=FAST)
    timeout = aiohttp.ClientTimeout(total=15)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        workers = set()
        for _ in range(6):  # some are routed to the stuck one first
            async with http.post(gw.url + "/v1/chat/completions", json=chat(4)) as resp:
                assert resp.status == 200
                workers.add(resp.headers["x-cortex-assigned-worker"])
                await resp.read()
    assert workers == {"live"}
    assert wedged(gw, "stuck") >= 1


async def test_a_long_generation_is_not_taken_for_a_wedge(
    start_sim: StartSim, start_gateway: StartGateway,
) -> None:
    # 20 ms a token: 150 tokens take 3 s, ten times wedge_after_s, with no byte sent
    sim = await start_sim(timing=TimingConfig(prefill_ms_per_uncached_token=0.0,
                                              prefill_overhead_ms=0.0,
                                              decode_ms_per_token=20.0))
    gw = await start_gateway([spec_of(sim, "w")], upstream=FAST)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http, \
            http.post(gw.url + "/v1/chat/completions", json=chat(150)) as resp:
        assert resp.status == 200
        answer = await resp.json()
    assert answer["usage"]["completion_tokens"] == 150
    assert wedged(gw, "w") == 0
