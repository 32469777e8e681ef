"""Session hints in the router: the next turn stays home before the ledger sees it, new
sessions spread over paced workers (pure routing core: an index that holds nothing, token
prompts, predictions off so only the session table is at work)."""

from __future__ import annotations

import time
from typing import Any

from cortex.gateway.config.gateway import RoutingWeights
from cortex.gateway.request.payload import InferencePath, parse_request
from cortex.gateway.routing.router import Routed, Router

from .test_router import BLOCK, MODEL, WORKERS
from .test_router import make_router as make_any_router


def make_router(**routing: Any) -> Router:
    """:func:`test_router.make_router` with predictions off (only the session table works)."""
    routing.setdefault("predicted_ttl_s", 0.0)
    return make_any_router(**routing)


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
