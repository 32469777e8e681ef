"""What one workload's runs add up to, shared by the report's sections (pure)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from cortex.bench.routing.metrics import RunSummary
from cortex.bench.routing.workloads import Workload

__all__ = ["CAPACITY_ALLOWS", "Target", "WorkloadResult", "fmt_ms", "or_nan"]

CAPACITY_ALLOWS = 0.98
"""Capacity "allows" the infinite-cache bound when a pooled LRU as large as the cluster
reaches this fraction of it."""


@dataclass(slots=True)
class WorkloadResult:
    """A workload, its bounds and every contender's run."""

    workload: Workload
    prompt_tokens: int
    infinite_bound: float
    pooled_bound: float
    unique_pages: int
    capacity_blocks: int
    offered_prefill_load: float
    single_worker_bound: float = 0.0
    runs: dict[str, RunSummary] = field(default_factory=dict)
    ttfts_ms: dict[str, list[float]] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    """Contenders that could not run here, and why (a program not installed)."""

    @property
    def capacity_allows(self) -> bool:
        return self.pooled_bound >= CAPACITY_ALLOWS * self.infinite_bound


@dataclass(frozen=True, slots=True)
class Target:
    """One target on one workload: met, missed, or not applicable (``met is None``)."""

    workload: str
    name: str
    met: bool | None
    detail: str


def fmt_ms(value: float) -> str:
    if math.isnan(value):
        return "—"
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}"


def or_nan(value: float | None) -> float:
    return math.nan if value is None else float(value)
