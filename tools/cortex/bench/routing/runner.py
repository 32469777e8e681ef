"""One workload against every contender: bounds first, then each contender on fresh sims.

Per (workload, contender, repetition): start the deployment, measure the proxy alone (idle
TTFT), read the engines' counters, replay the workload, read the counters again once every
engine is idle, and summarize. Repetitions alternate the contender order (A B C D, then
D C B A…) so slow phases of a shared machine do not always hit the same contender; the
headline numbers pool every repetition's requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from cortex.bench.routing.bounds import (
    PromptShape,
    infinite_cache_hit_rate,
    nominal_order,
    pooled_lru_hit_rate,
    unique_pages,
)
from cortex.bench.routing.churn import ChurnRecord, churn_driver
from cortex.bench.routing.client import drive, idle_ttft
from cortex.bench.routing.contenders import (
    VARIANT_ONLY,
    CpuMeter,
    Deployment,
    SimSetup,
    Topology,
    deploy,
    machine_busy_cores,
    missing_program,
    pinned,
)
from cortex.bench.routing.metrics import (
    EngineTotals,
    Outcome,
    RunSummary,
    percentile,
    pool,
    summarize,
)
from cortex.bench.routing.report import WorkloadResult, ttft_values_ms
from cortex.bench.routing.scenarios import (
    Variant,
    WindowStats,
    stale_sends,
    window_stats,
)
from cortex.bench.routing.workloads import Workload
from cortex.hashing import Engine

__all__ = ["EVENT_ALLOWANCE_S", "RunPlan", "run_workload", "wait_for_quiet", "worker_capacity"]

EVENT_ALLOWANCE_S = 1.0
"""After a churn event, the time allowed for its KV events to reach every router (s): an
over-prediction on the worker later than this counts against the target."""


@dataclass(frozen=True, slots=True)
class RunPlan:
    """What every run of a workload shares: the sims (KV pool set per workload), who runs,
    how often, Cortex's routing weights and where the process logs go.

    Noise control on a shared machine: before each run wait up to ``quiet_wait_s`` for other
    work to drop under ``quiet_cores``; a run during which other work took more than
    ``max_foreign_cores`` cores is discarded and run again, at most ``noisy_retries`` times
    (the discarded runs are reported)."""

    sims: SimSetup
    contenders: tuple[str, ...]
    repeats: int
    cortex_weights: Mapping[str, float]
    logs: Path
    timeout_s: float = 300.0
    capacity_fraction: float = 0.3
    quiet_wait_s: float = 0.0
    quiet_cores: float = 0.3
    max_foreign_cores: float = math.inf
    noisy_retries: int = 0
    idle_probes: int = 15
    pin: bool = False  # the routing tier on its own core (routing_contenders.pinned)


def worker_capacity(fraction: float, working_set_pages: int, largest_request_pages: int) -> int:
    """Each worker's KV pool (blocks): ``fraction`` of the workload's distinct prompt pages,
    but room for four of its largest requests at once (and never under 256)."""
    return max(math.ceil(fraction * working_set_pages), 4 * largest_request_pages, 256)


def pool_fraction(default: float, workload: Workload, variant: Variant | None) -> float:
    """The fraction :func:`worker_capacity` sizes a run's pools by: the variant's, else the
    workload's, else ``default`` (the profile's)."""
    if variant is not None and variant.capacity_fraction is not None:
        return variant.capacity_fraction
    return workload.capacity_fraction or default


# ---- engine counters --------------------------------------------------------------------------


async def _sim_states(workers: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:

        async def one(url: str) -> dict[str, Any]:
            async with session.get(url + "/sim/state") as resp:
                resp.raise_for_status()
                state: dict[str, Any] = await resp.json()
                return state

        states = await asyncio.gather(*(one(url) for url in workers.values()))
    return dict(zip(workers, states, strict=True))


async def _settled(workers: Mapping[str, str], timeout_s: float = 15.0) -> dict[str, Any]:
    """Sim states once nothing runs or waits on any worker (bounded poll)."""
    deadline = time.monotonic() + timeout_s
    while True:
        states = await _sim_states(workers)
        if all(s["running"] == 0 and s["waiting"] == 0 for s in states.values()):
            return states
        if time.monotonic() > deadline:
            return states
        await asyncio.sleep(0.05)


def _totals(before: Mapping[str, Any], after: Mapping[str, Any]) -> dict[str, EngineTotals]:
    out = {}
    for wid, state in after.items():
        s0, s1 = before[wid]["stats"], state["stats"]
        out[wid] = EngineTotals(
            requests=s1["requests_finished"] - s0["requests_finished"],
            prompt_tokens=s1["prompt_tokens"] - s0["prompt_tokens"],
            cached_tokens=s1["cached_tokens"] - s0["cached_tokens"],
            evicted_blocks=state["cache"]["evicted_blocks"]
            - before[wid]["cache"]["evicted_blocks"])
    return out


def _engine_ttft_ms(before: Mapping[str, Any], after: Mapping[str, Any]) -> float | None:
    """The engines' mean share of the time to first token over the run (ms): from a
    request reaching a sim's HTTP handler to its first token; the rest of the client's
    TTFT is the router's and the network's. ``None`` when no sim counted one."""
    streams = us = 0
    for wid, state in after.items():
        s0, s1 = before[wid]["stats"], state["stats"]
        streams += s1.get("first_token_streams", 0) - s0.get("first_token_streams", 0)
        us += s1.get("first_token_us", 0) - s0.get("first_token_us", 0)
    return round(us / streams / 1000, 2) if streams else None


_TIMED = {"cortex_gateway_upstream_first_byte_seconds": "upstream first byte",
          "cortex_gateway_ttft_seconds": "first token out"}
"""Gateway histograms reported beside the routing stages: the worker's time to its first byte
(from the attempt) and the gateway's time to the first token it sent (from the request)."""


async def _gateway_counters(d: Deployment) -> dict[tuple[str, str], float]:
    """Cortex's decision counters and routing-stage time sums, summed over its gateways
    (``{}`` for peers)."""
    if not d.contender.startswith("cortex"):
        return {}
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[tuple[str, str], float] = {}

    def add(key: tuple[str, str], value: float) -> None:
        out[key] = out.get(key, 0.0) + value

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        for url in d.gateway_urls:
            async with session.get(url + "/metrics") as resp:
                text = await resp.text()
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    if (key := _counter_key(sample.name, sample.labels)) is not None:
                        add(key, sample.value)
    return out


def _counter_key(name: str, labels: Mapping[str, str]) -> tuple[str, str] | None:
    """Where a gateway metric sample adds up in :func:`_gateway_counters` (``None``: not
    used); stage timings are summed over workers and modes."""
    if name == "cortex_gateway_decisions_total":
        return ("decisions", f"{labels.get('mode')}/{labels.get('reason')}")
    if name == "cortex_gateway_routing_seconds_bucket":
        return ("routing_bucket", labels.get("le", "")) if labels.get("stage") == "total" \
            else None
    if name in ("cortex_gateway_routing_seconds_sum", "cortex_gateway_routing_seconds_count"):
        return (f"routing_{name.rpartition('_')[2]}", labels.get("stage", ""))
    stage = _TIMED.get(name.rpartition("_")[0])
    kind = name.rpartition("_")[2]
    return (f"routing_{kind}", stage) if stage is not None and kind in ("sum", "count") else None


def _gateway_delta(before: Mapping[tuple[str, str], float],
                   after: Mapping[tuple[str, str], float]) -> dict[str, Any] | None:
    """What the gateway decided during the run and its mean routing time per stage (ms)."""
    if not after:
        return None
    delta = {k: v - before.get(k, 0.0) for k, v in after.items()}
    decisions = {k[1]: int(v) for k, v in delta.items() if k[0] == "decisions" and v}
    stages = {}
    for (kind, stage), total in delta.items():
        count = delta.get(("routing_count", stage), 0.0)
        if kind == "routing_sum" and count:
            stages[stage] = round(total / count * 1e3, 3)
    return {"decisions": decisions, "routing_ms_mean": stages,
            "routing_ms_p50": _histogram_p50_ms(delta)}


def _histogram_p50_ms(delta: Mapping[tuple[str, str], float]) -> float | None:
    """The median total routing time (ms) from the histogram's bucket deltas, interpolated
    linearly inside the bucket that holds it."""
    buckets = sorted((float(le), n) for (kind, le), n in delta.items()
                     if kind == "routing_bucket")
    if not buckets or buckets[-1][1] <= 0:
        return None
    half = buckets[-1][1] / 2
    lower, below = 0.0, 0.0
    for upper, count in buckets:
        if count >= half:
            if upper == float("inf"):
                return round(lower * 1e3, 3)
            share = (half - below) / (count - below) if count > below else 1.0
            return round((lower + share * (upper - lower)) * 1e3, 3)
        lower, below = upper, count
    return None


# ---- one run -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Expected:
    digests: list[str]
    prompt_tokens: list[int]
    completion_tokens: list[int]
    stage_of: list[int]
    shapes: Sequence[PromptShape]


def _worker_of(d: Deployment, outcomes: Sequence[Outcome]) -> dict[int, str]:
    """Request id -> the worker that answered it (the sim's port header, else Cortex's
    assigned-worker header); PD runs have no single serving worker and map nothing."""
    if d.prefill:
        return {}
    by_port = {int(url.rsplit(":", 1)[1]): wid for wid, url in d.workers.items()}
    out = {}
    for o in outcomes:
        wid = by_port.get(o.served_port) if o.served_port is not None else o.worker
        if wid is not None:
            out[o.id] = wid
    return out


def _churn_windows(records: Sequence[ChurnRecord], outcomes: Sequence[Outcome],
                   worker_of: Mapping[int, str], window_s: float) -> list[dict[str, Any]]:
    """Per churn event: what happened and the requests sent in the window after it, and
    over-predictions on its worker from :data:`EVENT_ALLOWANCE_S` after it on."""
    end = max((o.sent_s for o in outcomes), default=0.0) + 1e-9
    out = []
    for r in records:
        item: dict[str, Any] = {"action": r.action.value, "worker": r.worker,
                                "planned_s": round(r.planned_s, 2), "attempts": r.attempts,
                                "at_s": None if r.at_s is None else round(r.at_s, 3)}
        if r.at_s is not None:
            stop = min(r.at_s + window_s, end) if window_s else end
            w = window_stats(outcomes, worker_of, r.worker, r.at_s, stop)
            late = window_stats(outcomes, worker_of, r.worker, r.at_s + EVENT_ALLOWANCE_S, stop)
            before = window_stats(outcomes, worker_of, r.worker,
                                  max(r.at_s - (stop - r.at_s), 0.0), r.at_s)
            item |= {"window_s": round(stop - r.at_s, 2), **_window_json(w),
                     "before": _window_json(before),
                     "over_predictions_after_allowance": late.over_predictions}
        out.append(item)
    return out


def _window_json(w: WindowStats) -> dict[str, Any]:
    def num(x: float, digits: int) -> float | None:
        return None if math.isnan(x) else round(x, digits)

    return {"requests": w.requests, "hit_rate": num(w.hit_rate, 4),
            "ttft_p50_ms": num(w.ttft_p50_ms, 2), "ttft_p90_ms": num(w.ttft_p90_ms, 2),
            "worker_requests": w.worker_requests, "worker_hit_rate": num(w.worker_hit_rate, 4),
            "over_predictions": w.over_predictions}


async def _measure(d: Deployment, workload: Workload, expected: _Expected, model: str,
                   plan: RunPlan, busy_before: float | None, variant: Variant | None
                   ) -> tuple[RunSummary, list[Outcome]]:
    idle = await idle_ttft(d.url, model, plan.idle_probes)
    before = await _settled(d.workers)
    gateway_before = await _gateway_counters(d)
    records: list[ChurnRecord] = []
    during = None
    if variant is not None and variant.churn:
        during = churn_driver(variant.churn, d.workers, workload.open_loop_span_s, records)
    meter = CpuMeter(d.pids)
    outcomes = await drive(workload, d.url, model, timeout_s=plan.timeout_s, during=during)
    cpu = meter.stop()
    after = await _settled(d.workers)
    gateway = _gateway_delta(gateway_before, await _gateway_counters(d))
    totals = _totals(before, after)
    checked = {w: t for w, t in totals.items() if not d.prefill or w in d.prefill}
    worker_of = _worker_of(d, outcomes)
    stale = stale_sends(expected.shapes, outcomes, worker_of, plan.sims.block_size)
    summary = summarize(
        workload.name, d.contender, outcomes, expected.digests, expected.prompt_tokens,
        expected.completion_tokens, checked, stage_of=expected.stage_of,
        stage_rates=workload.stages,
        extra={"idle_ttft_p50_ms": round(percentile(idle, 50) * 1e3, 2) if idle else None,
               "engine_ttft_mean_ms": _engine_ttft_ms(before, after),
               "cpu": cpu, "startup_s": round(d.startup_s, 2), "gateway": gateway,
               "busy_before_cores": None if busy_before is None else round(busy_before, 2),
               "stale": None if stale is None else dataclasses.asdict(stale),
               "decode_pool": {w: dataclasses.asdict(t) for w, t in totals.items()
                               if w not in checked} or None,
               "churn": _churn_windows(records, outcomes, worker_of, variant.window_s)
               if variant is not None and variant.churn else None})
    return summary, outcomes


def _rep_record(s: RunSummary) -> dict[str, Any]:
    cpu = s.extra.get("cpu", {})
    return {"hit_rate": round(s.hit_rate, 4), "ttft_p50_ms": round(s.ttft_ms[0], 2),
            "ttft_p90_ms": round(s.ttft_ms[1], 2), "ttft_p99_ms": round(s.ttft_ms[2], 2),
            "throughput_rps": round(s.throughput_rps, 3), "requests_ok": s.requests_ok,
            "verified": s.verified, "problems": s.problems,
            "idle_ttft_p50_ms": s.extra.get("idle_ttft_p50_ms"),
            "engine_ttft_mean_ms": s.extra.get("engine_ttft_mean_ms"),
            "ours_cores": cpu.get("ours_cores"), "foreign_cores": cpu.get("foreign_cores"),
            "cpu_s": cpu.get("processes"), "busy_before_cores": s.extra.get("busy_before_cores"),
            "send_lag_p99_ms": round(s.send_lag_p99_ms, 2), "gateway": s.extra.get("gateway"),
            "stale": s.extra.get("stale"), "churn": s.extra.get("churn")}


def _summed(parts: Sequence[Mapping[str, int] | None]) -> dict[str, int] | None:
    """Per-run counters (``stale``) added up over repetitions."""
    present = [p for p in parts if p]
    if not present:
        return None
    return {k: sum(int(p.get(k, 0)) for p in present) for k in present[0]}


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def wait_for_quiet(plan: RunPlan, log: Callable[[str], None]) -> float:
    """Wait up to ``plan.quiet_wait_s`` for the machine to be nearly idle (other work under
    ``plan.quiet_cores`` cores) before a run starts; returns the last busy sample (cores)."""
    deadline = time.monotonic() + plan.quiet_wait_s
    busy = machine_busy_cores(0.5)
    waited = False
    while busy > plan.quiet_cores and time.monotonic() < deadline:
        waited = True
        busy = machine_busy_cores(1.0)
    if waited:
        log(f"    machine busy with other work: {busy:.2f} cores before this run")
    return busy


def run_workload(workload: Workload, shapes: Sequence[PromptShape], plan: RunPlan,
                 log: Callable[[str], None] = _log, variant: Variant | None = None
                 ) -> WorkloadResult:
    """Bounds, then every contender ``plan.repeats`` times on fresh sims (deployed and
    disturbed as ``variant`` says; its contenders only)."""
    page = plan.sims.block_size
    order = nominal_order(workload)
    pages = unique_pages(shapes)
    largest = max(s.tokens + r.max_tokens for s, r in zip(shapes, workload.requests,
                                                          strict=True))
    largest_pages = -(-largest // page)
    capacity = (worker_capacity(pool_fraction(plan.capacity_fraction, workload, variant),
                                pages, largest_pages)
                if workload.kv_blocks is None else max(workload.kv_blocks, 2 * largest_pages))
    host = 0
    if variant is not None and variant.host_fraction:
        host = max(int(variant.host_fraction * pages), largest_pages)
    sims = dataclasses.replace(plan.sims, kv_capacity_blocks=capacity,
                               host_capacity_blocks=host,
                               engine=Engine(workload.engine) if workload.engine
                               else plan.sims.engine)
    prompt_tokens = sum(s.tokens for s in shapes)
    nominal: dict[int, float] = {}
    for r in workload.requests:
        nominal[r.id] = r.at_s if r.after is None else nominal[r.after] + r.at_s
    span = max(nominal.values(), default=0.0) or 1.0
    offered = prompt_tokens * sims.prefill_ms_per_token / 1e3 / (span * sims.workers)
    res = WorkloadResult(
        workload, prompt_tokens, infinite_cache_hit_rate(shapes, order, page),
        pooled_lru_hit_rate(shapes, order, page, capacity * sims.workers), pages, capacity,
        offered, single_worker_bound=pooled_lru_hit_rate(shapes, order, page, capacity))
    log(f"{workload.name}: {len(workload.requests)} requests, bound {res.infinite_bound:.1%},"
        f" pooled LRU {res.pooled_bound:.1%}, one worker's LRU {res.single_worker_bound:.1%},"
        f" {capacity} blocks per worker, offered prefill load {offered:.0%}")
    reqs = workload.requests
    expected = _Expected([r.digest() for r in reqs], [s.tokens for s in shapes],
                         [r.max_tokens for r in reqs], [r.stage for r in reqs], shapes)
    contenders = tuple(c for c in plan.contenders
                       if c in variant.contenders or (not variant.contenders and
                       c not in VARIANT_ONLY)) if variant is not None else tuple(
        c for c in plan.contenders if c not in VARIANT_ONLY)
    topology = Topology() if variant is None else Topology(variant.replicas, variant.pd)
    missing = {c: why for c in contenders if (why := missing_program(c, topology))}
    for c, why in missing.items():
        log(f"  {c}: skipped, {why}")
        res.skipped[c] = why
    contenders = tuple(c for c in contenders if c not in missing)
    done: dict[str, list[tuple[RunSummary, list[Outcome]]]] = {c: [] for c in contenders}
    discarded: dict[str, list[dict[str, Any]]] = {c: [] for c in contenders}
    for rep in range(plan.repeats):
        order_c = contenders if rep % 2 == 0 else tuple(reversed(contenders))
        for contender in order_c:
            for attempt in range(plan.noisy_retries + 1):
                summary, outcomes = _one_run(workload, expected, sims, plan, contender,
                                             f"{contender}-{rep}-{attempt}", log, variant,
                                             topology)
                foreign = summary.extra["cpu"]["foreign_cores"]
                if foreign <= plan.max_foreign_cores or attempt == plan.noisy_retries:
                    break
                log(f"    other work took {foreign} cores during this run (limit"
                    f" {plan.max_foreign_cores}): discarded, run again")
                discarded[contender].append(_rep_record(summary))
            done[contender].append((summary, outcomes))
    for contender, runs in done.items():
        first = runs[0][0]
        res.runs[contender] = pool(
            runs, expected.digests, expected.prompt_tokens, expected.completion_tokens,
            expected.stage_of, workload.stages,
            extra={"repeats": [_rep_record(s) for s, _ in runs],
                   "discarded_noisy_runs": discarded[contender],
                   "idle_ttft_p50_ms": _median([s.extra.get("idle_ttft_p50_ms")
                                                for s, _ in runs]),
                   "engine_ttft_mean_ms": _median([s.extra.get("engine_ttft_mean_ms")
                                                   for s, _ in runs]),
                   "ttft_mean_ms": _mean_ms([o.ttft_s for _, outs in runs for o in outs
                                             if o.ok and o.ttft_s is not None]),
                   "cpu": {"ours_cores": _median([s.extra["cpu"]["ours_cores"]
                                                  for s, _ in runs]),
                           "foreign_cores": _median([s.extra["cpu"]["foreign_cores"]
                                                     for s, _ in runs])},
                   "startup_s": first.extra.get("startup_s"),
                   "gateway": _merge_gateway([s.extra.get("gateway") for s, _ in runs]),
                   "stale": _summed([s.extra.get("stale") for s, _ in runs]),
                   "decode_pool": first.extra.get("decode_pool"),
                   "churn": first.extra.get("churn")})
        res.ttfts_ms[contender] = ttft_values_ms([o.ttft_s for _, outs in runs for o in outs
                                                 if o.ok])
    return res


def _merge_gateway(parts: Sequence[dict[str, Any] | None]) -> dict[str, Any] | None:
    present = [p for p in parts if p]
    if not present:
        return None
    decisions: dict[str, int] = {}
    stages: dict[str, list[float]] = {}
    for p in present:
        for key, n in p["decisions"].items():
            decisions[key] = decisions.get(key, 0) + n
        for stage, ms in p["routing_ms_mean"].items():
            stages.setdefault(stage, []).append(ms)
    p50s = [p["routing_ms_p50"] for p in present if p.get("routing_ms_p50") is not None]
    return {"decisions": dict(sorted(decisions.items(), key=lambda kv: -kv[1])),
            "routing_ms_mean": {k: round(sum(v) / len(v), 3) for k, v in stages.items()},
            "routing_ms_p50": round(statistics.median(p50s), 3) if p50s else None}


def _one_run(workload: Workload, expected: _Expected, sims: SimSetup, plan: RunPlan,
             contender: str, name: str, log: Callable[[str], None], variant: Variant | None,
             topology: Topology) -> tuple[RunSummary, list[Outcome]]:
    busy_before = wait_for_quiet(plan, log) if plan.quiet_wait_s > 0 else None
    with deploy(contender, sims, plan.logs / workload.name / name, plan.cortex_weights,
                topology) as d, pinned(d) if plan.pin else contextlib.nullcontext():
        summary, outcomes = asyncio.run(_measure(d, workload, expected, sims.model, plan,
                                                 busy_before, variant))
    _write_outcomes(plan.logs / workload.name / name / "outcomes.jsonl", outcomes)
    t = summary.ttft_ms
    cpu = summary.extra["cpu"]
    ttfts = [o.ttft_s for o in outcomes if o.ok and o.ttft_s is not None]
    mean = sum(ttfts) / len(ttfts) * 1e3 if ttfts else math.nan
    log(f"  {contender} ({name}): {summary.requests_ok}/{summary.requests_expected} ok, hit"
        f" {summary.hit_rate:.1%}, TTFT p50/p90/p99 {t[0]:.1f}/{t[1]:.1f}/{t[2]:.1f} ms,"
        f" mean {mean:.1f} ms (engines {summary.extra.get('engine_ttft_mean_ms')}),"
        f" {summary.throughput_rps:.1f} req/s, cores ours {cpu['ours_cores']} foreign"
        f" {cpu['foreign_cores']}"
        + ("" if summary.verified else f"  NOT VERIFIED: {summary.problems}"))
    return summary, outcomes


def _write_outcomes(path: Path, outcomes: Sequence[Outcome]) -> None:
    """One JSON line per request (kept with ``--keep-logs``): to see where a run's time went
    (which worker served what, when it was sent, its TTFT and hit) after the fact."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for o in outcomes:
            f.write(json.dumps(dataclasses.asdict(o)) + "\n")


def _mean_ms(seconds: Sequence[float]) -> float | None:
    return round(sum(seconds) / len(seconds) * 1e3, 2) if seconds else None


def _median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return round(percentile(present, 50), 2) if present else None
