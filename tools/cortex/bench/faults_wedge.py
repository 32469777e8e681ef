"""The wedge watch against busy and wedged workers, for ``cortex bench faults``.

Each case runs on a gateway of its own (started in this process, on the bench's loop, beside
the cluster) over simulated workers with the default timing (5 ms a token) and the gateway's
default ``upstream.wedge_after_s`` 4 s / ``wedge_probe_timeout_s`` 8 s and load poll 0.5 s:

- :class:`SaturatedWorkers` (vLLM and SGLang): two workers that run at most 2 requests each
  (the sim's ``max_running`` fault) get 16 non-streamed 1,000-token requests at once: 5 s
  each, so the last ones wait 15 s in the engine's queue, past ``wedge_after_s`` + the probe
  timeout, with no byte for them — a probe would queue behind them too. The engines'
  counters move, so nothing may be failed over (``wedged`` failures, wedges detected, and
  requests the sims saw beyond the 16 — a probe or a retry — must all be 0). The vLLM case
  then runs the same burst as a control, on fresh sims behind a gateway whose load poll is
  off (``load.poll_interval_s`` 0: no work mark, the probe alone decides — the watch as it
  was before the progress signal).
- :class:`WedgedPDDecode` (vLLM): a prefill, two decodes, one regular worker; one decode's
  generation hangs while its ``/metrics`` answers (``http_down``). A PD leg cannot be probed,
  so its engine's flat counters alone must fail it within ``wedge_after_s`` + the probe
  timeout (+ a 1 s check), far below ``pd.decode_timeout_s`` (300 s), and the request be
  answered by the cold fallback.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from typing import Any

import aiohttp

from cortex.bench.faults_catalogue import Bench, Fault
from cortex.bench.faults_hostile import metric_sum
from cortex.bench.faults_load import MODEL
from cortex.gateway import (
    GatewayConfig,
    GatewayServer,
    HealthConfig,
    LoadConfig,
    ModelConfig,
    ServerConfig,
)
from cortex.hashing import Engine
from cortex.registry import WorkerSpec
from cortex.registry.spec import WorkerRole
from cortex.sim.config import FaultConfig, Role, SimConfig
from cortex.sim.server import SimServer
from cortex.testing import wait_until_async

__all__ = ["WEDGE", "SaturatedWorkers", "WedgedPDDecode"]

_BLOCK = 16


class _SideCluster(Fault):
    """Sims (``(role, faults)`` each) behind a gateway of this case's own."""

    hold = "none"
    engine = Engine.VLLM

    def workers(self) -> list[tuple[WorkerRole, FaultConfig]]:
        raise NotImplementedError

    def inject(self, b: Bench) -> None:
        self.stack = contextlib.AsyncExitStack()
        self.url = b.loop.call(self._start(LoadConfig()), timeout_s=60)
        self.run(b)

    def run(self, b: Bench) -> None:
        raise NotImplementedError

    def repair(self, b: Bench) -> None:
        b.loop.call(self.stack.aclose(), timeout_s=60)

    async def _start(self, load: LoadConfig) -> str:
        specs = []
        self.sims: dict[str, SimServer] = {}
        for i, (role, faults) in enumerate(self.workers()):
            prefill = role is WorkerRole.PREFILL
            sim = await self.stack.enter_async_context(SimServer(SimConfig(
                port=0, kv_events_port=0, replay_port=None, model=MODEL, block_size=_BLOCK,
                engine=self.engine, role=Role(role.value), faults=faults,
                bootstrap_port=0 if prefill and self.engine is Engine.SGLANG else None)))
            worker_id = f"{role.value}-{i}"
            self.sims[worker_id] = sim
            specs.append(WorkerSpec(
                id=worker_id, url=sim.url, engine=self.engine, model=MODEL,
                block_size=_BLOCK, role=role, bootstrap_port=sim.bootstrap_port))
        server = await self.stack.enter_async_context(GatewayServer(GatewayConfig(
            models=(ModelConfig(name=MODEL, block_size=_BLOCK, engine=self.engine),),
            server=ServerConfig(host="127.0.0.1", port=0),
            health=HealthConfig(interval_s=60.0, timeout_s=2.0),  # probed once, at start
            load=load, workers=tuple(specs))))
        pool = server.gateway.pool
        await wait_until_async(lambda: sum(1 for w in pool if w.routable()) == len(specs),
                               timeout=30, what="every worker of the side gateway routable")
        return server.url

    def counted(self, name: str, label: str = "") -> float:
        return metric_sum(self.url, name, label) or 0.0


async def _post(url: str, body: dict[str, Any], timeout_s: float) -> tuple[str, float]:
    """(outcome, seconds) of one chat completion."""
    started = time.monotonic()
    try:
        async with aiohttp.ClientSession() as session, session.post(
                url + "/v1/chat/completions", json=body,
                timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            await resp.read()
            outcome = f"HTTP {resp.status}"
            pd = resp.headers.get("x-cortex-pd")
            if pd is not None:
                outcome += f" {pd}"
    except (aiohttp.ClientError, TimeoutError) as exc:
        outcome = type(exc).__name__
    return outcome, time.monotonic() - started


def _chat(text: str, tokens: int) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": tokens, "ignore_eos": True,
            "messages": [{"role": "user", "content": f"{text} " * 8}]}


class SaturatedWorkers(_SideCluster):
    name, title = ("saturated_worker", "saturated vLLM workers (queue 15 s, no byte for the "
                   "waiting requests): not wedged")
    requests, tokens, cap = 16, 1000, 2

    def workers(self) -> list[tuple[WorkerRole, FaultConfig]]:
        return [(WorkerRole.REGULAR, FaultConfig(max_running=self.cap))] * 2

    control = True

    def run(self, b: Bench) -> None:
        self.burst(b, "")
        if self.control:
            self.url = b.loop.call(self._start(LoadConfig(poll_interval_s=0)),
                                   timeout_s=60)
            self.burst(b, "control, load poll off: ")

    def burst(self, b: Bench, prefix: str) -> None:
        async def burst() -> list[tuple[str, float]]:
            return await asyncio.gather(*(_post(self.url, _chat(f"busy {i}", self.tokens),
                                                120.0) for i in range(self.requests)))

        answers = b.loop.call(burst(), timeout_s=180)
        self.notes[prefix + "answers"] = dict(Counter(outcome for outcome, _ in answers))
        self.notes[prefix + "slowest (s)"] = round(max(took for _, took in answers), 1)
        self.notes[prefix + "wedges detected"] = self.counted(
            "cortex_gateway_upstream_wedged_total")
        self.notes[prefix + "wedged failovers"] = self.counted(
            "cortex_gateway_upstream_errors_total", 'kind="wedged"')
        self.notes[prefix + "requests the sims saw beyond the burst (probes, retries)"] = sum(
            s.engine.stats.requests_started for s in self.sims.values()) - self.requests


class SaturatedSGLangWorkers(SaturatedWorkers):
    name, title = ("saturated_worker_sglang", "saturated SGLang workers (queue 15 s, no byte "
                   "for the waiting requests): not wedged")
    engine = Engine.SGLANG
    control = False


class WedgedPDDecode(_SideCluster):
    name, title = ("wedged_pd_decode", "a wedged vLLM decode worker (generation hangs, "
                   "/metrics answers): PD legs")
    requests = 6

    def workers(self) -> list[tuple[WorkerRole, FaultConfig]]:
        return [(WorkerRole.PREFILL, FaultConfig()), (WorkerRole.DECODE, FaultConfig()),
                (WorkerRole.DECODE, FaultConfig(http_down=True)),
                (WorkerRole.REGULAR, FaultConfig())]

    def run(self, b: Bench) -> None:
        answers = [b.loop.call(_post(self.url, _chat(f"pd {i}", 8), 120.0), timeout_s=150)
                   for i in range(self.requests)]  # one at a time: each meets the pairs anew
        self.notes["answers"] = dict(Counter(outcome for outcome, _ in answers))
        self.notes["slowest (s)"] = round(max(took for _, took in answers), 1)
        self.notes["wedges detected (the wedged decode)"] = self.counted(
            "cortex_gateway_upstream_wedged_total", 'worker="decode-2"')
        self.notes["wedges detected (others)"] = self.counted(
            "cortex_gateway_upstream_wedged_total") - self.notes[
                "wedges detected (the wedged decode)"]


WEDGE = (SaturatedWorkers, SaturatedSGLangWorkers, WedgedPDDecode)
"""The cases of this module, in the order they run."""
