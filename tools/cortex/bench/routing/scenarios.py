"""The deployments an exact ledger exists for, as variants of the routing workloads (pure).

A :class:`Variant` says how one workload is deployed and disturbed: how many router replicas
stand behind a round-robin load balancer, whether the workers form a prefill/decode pool,
which workers restart or flush during the run (:class:`ChurnEvent`), how small the KV pools
are, and at which token scale the prompts are built. :data:`VARIANTS` names the ones
``cortex bench routing`` runs beside its plain workloads.

Two measures need the per-request trail and live here too:

* :func:`stale_sends` — requests sent to the worker that last served their longest already
  served prefix, where the engine then reported fewer cached tokens than that prefix: the
  router believed the worker still held blocks it had evicted, dropped or flushed. The same
  rule is applied to every contender (it reads only what the engines reported).
* :func:`window_stats` — hit rate, TTFT and over-predictions of the requests sent in a time
  window (the minute after a churn event).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from cortex.bench.routing.bounds import PromptShape, cacheable_tokens
from cortex.bench.routing.metrics import Outcome, percentile

__all__ = [
    "VARIANTS",
    "ChurnAction",
    "ChurnEvent",
    "StaleSends",
    "Variant",
    "WindowStats",
    "stale_sends",
    "window_stats",
]


class ChurnAction(StrEnum):
    """What happens to a worker during a run."""

    RESTART = "restart"  # the engine comes back empty: seq from 0, AllBlocksCleared
    FLUSH = "flush"      # SGLang ``/flush_cache`` (refused while requests run; retried)


@dataclass(frozen=True, slots=True)
class ChurnEvent:
    """``action`` on worker number ``worker`` at ``fraction`` of the workload's span."""

    action: ChurnAction
    worker: int
    fraction: float


@dataclass(frozen=True, slots=True)
class Variant:
    """How a base workload (``base``: a plain workload name) is deployed.

    ``replicas``: router replicas behind HAProxy (0: clients talk to the one router
    directly). ``pd``: half the workers prefill, half decode. ``capacity_fraction``: each
    worker's KV pool as this fraction of the working set (``None``: the run's default).
    ``host_fraction``: each worker's host tier (blocks evicted from its GPU) as a fraction of
    the working set (0: none).
    ``real_tokens``: prompts at real token counts (a Mooncake block is 512 tokens).
    ``contenders``: who takes part (the rest have nothing to show here); ``churn``: events
    during the run, measured over ``window_s`` seconds after each (0: the rest of the run).
    """

    name: str
    base: str
    title: str
    replicas: int = 0
    pd: bool = False
    capacity_fraction: float | None = None
    host_fraction: float = 0.0
    real_tokens: bool = False
    contenders: tuple[str, ...] = ()
    churn: tuple[ChurnEvent, ...] = ()
    window_s: float = 60.0

    @property
    def group(self) -> str:
        """Variants that differ only in their replica count share a group."""
        return self.name.rsplit("_r", 1)[0] if self.replicas else self.name


_CACHE_PEERS = ("cortex", "sglang_cache_aware", "vllm_cache_aware")


def _replicas(base: str, n: int) -> Variant:
    return Variant(f"{base}_r{n}", base, f"{n} router replica{'s' * (n > 1)} behind HAProxy",
                   replicas=n, contenders=_CACHE_PEERS)


VARIANTS: Mapping[str, Variant] = {v.name: v for v in (
    *(_replicas(base, n) for base in ("shared_prefix", "multi_turn") for n in (1, 2, 4)),
    Variant("churn", "shared_prefix_steady",
            "one worker restarted empty, later another flushed", contenders=_CACHE_PEERS,
            churn=(ChurnEvent(ChurnAction.RESTART, 0, 0.2),
                   ChurnEvent(ChurnAction.FLUSH, 1, 0.6))),
    Variant("kv_pressure", "shared_prefix", "KV pools of 10% of the working set per worker",
            capacity_fraction=0.1,
            contenders=(*_CACHE_PEERS, "sglang_round_robin", "cortex_load_only")),
    Variant("kv_pressure_host", "shared_prefix",
            "KV pools of 10% of the working set, host tiers of 100%: host-hit credit on "
            "(cortex) and off (cortex_gpu_only)", capacity_fraction=0.1, host_fraction=1.0,
            contenders=("cortex", "cortex_gpu_only")),
    Variant("mooncake_real_scale", "mooncake_conversation",
            "real prompt sizes (512 tokens per Mooncake block)", real_tokens=True,
            contenders=("cortex", "sglang_cache_aware", "vllm_cache_aware")),
    Variant("pd", "shared_prefix", "prefill/decode pools", pd=True,
            contenders=("cortex", "sglang_cache_aware")),
)}


# ---- stale sends ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StaleSends:
    """``affine``: requests sent to the last server of their longest already-served prefix;
    ``stale``: those of them that found fewer cached tokens there than that prefix."""

    requests: int
    affine: int
    stale: int
    stale_tokens: int

    @property
    def stale_fraction(self) -> float:
        """Stale sends per answered request."""
        return self.stale / self.requests if self.requests else 0.0


def stale_sends(shapes: Sequence[PromptShape], outcomes: Sequence[Outcome],
                worker_of: Mapping[int, str], page_tokens: int) -> StaleSends | None:
    """Sweep the answered requests in send order. A prefix counts as served by a worker from
    the moment that worker sent the first token of a request with it (its KV exists then).
    ``worker_of`` maps outcome ids to the worker that answered (``None`` when unknown)."""
    ok = [o for o in outcomes if o.ok and o.id in worker_of and o.ttft_s is not None]
    if not ok:
        return None
    served: dict[int, str] = {}  # page key -> last worker holding it
    pending = sorted(((o.sent_s + (o.ttft_s or 0.0), o.id) for o in ok), reverse=True)
    affine = stale = stale_tokens = 0
    for o in sorted(ok, key=lambda o: o.sent_s):
        while pending and pending[-1][0] <= o.sent_s:
            _, rid = pending.pop()
            for key in shapes[rid % len(shapes)].pages:
                served[key] = worker_of[rid]
        shape = shapes[o.id % len(shapes)]
        depth = 0
        for key in shape.pages:
            if key not in served:
                break
            depth += 1
        if depth == 0 or served[shape.pages[depth - 1]] != worker_of[o.id]:
            continue
        affine += 1
        expected = cacheable_tokens(shape, depth, page_tokens)
        if (o.cached_tokens or 0) < expected:
            stale += 1
            stale_tokens += expected - (o.cached_tokens or 0)
    return StaleSends(len(ok), affine, stale, stale_tokens)


# ---- time windows ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class WindowStats:
    """Requests sent in ``[start_s, end_s)``: all of them, and those on ``worker``."""

    start_s: float
    end_s: float
    requests: int
    hit_rate: float
    ttft_p50_ms: float
    ttft_p90_ms: float
    worker_requests: int
    worker_hit_rate: float
    over_predictions: int
    """Requests on ``worker`` whose predicted hit exceeded the engine's ``cached_tokens``."""


def window_stats(outcomes: Sequence[Outcome], worker_of: Mapping[int, str], worker: str,
                 start_s: float, end_s: float) -> WindowStats:
    """The answered requests sent in the window (times on the run's clock, s)."""
    inside = [o for o in outcomes if o.ok and start_s <= o.sent_s < end_s]
    on_worker = [o for o in inside if worker_of.get(o.id) == worker]

    def hit(group: Sequence[Outcome]) -> float:
        prompt = sum(o.prompt_tokens or 0 for o in group)
        return sum(o.cached_tokens or 0 for o in group) / prompt if prompt else math.nan

    ttft = [o.ttft_s for o in inside if o.ttft_s is not None]
    return WindowStats(
        start_s, end_s, len(inside), hit(inside), percentile(ttft, 50) * 1e3,
        percentile(ttft, 90) * 1e3, len(on_worker), hit(on_worker),
        sum(1 for o in on_worker if o.predicted_hit_tokens is not None
            and o.predicted_hit_tokens > (o.cached_tokens or 0)))
