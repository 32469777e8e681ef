"""From per-request outcomes to one contender's numbers, with the checks that keep it honest
(pure).

A run counts only if it sent every request of the workload, exactly as listed (each body's
digest matches), and every answered request's engine-reported ``prompt_tokens`` equals the
count the tokenizer gives for that prompt and its ``completion_tokens`` equals
``max_tokens``. Failures are counted, never dropped; latency percentiles are over the
requests that succeeded. The engines' own counters (``/sim/state``) are compared with what
the client saw, so a contender cannot hide requests from the hit rate either.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "EngineTotals",
    "Outcome",
    "Prediction",
    "ReuseTotals",
    "RunSummary",
    "StageSummary",
    "percentile",
    "pool",
    "summarize",
]


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation (numpy's default);
    NaN for no values."""
    if not values:
        return math.nan
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass(slots=True)
class Outcome:
    """What happened to one request (times in seconds from the run's start).

    ``error`` is ``None`` for a success: HTTP 200, a complete stream (``[DONE]``) and a
    usage chunk. ``predicted_hit_tokens`` / ``worker`` come from Cortex's
    ``x-cortex-cache-hit-tokens`` / ``x-cortex-assigned-worker`` headers (``None`` for peers);
    ``served_port`` from the sim's ``x-cortex-sim-port`` (the worker that answered, whoever
    routed it). ``reuse_available`` / ``reuse_captured``: Cortex's ``x-cortex-reuse``.
    """

    id: int
    digest: str
    scheduled_s: float
    sent_s: float
    error: str | None = None
    ttft_s: float | None = None
    done_s: float | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    predicted_hit_tokens: int | None = None
    worker: str | None = None
    served_port: int | None = None
    reuse_available: int | None = None
    reuse_captured: int | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def e2e_s(self) -> float | None:
        return None if self.done_s is None else self.done_s - self.sent_s


@dataclass(frozen=True, slots=True)
class EngineTotals:
    """One worker's counters over the run (differences of ``/sim/state`` stats)."""

    requests: int
    prompt_tokens: int
    cached_tokens: int
    evicted_blocks: int = 0

    @property
    def uncached_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens


@dataclass(frozen=True, slots=True)
class Prediction:
    """Cortex's predicted hit (header) against the engine's ``cached_tokens``, per request."""

    requests: int
    exact: int
    under: int
    over: int
    over_tokens: int
    abs_error_tokens: int

    @property
    def over_fraction(self) -> float:
        return self.over / self.requests if self.requests else 0.0

    @property
    def exact_fraction(self) -> float:
        return self.exact / self.requests if self.requests else 0.0

    @property
    def mean_abs_error(self) -> float:
        return self.abs_error_tokens / self.requests if self.requests else 0.0


@dataclass(frozen=True, slots=True)
class ReuseTotals:
    """Cortex's reuse accounting summed over the requests whose answer carried it (tokens):
    ``available`` (the longest prefix any worker held), ``captured`` (what the serving
    worker held), ``delivered`` (the engine's ``cached_tokens``); and how many requests
    broke ``delivered <= captured <= available``."""

    requests: int
    available: int
    captured: int
    delivered: int
    captured_over_available: int
    delivered_over_captured: int

    @property
    def holds(self) -> bool:
        """``delivered <= captured <= available`` on every request."""
        return not (self.captured_over_available or self.delivered_over_captured)


def _reuse(ok: Sequence[Outcome]) -> ReuseTotals | None:
    rows = [(o.reuse_available, o.reuse_captured, o.cached_tokens or 0) for o in ok
            if o.reuse_available is not None and o.reuse_captured is not None]
    if not rows:
        return None
    return ReuseTotals(len(rows), sum(a for a, _, _ in rows), sum(c for _, c, _ in rows),
                       sum(d for _, _, d in rows), sum(c > a for a, c, _ in rows),
                       sum(d > c for _, c, d in rows))


@dataclass(frozen=True, slots=True)
class StageSummary:
    """One rate-ladder step."""

    stage: int
    rate: float
    requests: int
    ok: int
    hit_rate: float
    ttft_p50_ms: float
    ttft_p90_ms: float


@dataclass(frozen=True, slots=True)
class RunSummary:
    """Everything the report says about one (workload, contender) run."""

    workload: str
    contender: str
    requests_expected: int
    requests_sent: int
    requests_ok: int
    failures: Mapping[str, int]
    prompt_tokens: int
    cached_tokens: int
    ttft_ms: tuple[float, float, float]
    e2e_ms: tuple[float, float, float]
    duration_s: float
    output_tokens: int
    digest_mismatches: int
    prompt_mismatches: int
    completion_mismatches: int
    send_lag_p99_ms: float
    workers: Mapping[str, EngineTotals]
    prediction: Prediction | None
    stages: tuple[StageSummary, ...] = ()
    reuse: ReuseTotals | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def throughput_rps(self) -> float:
        return self.requests_ok / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def engine_prompt_tokens(self) -> int:
        return sum(w.prompt_tokens for w in self.workers.values())

    @property
    def engine_cached_tokens(self) -> int:
        return sum(w.cached_tokens for w in self.workers.values())

    @property
    def engine_requests(self) -> int:
        return sum(w.requests for w in self.workers.values())

    def imbalance(self, what: str = "requests") -> float:
        """max / mean over workers of ``requests`` or ``uncached_tokens`` (1.0 = even)."""
        values = [float(getattr(w, what)) for w in self.workers.values()]
        mean = sum(values) / len(values) if values else 0.0
        return max(values) / mean if mean > 0 else 1.0

    @property
    def engine_agrees(self) -> bool:
        """The engines counted exactly the requests and tokens the client saw answered."""
        return (not self.workers or (self.engine_requests == self.requests_ok
                                     and self.engine_prompt_tokens == self.prompt_tokens
                                     and self.engine_cached_tokens == self.cached_tokens))

    @property
    def problems(self) -> list[str]:
        """Why this run does not count (empty when it does)."""
        out = []
        if self.requests_sent != self.requests_expected:
            out.append(f"sent {self.requests_sent} of {self.requests_expected} requests")
        if self.digest_mismatches:
            out.append(f"{self.digest_mismatches} request bodies differ from the list")
        if self.requests_ok != self.requests_expected:
            out.append(f"{self.requests_expected - self.requests_ok} requests failed "
                       f"({dict(self.failures)})")
        if self.prompt_mismatches:
            out.append(f"{self.prompt_mismatches} prompt token counts differ from expected")
        if self.completion_mismatches:
            out.append(f"{self.completion_mismatches} completion token counts differ")
        if not self.engine_agrees:
            out.append("engine counters disagree with the client's")
        return out

    @property
    def verified(self) -> bool:
        return not self.problems


def _ms(values: Sequence[float]) -> tuple[float, float, float]:
    return (percentile(values, 50) * 1e3, percentile(values, 90) * 1e3,
            percentile(values, 99) * 1e3)


def _prediction(ok: Sequence[Outcome]) -> Prediction | None:
    pairs = [(o.predicted_hit_tokens, o.cached_tokens or 0) for o in ok
             if o.predicted_hit_tokens is not None]
    if not pairs:
        return None
    return Prediction(
        requests=len(pairs),
        exact=sum(p == a for p, a in pairs),
        under=sum(p < a for p, a in pairs),
        over=sum(p > a for p, a in pairs),
        over_tokens=sum(max(p - a, 0) for p, a in pairs),
        abs_error_tokens=sum(abs(p - a) for p, a in pairs))


def summarize(workload: str, contender: str, outcomes: Sequence[Outcome],
              expected_digests: Sequence[str], expected_prompt_tokens: Sequence[int],
              expected_completion_tokens: Sequence[int],
              workers: Mapping[str, EngineTotals] | None = None,
              stage_of: Sequence[int] = (), stage_rates: Sequence[float] = (),
              extra: Mapping[str, Any] | None = None,
              duration_s: float | None = None) -> RunSummary:
    """One run's summary. ``outcomes`` holds one entry per request *sent* (any order);
    the ``expected_*`` sequences are indexed by request id. ``duration_s`` overrides the
    span from the first send to the last completion (throughput's denominator)."""
    n = len(expected_digests)
    by_id = {o.id: o for o in outcomes}
    ok = [o for o in outcomes if o.ok]
    failures = Counter(o.error for o in outcomes if o.error is not None)
    missing = n - sum(1 for i in by_id if 0 <= i < n)
    if missing:
        failures["not sent"] += missing
    starts = [o.sent_s for o in outcomes]
    ends = [o.done_s for o in ok if o.done_s is not None]
    duration = max(ends) - min(starts) if ends and starts else 0.0
    if duration_s is not None:
        duration = duration_s
    stages = []
    for k, rate in enumerate(stage_rates):
        members = [o for o in outcomes if 0 <= o.id < len(stage_of) and stage_of[o.id] == k]
        good = [o for o in members if o.ok]
        prompt = sum(o.prompt_tokens or 0 for o in good)
        ttft = [o.ttft_s for o in good if o.ttft_s is not None]
        stages.append(StageSummary(
            k, rate, len(members), len(good),
            sum(o.cached_tokens or 0 for o in good) / prompt if prompt else 0.0,
            percentile(ttft, 50) * 1e3, percentile(ttft, 90) * 1e3))
    return RunSummary(
        workload=workload, contender=contender, requests_expected=n,
        requests_sent=len(by_id), requests_ok=len(ok), failures=dict(failures),
        prompt_tokens=sum(o.prompt_tokens or 0 for o in ok),
        cached_tokens=sum(o.cached_tokens or 0 for o in ok),
        ttft_ms=_ms([o.ttft_s for o in ok if o.ttft_s is not None]),
        e2e_ms=_ms([e for o in ok if (e := o.e2e_s) is not None]),
        duration_s=duration,
        output_tokens=sum(o.completion_tokens or 0 for o in ok),
        digest_mismatches=sum(1 for o in outcomes
                              if not 0 <= o.id < n or o.digest != expected_digests[o.id]),
        prompt_mismatches=sum(1 for o in ok if o.prompt_tokens != expected_prompt_tokens[o.id]),
        completion_mismatches=sum(1 for o in ok
                                  if o.completion_tokens != expected_completion_tokens[o.id]),
        send_lag_p99_ms=percentile([o.sent_s - o.scheduled_s for o in outcomes], 99) * 1e3,
        workers=dict(workers or {}),
        prediction=_prediction(ok),
        stages=tuple(stages),
        reuse=_reuse(ok),
        extra=dict(extra or {}))


def pool(runs: Sequence[tuple[RunSummary, Sequence[Outcome]]], expected_digests: Sequence[str],
         expected_prompt_tokens: Sequence[int], expected_completion_tokens: Sequence[int],
         stage_of: Sequence[int] = (), stage_rates: Sequence[float] = (),
         extra: Mapping[str, Any] | None = None) -> RunSummary:
    """Repetitions of one (workload, contender) as one summary: the request list once per
    repetition (ids shifted by ``n`` each time), percentiles over every request, engine
    counters summed per worker, throughput over the summed durations."""
    if not runs:
        raise ValueError("nothing to pool")
    n = len(expected_digests)
    outcomes: list[Outcome] = []
    workers: dict[str, EngineTotals] = {}
    for k, (summary, outs) in enumerate(runs):
        outcomes.extend(dataclasses.replace(o, id=o.id + k * n) for o in outs)
        for wid, t in summary.workers.items():
            prev = workers.get(wid, EngineTotals(0, 0, 0, 0))
            workers[wid] = EngineTotals(prev.requests + t.requests,
                                        prev.prompt_tokens + t.prompt_tokens,
                                        prev.cached_tokens + t.cached_tokens,
                                        prev.evicted_blocks + t.evicted_blocks)
    k = len(runs)
    first = runs[0][0]
    return summarize(first.workload, first.contender, outcomes, list(expected_digests) * k,
                     list(expected_prompt_tokens) * k, list(expected_completion_tokens) * k,
                     workers, stage_of=list(stage_of) * k, stage_rates=stage_rates,
                     extra=extra, duration_s=sum(s.duration_s for s, _ in runs))
