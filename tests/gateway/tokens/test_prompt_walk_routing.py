"""With ``tokenize.lazy`` the router decides as with whole prompts: the same worker, the same
credit per candidate, on a random workload against an in-process ledger (device and host
tiers) and predicted blocks (a recent decision's, partly covering a prompt); explain reports
the exact length and keys; a recorded decision's credit covers every block once the rest is
encoded."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from typing import Any

import pytest

from cortex.gateway.config.gateway import (
    GatewayConfig,
    ModelConfig,
    RoutingConfig,
    TokenizeConfig,
)
from cortex.gateway.fleet.pool import EngineLoad, Health, WorkerPool
from cortex.gateway.metrics import GatewayMetrics
from cortex.gateway.request.payload import InferencePath, InferenceRequest, parse_request
from cortex.gateway.routing.router import Routed, Router
from cortex.gateway.tokens.prompt import PromptTokenizer
from cortex.hashing import Engine, HashDomain
from cortex.ledger.match import Match, SourceMatch
from cortex.ledger.model import LedgerState, Source, Tier
from cortex.registry import WorkerSpec
from cortex.testing import wait_until_async

MODEL = "m"
BLOCK = 16
WORKERS = ("w0", "w1", "w2", "w3")
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu 42 café".split()


class Ledger:
    """In-memory ledger with the replica's match contract: per source, the leading blocks
    held (device), or those a host tier adds after the device prefix."""

    version = 1

    def __init__(self, workers: tuple[str, ...] = WORKERS) -> None:
        self.workers = workers  # those with a ledger (none: no source has synced yet)
        self.device: dict[str, set[int]] = {w: set() for w in WORKERS}
        self.host: dict[str, set[int]] = {w: set() for w in WORKERS}

    def match(self, domain: HashDomain, keys: list[int]) -> Match:
        out = []
        for worker in self.workers:
            device = 0
            while device < len(keys) and keys[device] in self.device[worker]:
                device += 1
            host = device
            while host < len(keys) and keys[host] in self.host[worker]:
                host += 1
            out.append(SourceMatch(Source(worker), device, LedgerState.READY))
            out.append(SourceMatch(Source(worker, 0, Tier.HOST), host - device,
                                   LedgerState.READY))
        return Match.of(out, self.version, len(keys), domain)


class Replica:
    usable = True

    def __init__(self, ledger: Ledger) -> None:
        self.replica = ledger


def make_router(ledger: Ledger, lazy: bool, follow_ms: float = 200.0,
                inline_rest_bytes: int | None = None) -> Router:
    config = GatewayConfig(models=(ModelConfig(name=MODEL, block_size=BLOCK),),
                           routing=RoutingConfig(predicted_ttl_s=3600),  # none expire
                           tokenize=TokenizeConfig(lazy=lazy, follow_ms=follow_ms,
                                                   inline_rest_bytes=inline_rest_bytes))
    pool = WorkerPool(config.breaker)
    pool.sync({w: WorkerSpec(id=w, url=f"http://127.0.0.1:{9000 + i}", engine=Engine.SGLANG,
                             model=MODEL, block_size=BLOCK) for i, w in enumerate(WORKERS)})
    for worker in pool:
        worker.health = Health.HEALTHY
        worker.engine = EngineLoad(0, 0, time.monotonic() + 3600)
    tok = PromptTokenizer.load().fork()
    return Router(config, pool, {MODEL: tok}, None, GatewayMetrics(),
                  Replica(ledger))  # type: ignore[arg-type]


def prose(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def request(router: Router, body: dict[str, Any]) -> InferenceRequest:
    endpoint = InferencePath.CHAT if "messages" in body else InferencePath.COMPLETIONS
    return parse_request(endpoint, {"model": MODEL, **body}, router.config)


def credits(routed: Routed) -> list[tuple[str, int, int, int, float]]:
    return sorted((s.worker_id, s.candidate.index_tokens, s.candidate.host_tokens,
                   s.candidate.predicted_tokens, s.score) for s in routed.decision.ranked)


@pytest.mark.timeout(120)
async def test_lazy_and_full_routing_decide_the_same_on_a_random_workload() -> None:
    rng = random.Random(26)
    ledger = Ledger()
    full, lazy = make_router(ledger, False), make_router(ledger, True)
    systems = [prose(rng, rng.randint(100, 1500)) for _ in range(3)]
    sent: list[dict[str, Any]] = []
    walks: list[bool] = []  # complete?
    predicted_credits = 0
    walk = lazy.tokenization.walk

    def recorded(*args: Any) -> Any:
        result = walk(*args)
        walks.append(result is not None and result.complete)
        return result

    lazy.tokenization.walk = recorded  # type: ignore[method-assign]
    try:
        for _ in range(80):
            roll = rng.random()
            if sent and roll < 0.3:
                body = rng.choice(sent)
            elif roll < 0.5:
                body = {"prompt": rng.choice(systems) + " " + prose(rng, rng.randint(1, 300))}
            else:
                body = {"messages": [{"role": "system", "content": rng.choice(systems)},
                                     {"role": "user", "content": prose(rng, 200)}]}
            a = await full.route(request(full, body), time.monotonic() + 30, record=False)
            b = await lazy.route(request(lazy, body), time.monotonic() + 30, record=False)
            assert b.decision.chosen.worker_id == a.decision.chosen.worker_id
            assert b.decision.reason == a.decision.reason
            assert credits(b) == credits(a)
            predicted_credits += any(s.candidate.predicted_tokens for s in a.decision.ranked)
            assert (b.prompt_tokens, b.keys, b.query_blocks) == (
                a.prompt_tokens, a.keys, a.query_blocks)  # explain: exact after the walk
            # some worker computed it: the ledger learns its keys, partly in host memory; and
            # sometimes it was just routed to another: both gateways predict some of its blocks
            worker = rng.choice(WORKERS)
            cut = rng.randint(0, len(a.keys))
            ledger.device[worker].update(a.keys[:cut])
            ledger.host[worker].update(a.keys[cut:rng.randint(cut, len(a.keys))])
            if rng.random() < 0.3:
                routed_to, predicted = rng.choice(WORKERS), a.keys[:rng.randint(0, len(a.keys))]
                for router in (full, lazy):
                    router.predicted.credit(routed_to, predicted)
            sent.append(body)
        assert len(walks) == 80 and walks.count(False) >= 10 and walks.count(True) >= 10
        assert predicted_credits >= 5  # predictions decided some candidates' credit
    finally:
        full.close()
        lazy.close()


@pytest.mark.timeout(60)
async def test_a_recorded_lazy_decision_credits_every_block_once_the_rest_is_encoded() -> None:
    router = make_router(Ledger(), True)
    try:
        text = prose(random.Random(5), 3_000)
        req = request(router, {"prompt": text})
        routed = await router.route(req, time.monotonic() + 30)
        exact = router.tokenizers[MODEL].fork().encode_text(text)
        whole = HashDomain(MODEL, BLOCK, Engine.SGLANG).keys(exact)
        assert len(routed.keys) < len(whole) // 4  # decided on the first blocks
        assert abs(routed.prompt_tokens - len(exact)) < 0.1 * len(exact)  # estimated
        chosen = routed.decision.chosen.worker_id
        for _ in range(3000):  # the rest is encoded on the feeder thread
            if router.predicted.match(whole).get(chosen) == len(whole):
                break
            await asyncio.sleep(0.01)
        assert router.predicted.match(whole) == {chosen: len(whole)}
        assert routed.placement.keys == whole
    finally:
        router.close()


@pytest.mark.timeout(60)
async def test_a_small_rest_is_encoded_at_once_and_the_decision_credits_every_block() -> None:
    router = make_router(Ledger(), True, inline_rest_bytes=1 << 20)  # every rest is small
    try:
        text = prose(random.Random(5), 3_000)
        routed = await router.route(request(router, {"prompt": text}), time.monotonic() + 30)
        exact = router.tokenizers[MODEL].fork().encode_text(text)
        whole = HashDomain(MODEL, BLOCK, Engine.SGLANG).keys(exact)
        chosen = routed.decision.chosen.worker_id
        # no wait: the rest was encoded before route returned, nothing went to the thread
        assert routed.keys == whole and routed.placement.keys == whole
        assert routed.prompt_tokens == len(exact)
        assert router.predicted.match(whole) == {chosen: len(whole)}
        rest = router.metrics.tokenize_lazy_rest
        assert rest.labels(model=MODEL, result="inline")._value.get() == 1
        assert rest.labels(model=MODEL, result="done")._value.get() == 0
    finally:
        router.close()


@pytest.mark.timeout(60)
async def test_a_walk_with_no_ledger_and_no_prediction_stops_at_the_first_blocks() -> None:
    router = make_router(Ledger(workers=()), True)  # no source synced, nothing predicted
    try:
        text = prose(random.Random(6), 2_000)
        routed = await router.route(request(router, {"prompt": text}), time.monotonic() + 30)
        assert 0 < len(routed.keys) < 50 and routed.decision.chosen.worker_id in WORKERS
    finally:
        router.close()


def counted(router: Router, result: str) -> float:
    metric = router.metrics.tokenize_lazy_follow.labels(MODEL, result)
    return float(metric._value.get())


def held_feeder(router: Router) -> threading.Event:
    """Keep the tokenizer's feeder thread busy until the returned event is set: the rests
    of recorded walks wait behind it."""
    gate = threading.Event()
    router.tokenization._feeder.submit(gate.wait)
    return gate


@pytest.mark.timeout(60)
async def test_a_burst_of_a_new_prompt_waits_for_the_first_rest_and_follows_it() -> None:
    """Without the wait, each request after the first would be credited with the first
    one's walked blocks only (under a quarter of the prompt): the burst would spread once
    a few requests' load outweighed them."""
    router = make_router(Ledger(), True, follow_ms=30_000)
    walk, walks = router.tokenization.walk, []

    def recorded(*args: Any) -> Any:
        walks.append(args)
        return walk(*args)

    router.tokenization.walk = recorded  # type: ignore[method-assign]
    gate = held_feeder(router)
    try:
        text = prose(random.Random(7), 3_000)
        deadline = time.monotonic() + 30
        first = await router.route(request(router, {"prompt": text}), deadline)
        whole = HashDomain(MODEL, BLOCK, Engine.SGLANG).keys(
            router.tokenizers[MODEL].fork().encode_text(text))
        assert len(first.keys) < len(whole) // 4
        followers = [asyncio.create_task(router.route(
            request(router, {"prompt": f"{text} question {i}"}), deadline)) for i in range(11)]
        # a walk is followed by the wait without yielding: 12 walks = all 11 are waiting
        await wait_until_async(lambda: len(walks) == 12, timeout=20, what="11 walks")
        assert not any(t.done() for t in followers)
        gate.set()
        routed = await asyncio.gather(*followers)
        chosen = first.decision.chosen.worker_id
        assert {r.decision.chosen.worker_id for r in routed} == {chosen}
        for r in routed:
            credit = {s.worker_id: s.credited_tokens for s in r.decision.ranked}
            assert credit[chosen] >= (len(whole) - 1) * BLOCK  # the shared prompt, not 1/4
        assert counted(router, "followed") == 11 and counted(router, "timeout") == 0
    finally:
        gate.set()
        router.close()


@pytest.mark.timeout(60)
async def test_a_follower_whose_wait_times_out_routes_on_its_walk_and_the_rest_still_lands(
) -> None:
    router = make_router(Ledger(), True, follow_ms=1)
    gate = held_feeder(router)
    try:
        text = prose(random.Random(8), 3_000)
        deadline = time.monotonic() + 30
        first = await router.route(request(router, {"prompt": text}), deadline)
        second = await router.route(request(router, {"prompt": text + " again"}), deadline)
        walked = len(first.keys) * BLOCK
        chosen = first.decision.chosen.worker_id
        assert {s.worker_id: s.credited_tokens for s in second.decision.ranked}[chosen] == walked
        assert counted(router, "timeout") == 1 and counted(router, "followed") == 0
        gate.set()  # the first request's rest was not cancelled by the second's timeout
        whole = HashDomain(MODEL, BLOCK, Engine.SGLANG).keys(
            router.tokenizers[MODEL].fork().encode_text(text))
        await wait_until_async(lambda: router.predicted.match(whole).get(chosen, 0)
                               == len(whole), timeout=20, what="the whole prompt credited")
    finally:
        gate.set()
        router.close()
