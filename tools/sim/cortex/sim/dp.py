"""Which data-parallel rank serves a sequence, decided the way each engine decides (pure).

- A rank given by the request wins (SGLang ``routed_dp_rank`` / ``data_parallel_rank``,
  vLLM ``X-data-parallel-rank``).
- SGLang: a PD prefill follows its bootstrap room (``bootstrap_room % dp_size``, the
  decode side computes the same); everything else goes round robin.
- vLLM: the least loaded rank, scored ``4 * waiting + running`` (first one on ties).
"""

from __future__ import annotations

from collections.abc import Sequence

from cortex.hashing import Engine
from cortex.sim.config import Role

__all__ = ["RankPicker"]


class RankPicker:
    """Rank choice for one worker with ``dp_size`` ranks."""

    def __init__(self, engine: Engine, role: Role, dp_size: int) -> None:
        self.engine = engine
        self.role = role
        self.dp_size = dp_size
        self._next = 0

    def check(self, rank: int | None) -> str | None:
        """The error message for an out-of-range requested rank, or ``None``."""
        if rank is None or self.dp_size == 1 or 0 <= rank < self.dp_size:
            return None
        return f"data_parallel_rank {rank} is out of range [0, {self.dp_size})"

    def pick(self, requested: int | None, room: int | None,
             loads: Sequence[tuple[int, int]]) -> int:
        """The rank for one sequence. ``loads``: (waiting, running) per rank, now."""
        if self.dp_size == 1:
            return 0
        if requested is not None:
            return requested
        if self.engine is Engine.VLLM:
            scores = [4 * waiting + running for waiting, running in loads]
            return scores.index(min(scores))
        if self.role is Role.PREFILL and room is not None:
            return room % self.dp_size
        rank = self._next
        self._next = (rank + 1) % self.dp_size
        return rank

    def __repr__(self) -> str:
        return (f"RankPicker({self.engine.value} {self.role.value}, dp_size={self.dp_size}, "
                f"next={self._next})")
