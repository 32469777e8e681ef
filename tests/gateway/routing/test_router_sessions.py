"""Session hints in the router: the next turn stays home before the ledger sees it, new
sessions spread over paced workers (pure routing core: an index that holds nothing, token
prompts, predictions off so only the session table is at work)."""

from __future__ import annotations

import time
from typing import Any

from cortex.gateway.config.gateway import (
    GatewayConfig,
    ModelConfig,
    RoutingConfig,
    RoutingWeights,
)
from cortex.gateway.fleet.pool import EngineLoad, Health, WorkerPool
from cortex.gateway.metrics import GatewayMetrics
from cortex.gateway.request.payload import InferencePath, parse_request
from cortex.gateway.routing.router import Routed, Router
from cortex.hashing import Engine, HashDomain
from cortex.ledger.match import Match, SourceMatch
from cortex.ledger.model import LedgerState, Source
from cortex.registry import WorkerSpec

MODEL, BLOCK, WORKERS = "m", 16, ("w0", "w1", "w2")


class ColdIndex:
    available = True

    async def match(self, domain: HashDomain, keys: list[int], deadline: float
                    ) -> Match | None:
        return Match(tuple(SourceMatch(Source(w, 0), 0, LedgerState.READY) for w in WORKERS),
                     1, len(keys))


def make_router(**routing: Any) -> Router:
    routing.setdefault("predicted_ttl_s", 0.0)
    config = GatewayConfig(models=(ModelConfig(name=MODEL, block_size=BLOCK),),
                           routing=RoutingConfig(**routing))
    pool = WorkerPool(config.breaker)
    pool.sync({w: WorkerSpec(id=w, url=f"http://127.0.0.1:{9000 + i}", engine=Engine.SGLANG,
                             model=MODEL, block_size=BLOCK) for i, w in enumerate(WORKERS)})
    for worker in pool:
        worker.health = Health.HEALTHY
        worker.engine = EngineLoad(0, 0, time.monotonic() + 3600)
    return Router(config, pool, {}, ColdIndex(), GatewayMetrics())


async def route(router: Router, ids: list[int], session: str | None) -> Routed:
    req = parse_request(InferencePath.COMPLETIONS, {"model": MODEL, "prompt": ids}, router.config)
    routed = await router.route(req, time.monotonic() + 10, session=session)
    routed.placement.dispatched()  # sent and answered: only the session table remembers
    return routed


async def test_the_next_turn_stays_home_with_the_last_turns_blocks_as_credit() -> None:
    router = make_router()
    try:
        turn = [7] * (20 * BLOCK)
        first = await route(router, turn, "s")
        home = first.decision.chosen.worker_id
        assert first.decision.reason.value in ("prefix_hash", "session_hint", "no_hit")
        turn += [8] * (3 * BLOCK)
        second = await route(router, turn, "s")
        d = second.decision
        assert (d.chosen.worker_id, d.mode.value, d.reason.value, d.hit_tokens) == (
            home, "exact_kv", "session_hit", 20 * BLOCK)
        # another session's first turn of the same prompt: no credit from this one's turns
        other = await route(router, turn + [9] * BLOCK, "t")
        assert other.decision.hit_tokens == 0
        # a prompt that does not continue the last turn: the home only breaks ties
        third = await route(router, [5] * (30 * BLOCK), "s")
        assert (third.decision.chosen.worker_id, third.decision.hit_tokens) == (home, 0)
        value = router.metrics.registry.get_sample_value
        assert value("cortex_gateway_session_hints_total", {"outcome": "new"}) == 2
        assert value("cortex_gateway_session_hints_total", {"outcome": "kept"}) == 2
    finally:
        router.close()


async def test_new_sessions_spread_over_workers_home_to_paced_sessions() -> None:
    # four agent sessions start on one shared agent prompt (100 blocks), one after another;
    # each turn has ended before the next starts, so no worker runs anything
    prompt = [3] * (100 * BLOCK)
    spread = make_router()
    piled = make_router(weights=RoutingWeights(session=0.0, session_home=0.0))
    try:
        homes = [(await route(spread, prompt + [i] * BLOCK, f"s{i}")).decision.chosen.worker_id
                 for i in range(6)]
        assert set(homes) == set(WORKERS)
        same = {(await route(piled, prompt + [i] * BLOCK, f"s{i}")).decision.chosen.worker_id
                for i in range(6)}
        assert len(same) == 1  # the prefix hash alone: every session on one worker
    finally:
        spread.close()
        piled.close()
