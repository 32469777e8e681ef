"""The admin API's documents (``GET /sim/state``, ``GET /sim/cache``): pure views of a
sim's ranks, served by :class:`cortex.sim.routes.SimRoutes`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from cortex.sim.config import SimConfig
from cortex.sim.engine import SimEngine
from cortex.sim.faults import FaultState

__all__ = ["cache_listing", "rank_state", "sim_state"]


def rank_state(engine: SimEngine) -> dict[str, Any]:
    """One rank's load, cache sizes (blocks), event counters and stats."""
    cache = engine.cache
    return {
        "running": engine.running, "waiting": engine.waiting,
        "cache": {"capacity_blocks": cache.capacity, "block_size": cache.block_size,
                  "cached_blocks": cache.cached_blocks, "used_blocks": cache.used_blocks,
                  "pinned_blocks": cache.pinned_blocks, "evicted_blocks":
                      cache.evicted_blocks, "enabled": cache.enabled},
        "events": engine.event_state(),
        "stats": engine.stats_dict(),
    }


def sim_state(config: SimConfig, engines: Sequence[SimEngine], faults: FaultState,
              ports: Mapping[str, int | None], traceparent: str | None) -> dict[str, Any]:
    """Ports, load, cache, event counters, stats and faults; with ``dp_size`` > 1 the
    top-level numbers are sums over ``ranks`` (rank 0's event counters)."""
    ranks = [rank_state(engine) for engine in engines]
    whole = ranks[0]
    if len(ranks) > 1:
        whole = {**whole, "running": sum(r["running"] for r in ranks),
                 "waiting": sum(r["waiting"] for r in ranks),
                 "cache": {key: (value if isinstance(value, bool) or key == "block_size"
                                 else sum(r["cache"][key] for r in ranks))
                           for key, value in whole["cache"].items()},
                 "stats": {key: sum(r["stats"][key] for r in ranks)
                           for key in whole["stats"]}}
    state = {
        "engine": config.engine.value, "version": config.engine_version,
        "role": config.role.value, "model": config.model,
        "ports": dict(ports), "running": whole["running"],
        "waiting": whole["waiting"], "cache": whole["cache"], "events": whole["events"],
        "stats": whole["stats"], "faults": faults.snapshot(),
        "traceparent": traceparent,
    }
    if len(ranks) > 1:
        state["ranks"] = ranks
    return state


def cache_listing(engines: Sequence[SimEngine], block_size: int, with_tokens: bool
                  ) -> dict[str, Any]:
    """Every cached block of every rank (``dp_rank`` when there are several), ``tokens``
    too when asked."""
    blocks = []
    for engine in engines:
        for block in engine.cache.blocks():
            item: dict[str, Any] = {"hash": block.event_id, "block_id": block.block_id,
                                    "parent": block.parent.event_id if block.parent
                                    else None, "refs": block.refs}
            if len(engines) > 1:
                item["dp_rank"] = engine.dp_rank
            if with_tokens:
                item["tokens"] = list(block.tokens)
            blocks.append(item)
    return {"block_size": block_size, "blocks": blocks}
