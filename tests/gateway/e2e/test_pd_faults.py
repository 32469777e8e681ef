"""PD failure semantics with real sims: a failed leg never leaves the other one hanging.

Before the first byte a failed attempt is retried on a fresh pair; a decode that fails after
the prefill handed the KV over falls back to a regular worker (or a 502 with a stable code);
a leg that hangs is cut at its configured timeout; after the first byte the stream ends with
an SSE error event. Sims whose death matters are real processes, killed with SIGKILL while
the handoff is in flight. Every sim's bootstrap / transfer timeout is 30 s, far above what the
tests wait, so a surviving leg that was not cancelled would show.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from cortex.gateway.config.gateway import HealthConfig, ModelConfig, PDConfig, UpstreamConfig
from cortex.gateway.server import GatewayServer
from cortex.hashing import Engine
from cortex.registry import WorkerSpec
from cortex.registry.spec import WorkerRole
from cortex.sim.config import TimingConfig
from cortex.sim.process import SimProcess
from cortex.sim.server import SimServer
from cortex.testing import wait_until_async

from ..conftest import BLOCK, MODEL, StartGateway, StartSim, spec_of

SIM_TIMEOUT_S = 30.0
FAST = PDConfig(prefill_timeout_s=5.0, decode_timeout_s=5.0, max_attempts=2)
QUIET = HealthConfig(interval_s=60.0, timeout_s=1.0)
WATCH = UpstreamConfig(wedge_after_s=0.3, wedge_probe_timeout_s=0.5)  # a PD window of 0.8 s
"""Probed once at start: HTTP faults armed afterwards hit requests, not health probes."""


def chat(text: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 4,
            **extra}


def inflight(sim: SimServer) -> int:
    """Requests the sim started and has not finished or aborted."""
    s = sim.engine.stats
    return s.requests_started - s.requests_finished - s.requests_failed


async def settled(*sims: SimServer) -> None:
    """Every leg the sims started is over — quickly, not after a 30 s engine timeout."""
    await wait_until_async(lambda: all(inflight(s) == 0 for s in sims), timeout=2.0,
                           what="every PD leg to be finished or aborted")


def models(engine: str) -> tuple[ModelConfig, ...]:
    return (ModelConfig(name=MODEL, block_size=BLOCK, engine=Engine(engine)),)


async def sglang_pair(start_sim: StartSim, prefills: int = 1, decodes: int = 1
                      ) -> tuple[list[SimServer], list[SimServer]]:
    p = [await start_sim(role="prefill", bootstrap_port=0, bootstrap_timeout_s=SIM_TIMEOUT_S)
         for _ in range(prefills)]
    d = [await start_sim(role="decode", transfer_timeout_s=SIM_TIMEOUT_S) for _ in range(decodes)]
    return p, d


def pd_specs(prefill: list[SimServer], decode: list[SimServer]) -> list[WorkerSpec]:
    return ([spec_of(s, f"p{i}", role="prefill", bootstrap_port=s.bootstrap_port)
             for i, s in enumerate(prefill)]
            + [spec_of(s, f"d{i}", role="decode") for i, s in enumerate(decode)])


async def post(http: aiohttp.ClientSession, gw: GatewayServer, body: dict[str, Any]
               ) -> tuple[int, dict[str, str], bytes]:
    async with http.post(gw.url + "/v1/chat/completions", json=body) as resp:
        return resp.status, dict(resp.headers), await resp.read()


async def test_pd_failed_prefill_is_retried_on_a_fresh_pair_and_the_decode_cancelled(
    start_sim: StartSim, start_gateway: StartGateway, http: aiohttp.ClientSession,
) -> None:
    (bad, good), (decode,) = await sglang_pair(start_sim, prefills=2)
    gw = await start_gateway(pd_specs([bad, good], [decode]), pd=FAST, health=QUIET)
    bad.set_faults(error_rate=1.0, error_status=503)
    retried = 0
    for i in range(4):  # equal loads rotate: the failing prefill comes first at least once
        status, headers, _ = await post(http, gw, chat(f"question {i}"))
        assert status == 200 and headers["x-cortex-prefill-worker"] == "p1"
        retried += headers["x-cortex-attempts"] == "2"
    assert retried >= 1
    await settled(good, decode)
    # each failed attempt's decode leg was started, then aborted by the gateway
    assert decode.engine.stats.requests_failed == retried
    metrics = await (await http.get(gw.url + "/metrics")).text()
    assert 'cortex_gateway_pd_handoff_failures_total{engine="sglang",kind="status",' \
           'side="prefill"}' in metrics
    assert 'cortex_gateway_pd_cancelled_legs_total{engine="sglang",side="decode"}' in metrics


async def test_pd_failed_decode_cancels_the_waiting_prefill_and_uses_another_decode(
    start_sim: StartSim, start_gateway: StartGateway, http: aiohttp.ClientSession,
) -> None:
    (prefill,), (bad, good) = await sglang_pair(start_sim, decodes=2)
    gw = await start_gateway(pd_specs([prefill], [bad, good]), pd=FAST, health=QUIET)
    bad.set_faults(error_rate=1.0, error_status=500)
    retried = 0
    for i in range(4):
        status, headers, _ = await post(http, gw, chat(f"question {i}", stream=True))
        assert status == 200 and headers["x-cortex-decode-worker"] == "d1"
        retried += headers["x-cortex-attempts"] == "2"
    assert retried >= 1
    # the prefill of a failed attempt waited for its decode's handshake: it was aborted
    await settled(prefill, good)
    assert prefill.engine.stats.requests_failed == retried


async def test_pd_hung_prefill_is_cut_at_its_timeout_and_nothing_lingers(
    start_sim: StartSim, start_gateway: StartGateway, http: aiohttp.ClientSession,
) -> None:
    (prefill,), (decode,) = await sglang_pair(start_sim)
    pd = PDConfig(prefill_timeout_s=0.5, decode_timeout_s=5.0, max_attempts=1)
    gw = await start_gateway(pd_specs([prefill], [decode]), pd=pd, health=QUIET)
    prefill.set_faults(http_down=True)  # accepts, never answers (a wedged engine)
    started = time.monotonic()
    status, headers, body = await post(http, gw, chat("anyone there?", stream=True))
    elapsed = time.monotonic() - started
    assert status == 504 and 0.5 <= elapsed < 3.0
    assert json.loads(body)["error"]["code"] == "prefill_server_error"
    assert headers["x-cortex-pd"] == "failed"
    assert decode.engine.stats.requests_started == 1
    await settled(decode)  # the decode was waiting for KV: aborted, not left for 30 s


async def test_pd_hung_decode_falls_back_to_a_regular_worker(
    start_sim: StartSim, start_gateway: StartGateway, http: aiohttp.ClientSession,
) -> None:
    (prefill,), (decode,) = await sglang_pair(start_sim)
    regular = await start_sim()
    pd = PDConfig(prefill_timeout_s=5.0, decode_timeout_s=0.5)
    gw = await start_gateway([*pd_specs([prefill], [decode]), spec_of(regular, "r0")], pd=pd,
                             health=QUIET)
    decode.set_faults(http_down=True)
    status, headers, body = await post(http, gw, chat("fall back please"))
    assert status == 200, body
    assert headers["x-cortex-pd"] == "fallback_regular"
    assert headers["x-cortex-assigned-worker"] == "r0"
    assert headers["x-cortex-prefill-worker"] == "none"
    assert json.loads(body)["usage"]["completion_tokens"] == 4
    await settled(prefill, regular)
    metrics = await (await http.get(gw.url + "/metrics")).text()
    assert ('cortex_gateway_pd_fallbacks_total{engine="sglang",reason="decode_failed"} 1.0'
            in metrics)


async def test_pd_client_errors_pass_through_without_retry(
    start_sim: StartSim, start_gateway: StartGateway, http: aiohttp.ClientSession,
) -> None:
    (prefill,), (decode,) = await sglang_pair(start_sim)
    gw = await start_gateway(pd_specs([prefill], [decode]), pd=FAST)
    prefill.set_faults(error_rate=1.0, error_status=422)  # the engine refuses the request
    status, headers, body = await post(http, gw, chat("refused"))
    assert status == 422 and headers["x-cortex-attempts"] == "1"
    error = json.loads(body)["error"]  # relayed in the gateway's OpenAI shape
    assert error["message"] == "injected fault: HTTP 422"
    assert (error["code"], error["type"]) == ("invalid_request", "invalid_request_error")
    prefill.clear_faults()
    await settled(prefill, decode)


async def test_pd_workers_that_are_all_busy_make_a_429_not_a_502(
    start_sim: StartSim, start_gateway: StartGateway, http: aiohttp.ClientSession,
) -> None:
    (prefill,), (decode,) = await sglang_pair(start_sim)
    gw = await start_gateway(pd_specs([prefill], [decode]), pd=FAST)
    prefill.set_faults(error_rate=1.0, error_status=429)
    status, headers, body = await post(http, gw, chat("busy pair"))
    assert (status, json.loads(body)["error"]["code"]) == (429, "rate_limited")
    assert headers["Retry-After"] == "1"
    prefill.clear_faults()
    await settled(prefill, decode)


async def test_pd_decode_breaking_after_the_first_byte_ends_the_stream_with_an_error(
    start_sim: StartSim, start_gateway: StartGateway, http: aiohttp.ClientSession,
) -> None:
    (prefill,), (decode,) = await sglang_pair(start_sim)
    gw = await start_gateway(pd_specs([prefill], [decode]), pd=FAST, health=QUIET)
    decode.set_faults(cut_stream_after=2)
    status, headers, body = await post(http, gw, chat("stream then break", stream=True,
                                                      max_tokens=8))
    assert status == 200 and headers["x-cortex-pd"] == "disaggregated"
    events = [e.removeprefix("data: ") for e in body.decode().split("\n\n") if e.strip()]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "upstream_stream_error"
    assert len(events) >= 4  # what the decode sent before it broke reached the client
    await settled(prefill)


# ---- killed processes ----


SLOW_PREFILL = ("--prefill-overhead-ms", "3000")
COMMON = ("--port", "0", "--kv-events-port", "0", "--block-size", str(BLOCK), "--model", MODEL,
          "--log-level", "warning", "--bootstrap-timeout-s", str(SIM_TIMEOUT_S),
          "--transfer-timeout-s", str(SIM_TIMEOUT_S), "--decode-ms-per-token", "0")


@contextlib.contextmanager
def processes(*argvs: tuple[str, ...]) -> Iterator[list[SimProcess]]:
    with contextlib.ExitStack() as stack:
        procs = [SimProcess(*argv, *COMMON) for argv in argvs]
        for proc in procs:
            stack.callback(proc.close)
            proc.launch()
        for proc in procs:
            proc.wait_ready()
        yield procs


def proc_spec(proc: SimProcess, worker_id: str, role: str) -> WorkerSpec:
    engine = proc.info["engine"]
    return WorkerSpec(id=worker_id, url=proc.url, engine=engine, model=MODEL,
                      role=WorkerRole(role),
                      block_size=BLOCK, bootstrap_port=proc.bootstrap_port
                      if engine == "sglang" and role == "prefill" else None)


async def running(http: aiohttp.ClientSession, proc: SimProcess) -> int:
    async with http.get(proc.url + "/sim/state") as resp:
        state = await resp.json()
        count: int = state["running"] + state["waiting"]
        return count


async def kill_when_busy(http: aiohttp.ClientSession, busy: SimProcess, victim: SimProcess,
                         request: asyncio.Task[tuple[int, dict[str, str], bytes]]) -> float:
    """SIGKILL ``victim`` once ``busy`` runs the request (the handoff is in flight); the
    kill time (monotonic seconds)."""
    async def running_it() -> bool:
        assert not request.done(), "the request ended before the kill"
        return await running(http, busy) > 0

    await wait_until_async(running_it, timeout=10, what=f"{busy} to run the request")
    victim.kill()
    return time.monotonic()


async def idle(http: aiohttp.ClientSession, proc: SimProcess) -> None:
    """``proc`` holds no request any more — well before its 30 s engine timeouts."""
    async def nothing_running() -> bool:
        return await running(http, proc) == 0

    await wait_until_async(nothing_running, timeout=2.0, what=f"{proc} to drop the leg")


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
async def test_pd_prefill_killed_mid_handoff_answers_502_at_once(
    engine: str, start_gateway: StartGateway, http: aiohttp.ClientSession,
) -> None:
    extra = ("--bootstrap-port", "0") if engine == "sglang" else ()
    with processes(("--engine", engine, "--role", "prefill", *SLOW_PREFILL, *extra),
                   ("--engine", engine, "--role", "decode")) as (prefill, decode):
        gw = await start_gateway([proc_spec(prefill, "p0", "prefill"),
                                  proc_spec(decode, "d0", "decode")],
                                 models=models(engine), pd=FAST)
        request = asyncio.create_task(post(http, gw, chat("killed prefill", stream=True)))
        killed_at = await kill_when_busy(http, prefill, prefill, request)
        status, headers, body = await request
        assert time.monotonic() - killed_at < 2.0  # not the 5 s leg timeout, not 30 s
        assert status == 502 and json.loads(body)["error"]["code"] == "prefill_server_error"
        assert headers["x-cortex-pd"] == "failed"
        await idle(http, decode)  # SGLang: it was waiting for the room's KV


@pytest.mark.parametrize(("engine", "stream"), [("sglang", True), ("vllm", False)])
async def test_pd_decode_killed_mid_handoff_falls_back_cold_to_a_regular_worker(
    engine: str, stream: bool, start_sim: StartSim, start_gateway: StartGateway,
    http: aiohttp.ClientSession,
) -> None:
    regular = await start_sim(engine=engine)
    argvs: tuple[tuple[str, ...], ...]
    if engine == "sglang":  # a slow prefill: its decode connected and waits for the KV
        argvs = (("--engine", engine, "--role", "prefill", "--bootstrap-port", "0",
                  *SLOW_PREFILL), ("--engine", engine, "--role", "decode"))
    else:  # the decode got the KV and is slow to its first token
        argvs = (("--engine", engine, "--role", "prefill"),
                 ("--engine", engine, "--role", "decode", *SLOW_PREFILL))
    with processes(*argvs) as (prefill, decode):
        gw = await start_gateway([proc_spec(prefill, "p0", "prefill"),
                                  proc_spec(decode, "d0", "decode"), spec_of(regular, "r0")],
                                 models=models(engine), pd=FAST)
        request = asyncio.create_task(post(http, gw, chat("killed decode", stream=stream)))
        busy = prefill if engine == "sglang" else decode
        killed_at = await kill_when_busy(http, busy, decode, request)
        status, headers, body = await request
        assert time.monotonic() - killed_at < 2.0
        assert status == 200, body
        assert headers["x-cortex-pd"] == "fallback_regular"
        assert headers["x-cortex-assigned-worker"] == "r0"
        assert regular.engine.stats.requests_finished == 1
        if stream:
            assert body.rstrip().endswith(b"data: [DONE]")
        await idle(http, prefill)  # SGLang: cancelled mid-prefill, not left to finish


async def test_pd_vllm_decode_killed_without_regular_workers_is_a_clear_502(
    start_gateway: StartGateway, http: aiohttp.ClientSession,
) -> None:
    with processes(("--engine", "vllm", "--role", "prefill"),
                   ("--engine", "vllm", "--role", "decode", *SLOW_PREFILL)) as (prefill, decode):
        gw = await start_gateway([proc_spec(prefill, "p0", "prefill"),
                                  proc_spec(decode, "d0", "decode")],
                                 models=models("vllm"), pd=FAST)
        request = asyncio.create_task(post(http, gw, chat("nowhere to go")))
        killed_at = await kill_when_busy(http, decode, decode, request)
        status, headers, body = await request
        assert time.monotonic() - killed_at < 2.0
        assert status == 502 and json.loads(body)["error"]["code"] == "decode_server_error"
        # the prefill succeeded and handed its KV over: no second pair is tried
        assert headers["x-cortex-pd"] == "failed"


def wedged(gw: GatewayServer, worker: str) -> float:
    value = gw.gateway.metrics.registry.get_sample_value(
        "cortex_gateway_upstream_wedged_total", {"worker": worker})
    return 0.0 if value is None else value


async def test_pd_wedged_decode_is_found_by_its_flat_counters_and_falls_back(
    start_sim: StartSim, start_gateway: StartGateway, http: aiohttp.ClientSession,
) -> None:
    prefill = await start_sim(engine="vllm", role="prefill")
    decode = await start_sim(engine="vllm", role="decode")
    regular = await start_sim(engine="vllm")
    pd = PDConfig(prefill_timeout_s=30.0, decode_timeout_s=30.0)  # far above the window
    gw = await start_gateway([spec_of(prefill, "p0", role="prefill"),
                              spec_of(decode, "d0", role="decode"), spec_of(regular, "r0")],
                             models=models("vllm"), pd=pd, upstream=WATCH, health=QUIET)
    decode.set_faults(http_down=True)  # its /metrics answers, its counters stay flat
    started = time.monotonic()
    status, headers, body = await post(http, gw, chat("a wedged decode"))
    elapsed = time.monotonic() - started
    assert status == 200, body
    assert headers["x-cortex-pd"] == "fallback_regular"
    assert elapsed < 5.0  # 0.8 s of silence + a 1 s check, not the 30 s leg timeout
    assert wedged(gw, "d0") == 1 and wedged(gw, "p0") == 0


async def test_pd_saturated_decode_is_not_taken_for_a_wedge(
    start_sim: StartSim, start_gateway: StartGateway, http: aiohttp.ClientSession,
) -> None:
    prefill = await start_sim(engine="vllm", role="prefill")
    # one request decodes at a time, 40 ms a token: each 80-token answer takes 3.2 s, twice
    # the window, with no byte for the others meanwhile; the decode's counters move. The
    # window is twice WATCH's: the counters are read by load polls, which a loaded machine
    # delays past 0.8 s
    decode = await start_sim(engine="vllm", role="decode", max_running=1,
                             timing=TimingConfig(prefill_ms_per_uncached_token=0.0,
                                                 prefill_overhead_ms=0.0,
                                                 decode_ms_per_token=40.0))
    # the third answer waits 6.4 s behind the other two and takes 3.2 s itself: the leg
    # timeout must leave room for that on a loaded machine
    pd = dataclasses.replace(FAST, decode_timeout_s=30.0)
    watch = UpstreamConfig(wedge_after_s=0.6, wedge_probe_timeout_s=1.0)  # a window of 1.6 s
    gw = await start_gateway([spec_of(prefill, "p0", role="prefill"),
                              spec_of(decode, "d0", role="decode")],
                             models=models("vllm"), pd=pd, upstream=watch, health=QUIET)
    answers = await asyncio.gather(*(post(http, gw, chat(f"busy {i}", max_tokens=80,
                                                         ignore_eos=True))
                                     for i in range(3)))
    assert [(status, headers["x-cortex-pd"]) for status, headers, _ in answers] == [
        (200, "disaggregated")] * 3
    assert wedged(gw, "d0") == 0 and wedged(gw, "p0") == 0
    assert decode.engine.stats.requests_started == 3
