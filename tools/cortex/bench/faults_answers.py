"""Broken worker answers where the cluster's gateways do not go, for ``cortex bench faults``.

The cluster of the suite runs regular workers behind routed models; answer validation also
guards the two other request paths, each checked here on a gateway of its own (started in
this process, on the bench's loop, beside the cluster; zero-cost sims):

- :class:`BrokenPDAnswers`: prefill/decode disaggregation (SGLang: 2 prefill and 2 decode
  sims, one of each behind an :class:`~cortex.bench.answer_proxy.AnswerProxy`): a leg
  answering a broken 200 must be a worker failure, the request retried on another pair or
  answered 502.
- :class:`BrokenPassthroughAnswers`: a ``passthrough`` model over two registered workers,
  one behind a proxy: relayed unbuffered, yet a broken 200 is never relayed.
- :class:`BrokenFixedUpstreamAnswers`: a ``passthrough`` model whose fixed ``upstream_url``
  is a proxy: no worker, no breaker, yet every broken 200 is a 502 and counted (as worker
  ``upstream``).

Each shape of :data:`~cortex.bench.faults_hostile.BROKEN_SHAPES` is sent until a proxy
answered a request; the note is what that client got, then the ``bad_answer`` failures the
gateway counted and a good request once the proxies are disarmed.
"""

from __future__ import annotations

import contextlib
from typing import Any

from cortex.bench.answer_proxy import AnswerProxy
from cortex.bench.faults_catalogue import Bench, Fault
from cortex.bench.faults_hostile import BROKEN_SHAPES, answer_outcome, metric_sum
from cortex.bench.faults_load import MODEL
from cortex.gateway import (
    GatewayConfig,
    GatewayServer,
    HealthConfig,
    ModelConfig,
    PDConfig,
    ServerConfig,
)
from cortex.hashing import Engine
from cortex.registry import WorkerSpec
from cortex.registry.spec import WorkerRole
from cortex.sim.config import Role, SimConfig, TimingConfig
from cortex.sim.server import SimServer
from cortex.testing import wait_until_async

__all__ = ["ANSWERS", "BrokenPDAnswers", "BrokenPassthroughAnswers"]

_BLOCK = 16


class SideGateway(Fault):
    """A case on a gateway of its own: ``workers`` sims as (role, proxied) pairs."""

    hold = "none"
    workers: tuple[tuple[WorkerRole, bool], ...] = ()
    model = ModelConfig(name=MODEL, block_size=_BLOCK)

    def inject(self, b: Bench) -> None:
        self.proxies: list[AnswerProxy] = []
        self.stack = contextlib.AsyncExitStack()
        url = b.loop.call(self._start(), timeout_s=60)
        for shape, stream in BROKEN_SHAPES:
            for proxy in self.proxies:
                proxy.shape = shape
            self.notes[shape.value] = self._until_answered(b, url, stream)
        for proxy in self.proxies:
            proxy.shape = None
        self.notes["bad_answer failures counted"] = metric_sum(
            url, "cortex_gateway_upstream_errors_total", 'kind="bad_answer"')
        self.notes["a good request after"] = b.loop.call(
            answer_outcome(url, _chat("after", stream=True)), timeout_s=120)

    def repair(self, b: Bench) -> None:
        b.loop.call(self.stack.aclose(), timeout_s=60)

    async def _start(self) -> str:
        specs = []
        for i, (role, proxied) in enumerate(self.workers):
            prefill = role is WorkerRole.PREFILL
            sim = await self.stack.enter_async_context(SimServer(SimConfig(
                port=0, kv_events_port=0, replay_port=None, model=MODEL, block_size=_BLOCK,
                role=Role(role.value), timing=TimingConfig(zero_cost=True),
                bootstrap_port=0 if prefill else None)))
            url = sim.url
            if proxied:
                proxy = await self.stack.enter_async_context(AnswerProxy(sim.url))
                self.proxies.append(proxy)
                url = proxy.url
            specs.append(WorkerSpec(
                id=f"{role.value}-{i}", url=url, engine=Engine.SGLANG, model=MODEL,
                block_size=_BLOCK, role=role, bootstrap_port=sim.bootstrap_port))
        server = await self.stack.enter_async_context(GatewayServer(GatewayConfig(
            models=(self.model,), server=ServerConfig(host="127.0.0.1", port=0),
            health=HealthConfig(interval_s=60.0, timeout_s=2.0),  # probed once, at start
            pd=PDConfig(prefill_timeout_s=10.0, decode_timeout_s=10.0),
            workers=tuple(specs))))
        pool = server.gateway.pool
        await wait_until_async(lambda: sum(1 for w in pool if w.routable()) == len(specs),
                               timeout=30, what="every worker of the side gateway routable")
        return server.url

    def _until_answered(self, b: Bench, url: str, stream: bool, tries: int = 40) -> str:
        """Requests until a proxy answered one; that one's outcome."""
        for i in range(tries):
            before = sum(p.answered for p in self.proxies)
            outcome = b.loop.call(answer_outcome(url, _chat(f"{i} {self.name}", stream)),
                                  timeout_s=120)
            if sum(p.answered for p in self.proxies) > before:
                return outcome
        return f"no proxy answered any of {tries}"


def _chat(text: str, stream: bool) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 4, "stream": stream,
            "messages": [{"role": "user", "content": f"probe {text} " * 8}]}


class BrokenPDAnswers(SideGateway):
    name, title = ("broken_answers_pd", "a PD leg answering broken 200s (a prefill and a "
                   "decode of two pairs)")
    workers = ((WorkerRole.PREFILL, True), (WorkerRole.PREFILL, False),
               (WorkerRole.DECODE, True), (WorkerRole.DECODE, False))


class BrokenPassthroughAnswers(SideGateway):
    name, title = ("broken_answers_passthrough", "a worker of a passthrough model answering "
                   "broken 200s")
    workers = ((WorkerRole.REGULAR, True), (WorkerRole.REGULAR, False))
    model = ModelConfig(name=MODEL, block_size=_BLOCK, passthrough=True)


class BrokenFixedUpstreamAnswers(SideGateway):
    name, title = ("broken_answers_upstream_url", "a passthrough model's fixed upstream_url "
                   "answering broken 200s")

    async def _start(self) -> str:
        sim = await self.stack.enter_async_context(SimServer(SimConfig(
            port=0, kv_events_port=0, replay_port=None, model=MODEL, block_size=_BLOCK,
            timing=TimingConfig(zero_cost=True))))
        proxy = await self.stack.enter_async_context(AnswerProxy(sim.url))
        self.proxies.append(proxy)
        server = await self.stack.enter_async_context(GatewayServer(GatewayConfig(
            models=(ModelConfig(name=MODEL, block_size=_BLOCK, passthrough=True,
                                upstream_url=proxy.url),),
            server=ServerConfig(host="127.0.0.1", port=0))))
        return server.url


ANSWERS = (BrokenPDAnswers, BrokenPassthroughAnswers, BrokenFixedUpstreamAnswers)
"""The cases of this module, in the order they run."""
