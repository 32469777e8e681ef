"""The router's decisions take effect at once: predicted blocks and load at decision time.

Pure routing core (no sockets): a pool of healthy workers with fresh engine loads, token-id
prompts, and an in-memory index that has not seen the prefix yet (every ledger READY,
nothing held), so only the router's own predictions can make requests co-locate.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from cortex.gateway.config.gateway import (
    GatewayConfig,
    ModelConfig,
    RoutingConfig,
    RoutingWeights,
)
from cortex.gateway.fleet.pool import EngineLoad, Health, WorkerPool
from cortex.gateway.metrics import GatewayMetrics
from cortex.gateway.request.payload import InferencePath, parse_request
from cortex.gateway.routing.router import OFFLOAD_CHARS, Routed, Router
from cortex.gateway.tokens.prompt import PromptTokenizer
from cortex.hashing import Engine, HashDomain
from cortex.ledger.match import Match, SourceMatch
from cortex.ledger.model import LedgerState, Source
from cortex.registry import WorkerSpec

MODEL = "m"
BLOCK = 16
WORKERS = ("w0", "w1", "w2")


class ColdIndex:
    """Every worker's ledger READY, no block of any query held."""

    available = True

    async def match(self, domain: HashDomain, keys: list[int], deadline: float
                    ) -> Match | None:
        return Match(tuple(SourceMatch(Source(w, 0), 0, LedgerState.READY) for w in WORKERS),
                           1, len(keys))


def make_router(**routing: Any) -> Router:
    config = GatewayConfig(models=(ModelConfig(name=MODEL, block_size=BLOCK),),
                           routing=RoutingConfig(**routing))
    pool = WorkerPool(config.breaker)
    pool.sync({w: WorkerSpec(id=w, url=f"http://127.0.0.1:{9000 + i}", engine=Engine.SGLANG,
                             model=MODEL, block_size=BLOCK) for i, w in enumerate(WORKERS)})
    for worker in pool:
        worker.health = Health.HEALTHY
        worker.engine = EngineLoad(0, 0, time.monotonic() + 3600)  # fresh throughout
    return Router(config, pool, {}, ColdIndex(), GatewayMetrics())


@pytest.fixture
def router() -> Iterator[Router]:
    r = make_router()
    yield r
    r.close()


def prompt(prefix: int, question: int) -> list[int]:
    """A 100-block shared prefix ``prefix`` (1,600 tokens: worth 25 active requests at the
    default weights) and a question of 2 to 10 blocks."""
    shared = [prefix * 10_000 + i for i in range(100 * BLOCK)]
    return shared + [question] * (question % 5 + 1) * 2 * BLOCK


async def route(router: Router, ids: list[int], *, record: bool = True) -> Routed:
    req = parse_request(InferencePath.COMPLETIONS, {"model": MODEL, "prompt": ids}, router.config)
    return await router.route(req, time.monotonic() + 10, record=record)


async def test_a_burst_of_a_new_prefix_follows_the_first_decision() -> None:
    # nothing is dispatched: only decision-time predictions and pending load are at work;
    # the prefill-queue term off (delta 0), every request follows the first
    router = make_router(weights=RoutingWeights(delta=0.0))
    try:
        routed = [await route(router, prompt(1, q)) for q in range(20)]
        first = routed[0].decision
        assert (first.mode.value, first.reason.value) == ("load_aware", "prefix_hash")
        assert {r.decision.chosen.worker_id for r in routed} == {first.chosen.worker_id}
        assert {r.decision.reason.value for r in routed[1:]} == {"predicted_hit"}
        assert all(r.decision.hit_tokens == 100 * BLOCK for r in routed[1:])
        holder = router.pool.get(first.chosen.worker_id)
        assert holder is not None and holder.pending == 20
        for r in routed:
            r.placement.dispatched()
            r.placement.dispatched()  # idempotent
        assert holder.pending == 0
    finally:
        router.close()


async def test_at_delta_half_a_burst_follows_each_holder_until_its_queue_outweighs_the_hit(
        ) -> None:
    router = make_router(weights=RoutingWeights(delta=0.5))  # the default, pinned
    try:
        await burst_opens_holders_past_the_hit(router)
    finally:
        router.close()


async def burst_opens_holders_past_the_hit(router: Router) -> None:
    # the shared prefix is most of every prompt: the prefill queue does not count
    # (delta_hit_share), the burst follows its first request as with delta 0
    routed = [await route(router, prompt(1, q)) for q in range(8)]
    assert len({r.decision.chosen.worker_id for r in routed}) == 1
    for r in routed:
        r.placement.dispatched()  # answered: no load left behind
    # 1,600 shared tokens of 4,000: each follower's own 2,400 uncached tokens queue up at
    # half a cached token each; past the hit the burst opens the next holder, whose own
    # prediction the next request follows
    routed = [await route(router, long_question(2, q)) for q in range(6)]
    workers = [r.decision.chosen.worker_id for r in routed]
    assert [workers.count(w) for w in dict.fromkeys(workers)] == [2, 2, 2]
    assert [r.decision.reason.value for r in routed] == [
        "prefix_hash", "predicted_hit", *["load_outweighs_hit", "predicted_hit"] * 2]


def long_question(prefix: int, question: int) -> list[int]:
    """The 100-block shared prefix ``prefix`` and a 150-block question of its own."""
    shared = [prefix * 10_000 + i for i in range(100 * BLOCK)]
    return shared + [50_000 + question * 1000 + i for i in range(150 * BLOCK)]


async def test_the_burst_spills_over_once_the_holder_reaches_its_watermark() -> None:
    router = make_router(high_watermark=4)
    try:
        routed = [await route(router, prompt(2, q)) for q in range(12)]
    finally:
        router.close()
    workers = [r.decision.chosen.worker_id for r in routed]
    # the holder takes 4, then the next worker 4 (following its own prediction), then the
    # third; nobody goes past the watermark while another worker is below it
    assert [workers.count(w) for w in dict.fromkeys(workers)] == [4, 4, 4]
    assert workers[:4] == [workers[0]] * 4 and len(set(workers[4:8])) == 1
    assert routed[4].decision.reason.value == "over_watermark"
    assert [r.decision.reason.value for r in routed[5:8]] == ["predicted_hit"] * 3


async def test_explain_neither_credits_nor_counts(router: Router) -> None:
    explained = await route(router, prompt(3, 0), record=False)
    assert explained.placement.worker_id is None
    assert len(router.predicted) == 0
    assert all(w.pending == 0 for w in router.pool)
    again = await route(router, prompt(3, 1), record=False)
    assert again.decision.reason.value == "prefix_hash"


async def test_a_moved_placement_takes_its_credit_along(router: Router) -> None:
    first = await route(router, prompt(4, 0))
    chosen = first.decision.chosen.worker_id
    other = next(w for w in WORKERS if w != chosen)
    first.placement.move(other)  # the chosen worker failed before the first byte
    assert first.placement.worker_id == other
    follower = await route(router, prompt(4, 1))
    assert (follower.decision.chosen.worker_id, follower.decision.reason.value) == (
        other, "predicted_hit")
    first.placement.withdraw()  # ... and other refused it: only the follower's credit stays
    follower.placement.withdraw()
    for done in (first, follower):  # both answered: no prefill queued anywhere any more
        done.placement.dispatched()
    third = await route(router, prompt(4, 2))
    assert third.decision.reason.value == "prefix_hash"
    assert third.decision.chosen.worker_id == chosen  # the hash agrees with the first time


async def test_long_new_prompts_are_encoded_off_the_event_loop() -> None:
    config = GatewayConfig(models=(ModelConfig(name=MODEL, block_size=BLOCK),))
    pool = WorkerPool(config.breaker)
    tok = PromptTokenizer.load()
    router = Router(config, pool, {MODEL: tok}, ColdIndex(), GatewayMetrics())
    threads: list[str] = []
    counted = tok.observer
    assert counted is not None

    def observe(hits: int, misses: int) -> None:
        threads.append(threading.current_thread().name)
        counted(hits, misses)

    tok.observer = observe
    long_text = " ".join(f"word{i}" for i in range(OFFLOAD_CHARS // 4))
    try:
        for text in ("a short prompt", long_text, long_text):
            req = parse_request(InferencePath.COMPLETIONS, {"model": MODEL, "prompt": text}, config)
            assert list((await router.tokens(req)).ids) == tok.chat.encode_text(text)
    finally:
        router.close()
    # short: inline; long and new: a tokenizer thread; long but cached: inline again
    assert [name.startswith("cortex-tokenize") for name in threads] == [False, True, False]
