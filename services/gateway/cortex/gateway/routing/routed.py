"""A routing outcome (:class:`Routed`) and the time each routing stage took (pure values)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from cortex.gateway.config.gateway import ModelConfig
from cortex.gateway.routing.pairing import PairDecision
from cortex.gateway.routing.placement import Placement
from cortex.gateway.routing.scoring import Decision, Scored

__all__ = ["Routed", "StageTimings", "uncached"]


@dataclass(frozen=True, slots=True)
class StageTimings:
    """Seconds spent per routing stage (wall time), and ``cpu``: the CPU seconds the
    decision took on its thread (wall minus it is waiting: for the GIL, for a core)."""

    tokenize: float
    hash: float
    match: float
    score: float
    cpu: float = 0.0

    @property
    def total(self) -> float:
        return self.tokenize + self.hash + self.match + self.score


@dataclass(frozen=True, slots=True)
class Routed:
    """A routing outcome: the decision plus what it was computed from. For a model served
    disaggregated, ``pd`` is the pair plan and ``decision`` its prefill ranking.
    ``placement``: the decision's credit and counted load (dispatch moves them)."""

    decision: Decision
    model: ModelConfig
    prompt_tokens: int
    keys: list[int]  # every full block of the prompt (plain keys)
    query_blocks: int  # blocks that could be hits (matched against the ledger)
    match_source: str  # "replica" | "index" | "none"
    index_version: int
    timings: StageTimings
    placement: Placement
    pd: PairDecision | None = None
    keysets: Mapping[int, list[int]] | None = None  # lookahead L > 0 -> the prompt's keys

    def credited_tokens(self, worker_id: str) -> int:
        """Hit tokens predicted for ``worker_id`` (a fallback may differ from the choice)."""
        for scored in self.decision.ranked:
            if scored.worker_id == worker_id:
                return scored.credited_tokens
        return 0


def uncached(prompt_tokens: int, scored: Scored) -> int:
    """Prompt tokens ``scored``'s worker will compute (what it holds is not computed, even
    when the decision gave it no credit for it)."""
    return max(prompt_tokens - PairDecision.held_tokens(scored), 0)
