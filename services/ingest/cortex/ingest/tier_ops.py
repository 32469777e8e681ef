"""``TierOps``: the pending ops of one source's offload tiers (each its own ledger source)."""

from __future__ import annotations

from cortex.ledger.model import LedgerState, Op, Snapshot, Tier

__all__ = ["TierOps"]


class TierOps:
    """Per announced offload tier, the ops produced since the last :meth:`take`."""

    __slots__ = ("_ops",)

    def __init__(self) -> None:
        self._ops: dict[Tier, list[Op]] = {}

    def __repr__(self) -> str:
        return f"TierOps({', '.join(t.label for t in self._ops) or 'none'})"

    def __contains__(self, tier: object) -> bool:
        return tier in self._ops

    @property
    def tiers(self) -> list[Tier]:
        """The tiers announced to the index."""
        return list(self._ops)

    def of(self, tier: Tier, state: LedgerState, reason: str) -> list[Op]:
        """The op list of ``tier``, announcing it (an empty snapshot in the device source's
        ``state``) the first time."""
        ops = self._ops.get(tier)
        if ops is None:
            ops = self._ops[tier] = [Snapshot([], [], state, reason)]
        return ops

    def emit(self, op: Op) -> None:
        """``op`` for every announced tier (a state change, reset or removal)."""
        for ops in self._ops.values():
            ops.append(op)

    def take(self) -> dict[Tier, list[Op]]:
        taken: dict[Tier, list[Op]] = {}
        for tier, ops in self._ops.items():
            if ops:
                taken[tier] = ops
                self._ops[tier] = []
        return taken
