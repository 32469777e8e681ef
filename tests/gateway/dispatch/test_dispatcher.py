"""Dispatch driven through an in-memory upstream: the real router, pool, breakers, plans,
attempts and PD legs; only the sockets are replaced (each worker answers from a script).

What the cluster tests show end to end over HTTP (test_gateway_pd_faults, _timeouts, _http)
is pinned here attempt by attempt: which worker each attempt reached, the breaker verdicts,
the in-flight slots and prefill queues left behind, where the predicted blocks end up.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator

import pytest

from cortex.gateway.config.gateway import GatewayConfig, ModelConfig, PDConfig, UpstreamConfig
from cortex.gateway.dispatch.attempt import Opened
from cortex.gateway.dispatch.dispatcher import Dispatcher
from cortex.gateway.errors import ErrorCode, ServiceUnavailable, UpstreamError
from cortex.gateway.fleet.pool import EngineLoad, Health, WorkerPool
from cortex.gateway.metrics import GatewayMetrics
from cortex.gateway.request.payload import InferencePath, parse_request
from cortex.gateway.routing.router import Routed, Router
from cortex.gateway.routing.scoring import PDMode
from cortex.gateway.upstream.client import FailureKind
from cortex.gateway.upstream.memory import EVENT, MemoryUpstream, Reply
from cortex.hashing import Engine, HashDomain
from cortex.ledger.match import Match, SourceMatch
from cortex.ledger.model import LedgerState, Source
from cortex.registry import WorkerSpec
from cortex.registry.spec import WorkerRole
from cortex.testing.procs import wait_until_async

pytestmark = pytest.mark.timeout(20)

MODEL = "m"
BLOCK = 16


class ColdIndex:
    """Every ledger READY, nothing held: only the router's predictions place prompts."""

    available = True

    def __init__(self, workers: list[str]) -> None:
        self.workers = workers

    async def match(self, domain: HashDomain, keys: list[int], deadline: float
                    ) -> Match | None:
        return Match(tuple(SourceMatch(Source(w, 0), 0, LedgerState.READY) for w in self.workers),
                           1, len(keys))


def make_router(workers: dict[str, WorkerRole], engine: Engine = Engine.SGLANG,
                **sections: object) -> Router:
    model = ModelConfig(name=MODEL, block_size=BLOCK, engine=engine,
                        first_byte_timeout_s=0.2, response_timeout_s=0.2)
    config = GatewayConfig(models=(model,), **sections)  # type: ignore[arg-type]
    pool = WorkerPool(config.breaker)
    def spec(i: int, worker: str, role: WorkerRole) -> WorkerSpec:
        port = 8998 if engine is Engine.SGLANG and role is WorkerRole.PREFILL else None
        return WorkerSpec(id=worker, url=f"http://127.0.0.1:{9000 + i}", engine=engine,
                          model=MODEL, block_size=BLOCK, role=role, bootstrap_port=port)

    pool.sync({w: spec(i, w, role) for i, (w, role) in enumerate(workers.items())})
    for worker in pool:
        worker.health = Health.HEALTHY
        worker.engine = EngineLoad(0, 0, time.monotonic() + 3600)
    return Router(config, pool, {}, ColdIndex(list(workers)), GatewayMetrics())


@pytest.fixture
def regular() -> Iterator[Router]:
    router = make_router({"w0": WorkerRole.REGULAR, "w1": WorkerRole.REGULAR,
                          "w2": WorkerRole.REGULAR})
    yield router
    router.close()


async def route(router: Router, *, stream: bool = True) -> Routed:
    body = {"model": MODEL, "prompt": list(range(10 * BLOCK)), "stream": stream}
    req = parse_request(InferencePath.COMPLETIONS, body, router.config)
    return await router.route(req, time.monotonic() + 10)


def dispatcher(router: Router, upstream: MemoryUpstream) -> Dispatcher:
    return Dispatcher(router.pool, upstream, router, router.config.upstream, router.metrics,
                      router.config.pd)


async def open_one(router: Router, upstream: MemoryUpstream, routed: Routed) -> Opened:
    body = {"model": MODEL, "prompt": list(range(10 * BLOCK)), "stream": True}
    req = parse_request(InferencePath.COMPLETIONS, body, router.config)
    return await dispatcher(router, upstream).open(req, routed, json.dumps(body).encode(),
                                                   "rid")


def idle(router: Router) -> bool:
    """No slot, pending count or queued prefill left on any worker."""
    return all((w.inflight, w.pending, w.prefilling) == (0, 0, 0) for w in router.pool)


def order(routed: Routed) -> list[str]:
    return [s.worker_id for s in routed.decision.ranked]


async def test_a_refused_connection_moves_the_request_and_its_blocks(regular: Router) -> None:
    routed = await route(regular)
    first, second, _ = order(routed)
    upstream = MemoryUpstream({first: [Reply(fail=FailureKind.CONNECT)],
                               second: [Reply()], _: [Reply()]})
    opened = await open_one(regular, upstream, routed)
    assert upstream.reached() == [first, second]
    assert (opened.worker.id, opened.attempts, opened.head) == (second, 2, EVENT)
    assert routed.placement.worker_id == second
    assert set(regular.predicted.match(routed.keys[:5])) == {second}
    worker = regular.pool.get(second)
    assert worker is not None and worker.inflight == 1  # held until the stream ends
    assert regular.metrics.retries.labels(reason="connect")._value.get() == 1
    opened.close()
    opened.close()  # idempotent
    assert idle(regular) and upstream.responses[0].closed


async def test_every_attempt_busy_gives_the_client_the_longest_retry_after(
        regular: Router) -> None:
    routed = await route(regular)
    upstream = MemoryUpstream({w: [Reply(status=429, retry_after_s=after)]
                               for w, after in zip(order(routed), (2.0, None, 5.0), strict=True)})
    with pytest.raises(ServiceUnavailable) as caught:
        await open_one(regular, upstream, routed)
    assert (caught.value.status, caught.value.retry_after_s) == (429, 5.0)
    assert caught.value.code is ErrorCode.RATE_LIMITED
    assert idle(regular) and routed.placement.worker_id is None
    assert all(w.breaker.allows() for w in regular.pool)  # busy is not broken


async def test_no_first_byte_in_time_is_a_504_after_max_attempts(regular: Router) -> None:
    routed = await route(regular)
    upstream = MemoryUpstream({w: [Reply(hang=True)] for w in order(routed)})
    config = UpstreamConfig(max_attempts=2)
    req = parse_request(InferencePath.COMPLETIONS, {"model": MODEL, "prompt": [1] * 40,
                                               "stream": True}, regular.config)
    with pytest.raises(UpstreamError) as caught:
        await Dispatcher(regular.pool, upstream, regular, config, regular.metrics).open(
            req, routed, b"{}", "rid")
    assert (caught.value.status, caught.value.code) == (504, ErrorCode.UPSTREAM_TIMEOUT)
    assert upstream.reached() == order(routed)[:2]
    assert idle(regular)


async def test_a_refusal_is_passed_on_and_takes_the_blocks_back(regular: Router) -> None:
    routed = await route(regular)
    chosen = order(routed)[0]
    upstream = MemoryUpstream({chosen: [Reply(status=400, body=(b'{"error":{}}',))]})
    opened = await open_one(regular, upstream, routed)
    assert (opened.worker.id, opened.response.status, opened.head) == (chosen, 400,
                                                                      b'{"error":{}}')
    assert routed.placement.worker_id is None and len(regular.predicted) == 0
    opened.close()
    assert idle(regular)


async def test_a_cancelled_attempt_frees_its_slot_without_a_verdict(regular: Router) -> None:
    routed = await route(regular)
    chosen = order(routed)[0]
    upstream = MemoryUpstream({chosen: [Reply(hang=True)]})
    task = asyncio.create_task(open_one(regular, upstream, routed))
    worker = regular.pool.get(chosen)
    assert worker is not None
    await wait_until_async(lambda: bool(upstream.sent), timeout=5, what="the attempt sent")
    assert worker.inflight == 1 and worker.prefilling > 0
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert idle(regular)
    assert worker.breaker.allows() and worker.breaker.state.value == "closed"


async def test_no_routable_worker_is_a_503(regular: Router) -> None:
    routed = await route(regular)
    for worker in regular.pool:
        worker.health = Health.UNHEALTHY
    with pytest.raises(ServiceUnavailable):
        await open_one(regular, MemoryUpstream({}), routed)
    assert idle(regular)


# ---- prefill/decode ----

PD_WORKERS = {"p0": WorkerRole.PREFILL, "p1": WorkerRole.PREFILL, "d0": WorkerRole.DECODE,
              "r0": WorkerRole.REGULAR}


async def test_sglang_a_failed_prefill_is_retried_on_the_next_pair() -> None:
    router = make_router(PD_WORKERS)
    try:
        routed = await route(router)
        assert routed.pd is not None
        p_first, p_second = (s.worker_id for s in routed.pd.prefill.ranked)
        upstream = MemoryUpstream({p_first: [Reply(fail=FailureKind.CONNECT)],
                                   p_second: [Reply()],
                                   "d0": [Reply()], "r0": [Reply()]})
        opened = await open_one(router, upstream, routed)
        assert opened.pd is not None and opened.pd.mode is PDMode.DISAGGREGATED
        assert (opened.pd.prefill, opened.pd.decode, opened.attempts) == (p_second, "d0", 2)
        assert routed.placement.worker_id == p_second  # the prompt was computed there
        assert "r0" not in upstream.reached()
        body = json.loads(upstream.sent[-1][1])
        assert body["bootstrap_port"] == 8998 and "bootstrap_room" in body
        opened.close()
        # the prefill leg drains in its own task
        await wait_until_async(lambda: idle(router), timeout=5, what="the legs settled")
    finally:
        router.close()


async def test_a_leg_answering_a_broken_200_is_a_worker_failure_retried_on_the_next_pair(
) -> None:
    router = make_router(PD_WORKERS)
    try:
        routed = await route(router)
        assert routed.pd is not None
        p_first, p_second = (s.worker_id for s in routed.pd.prefill.ranked)
        upstream = MemoryUpstream({p_first: [Reply(body=(b"this is not an event stream\n\n",))],
                                   p_second: [Reply()], "d0": [Reply()], "r0": [Reply()]})
        opened = await open_one(router, upstream, routed)
        assert opened.pd is not None and opened.pd.mode is PDMode.DISAGGREGATED
        assert (opened.pd.prefill, opened.attempts) == (p_second, 2)
        errors = router.metrics.upstream_errors.labels(worker=p_first, kind="bad_answer")
        assert errors._value.get() == 1
        opened.close()
        await wait_until_async(lambda: idle(router), timeout=5, what="the legs settled")
    finally:
        router.close()


async def test_vllm_a_decode_failing_after_the_handoff_falls_back_at_once() -> None:
    router = make_router(PD_WORKERS, Engine.VLLM)
    try:
        routed = await route(router)
        assert routed.pd is not None
        prefill = b'{"kv_transfer_params":{"remote_block_ids":[1]},"usage":{}}'
        upstream = MemoryUpstream({"p0": [Reply(body=(prefill,))],
                                   "p1": [Reply(body=(prefill,))],
                                   "d0": [Reply(fail=FailureKind.DISCONNECT)], "r0": [Reply()]})
        opened = await open_one(router, upstream, routed)
        assert opened.pd is not None and opened.pd.mode is PDMode.FALLBACK
        # one pair, not two: the KV was handed over and lost
        assert upstream.reached()[1:] == ["d0", "r0"] and opened.worker.id == "r0"
        assert opened.decision is routed.pd.fallback and opened.attempts == 2
        opened.close()
        assert idle(router)
    finally:
        router.close()


async def test_without_regular_workers_the_last_failed_side_is_the_error() -> None:
    router = make_router({"p0": WorkerRole.PREFILL, "d0": WorkerRole.DECODE}, Engine.VLLM,
                         pd=PDConfig(max_attempts=3))
    try:
        routed = await route(router)
        upstream = MemoryUpstream({"p0": [Reply(hang=True)], "d0": [Reply()]})
        dispatch = Dispatcher(router.pool, upstream, router, router.config.upstream,
                              router.metrics, PDConfig(prefill_timeout_s=0.05, max_attempts=3))
        req = parse_request(InferencePath.COMPLETIONS, {"model": MODEL, "prompt": [1] * 40},
                            router.config)
        with pytest.raises(UpstreamError) as caught:
            await dispatch.open(req, routed, b"{}", "rid")
        assert (caught.value.status, caught.value.code) == (504, ErrorCode.PREFILL_SERVER_ERROR)
        assert upstream.reached() == ["p0"]  # its only prefill failed: no second pair
        assert idle(router)
    finally:
        router.close()
