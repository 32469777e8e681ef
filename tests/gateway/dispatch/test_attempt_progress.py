"""Wedged-worker detection (cortex.gateway.dispatch.attempt): the bookkeeping with a fake
clock, then real sims on 127.0.0.1 — a wedged worker (generation hangs, probes answer), a
legitimately long non-streamed generation under a short ``wedge_after_s``, and a saturated
worker whose queue outlasts it (busy, not wedged: its token counters move)."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from cortex.gateway.config.gateway import BreakerConfig, UpstreamConfig
from cortex.gateway.dispatch.attempt import ProgressWatch
from cortex.gateway.fleet.pool import CircuitBreaker, WorkerState
from cortex.hashing import Engine
from cortex.registry import WorkerSpec
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


def test_a_worker_whose_engine_works_is_never_a_suspect() -> None:
    clock = Clock()
    watch = ProgressWatch(4.0, 8.0, clock)
    worked: dict[str, float] = {}
    with watch.waiting("w", lambda: pytest.fail("a busy worker failed over")):
        for _ in range(30):  # a 30 s queue: no byte for this attempt, counters moving
            clock.now += 1.0
            worked["w"] = clock.now - 0.5  # the last load poll saw the counters move
            assert watch.check(worked.get).probe == []
        del worked["w"]  # the counters stop: it is a suspect after wedge_after_s
        clock.now += 3.0
        assert watch.check(lambda _: clock.now - 3.5).probe == []
        clock.now += 1.0
        assert watch.check(lambda _: clock.now - 4.5).probe == ["w"]


def test_a_silence_is_probed_only_once_a_poll_has_seen_it() -> None:
    # the gateway's own loop stalled 6 s: every sign it holds is old, the engine's included
    clock = Clock()
    watch = ProgressWatch(4.0, 8.0, clock)
    polled = {"w": clock.now}
    worked = {"w": clock.now}
    with watch.waiting("w", lambda: pytest.fail("failed over")):
        clock.now += 6.0
        assert watch.check(worked.get, polled.get).probe == []  # no poll since the stall
        polled["w"] = clock.now - 0.1  # the first poll after it: the counters moved
        worked["w"] = polled["w"]
        assert watch.check(worked.get, polled.get).probe == []
        clock.now += 4.5
        polled["w"] = clock.now - 0.2  # 4.3 s into the silence, the counters still flat
        assert watch.check(worked.get, polled.get).probe == ["w"]
    with watch.waiting("v", lambda: None):
        polled["v"] = clock.now
        clock.now += 11.0  # polls stopped (nobody polls it any more): 4 s + 8 s waits
        assert watch.check(worked.get, polled.get).probe == []
        clock.now += 1.0
        assert watch.check(worked.get, polled.get).probe == ["v"]


def test_a_probe_that_times_out_while_the_counters_move_is_not_a_wedge() -> None:
    clock = Clock()
    watch = ProgressWatch(4.0, 8.0, clock)
    failed: list[str] = []
    with watch.waiting("w", lambda: failed.append("a")):
        clock.now += 5.0
        assert watch.check(lambda _: None).probe == ["w"]
        watch.probe_started("w")
        assert watch.check(lambda _: None).probe == []  # one probe at a time
        clock.now += 8.0
        # the probe queued behind real work, which the engine did meanwhile
        assert watch.probe_ended("w", False, lambda _: clock.now - 1.0) is None
        assert failed == [] and watch.cleared_busy == 1
        watch.probe_started("w")
        began = clock.now
        clock.now += 8.0
        assert watch.probe_ended("w", False, lambda _: began - 0.1) == 1  # flat: wedged
        assert failed == ["a"] and watch.wedged_total == 1


def test_an_answered_probe_is_progress() -> None:
    clock = Clock()
    watch = ProgressWatch(4.0, 8.0, clock)
    with watch.waiting("w", lambda: pytest.fail("failed over")):
        clock.now += 5.0
        watch.probe_started("w")
        assert watch.probe_ended("w", True, lambda _: None) is None
        assert watch.check(lambda _: None).probe == []


def test_a_pd_leg_fails_when_neither_engine_of_its_pair_works() -> None:
    clock = Clock()
    watch = ProgressWatch(4.0, 8.0, clock)
    failed: list[str] = []
    worked: dict[str, float] = {}
    with watch.waiting("d", lambda: failed.append("decode"), probe=False, partner="p"):
        clock.now += 11.0
        worked["p"] = clock.now  # the prefill computes the prompt the decode waits for
        clock.now += 2.0
        checked = watch.check(worked.get)
        assert checked.probe == [] and checked.wedged == {}  # never probed
        clock.now += 10.0  # 12 s (wedge_after + probe timeout) after the prefill's last work
        assert watch.check(worked.get).wedged == {"d": 1}
        assert failed == ["decode"]
    assert repr(watch).startswith("ProgressWatch(watched=0")


def test_a_pd_leg_that_gets_bytes_or_whose_engine_works_stays() -> None:
    clock = Clock()
    watch = ProgressWatch(4.0, 8.0, clock)
    with watch.waiting("p", lambda: pytest.fail("failed over"), probe=False):
        for _ in range(20):
            clock.now += 1.0
            assert watch.check(lambda _: clock.now - 1.0).wedged == {}
        clock.now += 11.0
        watch.progressed("p")
        clock.now += 11.0
        assert watch.check(lambda _: None).wedged == {}


def test_the_engines_work_mark_moves_worked_at_only_when_it_changes() -> None:
    worker = WorkerState(spec_of_id("w"), CircuitBreaker(BreakerConfig()))
    for poll, (mark, at) in enumerate([((10.0,), 1.0), ((10.0,), 2.0), ((12.0,), 3.0),
                                       ((12.0,), 4.0), (None, 5.0)], start=1):
        worker.load_poll_begun()
        worker.load_polled(poll, 1, 3, at, mark)
    assert worker.worked_at == 3.0 and worker.work == (12.0,)
    assert worker.polled_at == 5.0
    worker.load_poll_failed(worker.load_poll_begun(), 6.0)  # a failed poll still looked
    assert worker.polled_at == 6.0
    worker.load_poll_failed(worker.load_poll_begun() - 1, 7.0)  # overtaken: dropped
    assert worker.polled_at == 6.0


def spec_of_id(worker_id: str) -> WorkerSpec:
    return WorkerSpec(id=worker_id, url="http://127.0.0.1:1", model=MODEL, engine=Engine.VLLM,
                      block_size=16)


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


async def test_a_saturated_worker_is_not_taken_for_a_wedge(
    start_sim: StartSim, start_gateway: StartGateway,
) -> None:
    # one request runs at a time, 20 ms a token: the fourth of four 40-token answers waits
    # 2.4 s in the engine's queue, eight times wedge_after_s, and a probe would queue too
    sim = await start_sim(max_running=1,
                          timing=TimingConfig(prefill_ms_per_uncached_token=0.0,
                                              prefill_overhead_ms=0.0,
                                              decode_ms_per_token=20.0))
    gw = await start_gateway([spec_of(sim, "busy")], upstream=FAST)

    async def one(http: aiohttp.ClientSession) -> int:
        async with http.post(gw.url + "/v1/chat/completions", json=chat(40)) as resp:
            await resp.read()
            return resp.status

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
        statuses = await asyncio.gather(*(one(http) for _ in range(4)))
    assert statuses == [200] * 4
    assert wedged(gw, "busy") == 0
    errors = gw.gateway.metrics.registry.get_sample_value(  # type: ignore[attr-defined]
        "cortex_gateway_upstream_errors_total", {"worker": "busy", "kind": "wedged"})
    assert errors is None
    assert sim.engine.stats.requests_started == 4  # each ran once: no retry, no probe
