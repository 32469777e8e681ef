"""``cortex bench faults``: the fault suite of issue 14, as a tool.

A ``cortex up``-style cluster (:class:`~cortex.devcluster.cluster.LocalCluster`: private Redis,
index, ingest, 2 gateways, 3 simulated SGLang workers) serves steady bounded load
(:class:`~cortex.bench.faults_load.LoadGenerator`) and a canary that tells when exact-KV hits
are served. Each fault of :mod:`cortex.bench.faults_catalogue` is injected in turn, from a
healthy cluster: inject, hold, repair (restart what was killed, clear what was armed),
observe until the canary serves exact hits again (or ``--observe`` passes), then *restore*
(clear sim faults, re-register workers the cluster lost, wait until it is ready) before the
next one. Per fault: requests started in the window, failed, hung (slower than ``--hung``),
the slowest, when exact hits were back, and what the fault itself measured.

Writes ``faults.md`` and ``faults.json`` into ``--out`` (``docs/bench``). ``--quick`` runs a
few faults with short holds (the CI test runs it). Honest by construction: nothing the
cluster should do by itself is done for it during the measurement.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cortex.bench.faults_answers import ANSWERS
from cortex.bench.faults_catalogue import FAULTS as CATALOGUE
from cortex.bench.faults_catalogue import QUICK, Bench, Fault, wait_for
from cortex.bench.faults_hostile import HOSTILE
from cortex.bench.faults_load import Canary, LoadGenerator, LoopThread, Record
from cortex.bench.faults_removal import OverCapacity, SourceRemoval
from cortex.bench.faults_wedge import WEDGE
from cortex.bench.report import provenance, table
from cortex.devcluster.cluster import ClusterError, ClusterSpec, LocalCluster

__all__ = ["FAULTS", "Plan", "register", "run"]

FAULTS: tuple[type[Fault], ...] = (*HOSTILE, *ANSWERS, *WEDGE, SourceRemoval, OverCapacity,
                                     *CATALOGUE)
"""Every case: issue 32's hostile clients, broken workers (also on PD legs and passthrough
models), busy and wedged workers on side gateways, and the large source's removal (they
leave the cluster whole), then issue 14's."""


@dataclass(frozen=True, slots=True)
class Plan:
    """What to run; times in seconds, ``rate`` in requests/s."""

    faults: tuple[str, ...]
    quick: bool = False
    hold_s: float = 8.0
    hang_hold_s: float = 14.0
    observe_s: float = 30.0
    baseline_s: float = 3.0
    hung_s: float = 10.0
    timeout_s: float = 30.0
    clients: int = 4
    rate: float = 8.0
    lease_ttl_s: float = 10.0
    long_generation_s: float = 60.0

    @classmethod
    def quick_plan(cls, faults: Sequence[str] | None = None) -> Plan:
        return cls(faults=tuple(faults or QUICK), quick=True, hold_s=2.0, hang_hold_s=4.0,
                   observe_s=8.0, baseline_s=1.0, hung_s=3.0, timeout_s=8.0, clients=2,
                   rate=4.0, lease_ttl_s=4.0)


@dataclass
class FaultResult:
    name: str
    title: str
    requests: int = 0
    failed: int = 0
    failures: dict[str, int] = field(default_factory=dict)
    hung: int = 0
    slowest_s: float = 0.0
    p50_s: float = 0.0
    failovers: int = 0
    canary_probes: int = 0
    exact_back_s: float | None = None  # since the injection; 0: never lost
    exact_lost_s: float = 0.0
    notes: dict[str, Any] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    restore: str = ""


def _window(records: Sequence[Record], start: float, end: float) -> list[Record]:
    return [r for r in list(records) if start <= r.started < end]


def _exact_recovery(canary: Sequence[Record], start: float) -> tuple[float | None, float]:
    """(exact hits back after s since ``start`` — 0 when never lost, ``None`` when not back
    by the end —, time without exact hits in s)."""
    probes = sorted(canary, key=lambda r: r.started)
    lost = 0.0
    last_miss = None
    for i, probe in enumerate(probes):
        if not probe.exact:
            last_miss = i
            following = probes[i + 1].started if i + 1 < len(probes) else probe.started
            lost += max(following - probe.started, probe.duration_s)
    if last_miss is None:
        return 0.0, 0.0
    back = probes[last_miss + 1:]
    return (None if not back else round(back[0].started - start, 2)), round(lost, 2)


def _canary_back(canary: Canary, since: float, run: int = 3) -> bool:
    recent = [r for r in list(canary.records) if r.started >= since][-run:]
    return len(recent) == run and all(r.exact for r in recent)


def run_fault(b: Bench, fault: Fault, plan: Plan) -> FaultResult:
    """Inject, hold, repair, observe; the result of the requests of that window."""
    result = FaultResult(fault.name, fault.title)
    failovers = b.load.failovers
    start = time.monotonic()
    print(f"  {fault.name}: {fault.title}", file=sys.stderr, flush=True)
    try:
        fault.inject(b)
    except Exception as exc:  # a fault that cannot be set up is reported, not fatal
        result.errors.append(f"inject: {type(exc).__name__}: {exc}")
    hold = {"normal": plan.hold_s, "long": plan.hang_hold_s, "none": 0.0,
            "lease": plan.lease_ttl_s + 2.0}[fault.hold]
    time.sleep(max(0.0, start + hold - time.monotonic()))
    repaired = time.monotonic()
    try:
        fault.repair(b)
    except Exception as exc:
        result.errors.append(f"repair: {type(exc).__name__}: {exc}")
    wait_for(lambda: _canary_back(b.canary, repaired), plan.observe_s, 0.2)
    end = time.monotonic()
    # requests started in the window and still running finish within their deadline
    wait_for(lambda: all(t >= end for t in list(b.load.inflight.values())),
             plan.timeout_s + 5.0, 0.1)
    records = _window(b.load.records, start, end)
    durations = sorted(r.duration_s for r in records)
    result.requests = len(records)
    result.failures = dict(Counter(r.error for r in records if not r.ok))
    result.failed = sum(result.failures.values())
    result.hung = sum(1 for d in durations if d > plan.hung_s)
    result.slowest_s = round(durations[-1], 2) if durations else 0.0
    result.p50_s = round(statistics.median(durations), 3) if durations else 0.0
    result.failovers = b.load.failovers - failovers
    canary = _window(b.canary.records, start, end)
    result.canary_probes = len(canary)
    result.exact_back_s, result.exact_lost_s = _exact_recovery(canary, start)
    result.notes = fault.notes
    result.restore = restore(b, plan)
    return result


def restore(b: Bench, plan: Plan) -> str:
    """Bring the cluster back to health for the next fault; how it went."""
    started = time.monotonic()
    for worker in b.worker_ids:
        with contextlib.suppress(Exception):
            b.sim_faults(worker, None)
    missing = [w for w in b.worker_ids if w not in b.registered()]
    for worker in missing:
        b.register(b.spec_of(worker))
    try:
        b.cluster.wait_ready(60.0)
    except ClusterError as exc:
        return f"not ready after 60 s: {str(exc).splitlines()[0]}"
    back = wait_for(lambda: _canary_back(b.canary, time.monotonic() - 1.0), 30.0, 0.2)
    took = time.monotonic() - started
    prefix = f"re-registered {', '.join(missing)}; " if missing else ""
    if back is None:
        return f"{prefix}ready in {took:.1f} s, but no exact canary hits within 30 s"
    return f"{prefix}ready in {took:.1f} s"


def run(plan: Plan, log_dir: Path) -> dict[str, Any]:
    """Start the cluster, run every fault of ``plan``, stop; the report as JSON data."""
    selected = [f for f in FAULTS if f.name in plan.faults]
    unknown = set(plan.faults) - {f.name for f in FAULTS}
    if unknown:
        raise ValueError(f"unknown faults {sorted(unknown)}; known: "
                         f"{', '.join(f.name for f in FAULTS)}")
    spec = ClusterSpec(workers=3, gateways=2, port=0, lease_ttl_s=plan.lease_ttl_s,
                       ready_timeout_s=120.0)
    started = time.monotonic()
    made = provenance()  # the code that runs is the code of this moment
    results: list[FaultResult] = []
    print(f"starting the cluster (logs in {log_dir}) ...", file=sys.stderr, flush=True)
    with LoopThread() as loop, LocalCluster(spec, log_dir) as cluster:
        load = LoadGenerator(list(cluster.gateway_urls), clients=plan.clients,
                             rate=plan.rate, timeout_s=plan.timeout_s)
        canary = Canary(list(cluster.gateway_urls), timeout_s=min(plan.timeout_s, 2.0))
        warmed = loop.call(canary.start())
        loop.call(load.start())
        bench = Bench(cluster, loop, load, canary, plan.hold_s, plan.hang_hold_s,
                      plan.observe_s, plan.long_generation_s)
        try:
            time.sleep(plan.baseline_s)
            baseline = _window(load.records, started, time.monotonic())
            for fault in selected:
                results.append(run_fault(bench, fault(), plan))
        finally:
            loop.call(load.stop())
            loop.call(canary.stop())
    return {
        **made,
        "plan": asdict(plan),
        "cluster": "LocalCluster: private redis-server, index, ingest, 2 gateways, "
                   "3 cortex sim SGLang workers (default timing), lease TTL "
                   f"{plan.lease_ttl_s:g} s",
        "canary_warmed": warmed,
        "baseline": {"requests": len(baseline),
                     "failed": sum(1 for r in baseline if not r.ok),
                     "exact": sum(1 for r in baseline if r.exact)},
        "duration_s": round(time.monotonic() - started, 1),
        "faults": [asdict(r) for r in results],
    }


def _seconds(value: float | None, lost: float) -> str:
    if value is None:
        return "**not back**"
    if value == 0.0:
        return "never lost"
    return f"{value:.1f} s (lost {lost:.1f} s)"


def render(report: dict[str, Any]) -> str:
    """The markdown report."""
    plan = report["plan"]
    lines = [
        "# Fault suite (`cortex bench faults`)", "",
        f"Generated {report['generated']} at commit `{report['commit']}` on "
        f"{report['machine']}; {report['duration_s']:.0f} s"
        + (" (`--quick`)" if plan["quick"] else "") + ".", "",
        f"Cluster: {report['cluster']}. Load: {plan['clients']} closed-loop clients at "
        f"{plan['rate']:g} requests/s in all (chat completions over shared system prompts, "
        f"60 % repeats, half streamed, 8 tokens), each with a {plan['timeout_s']:g} s deadline; "
        "a gateway that refuses the connection is skipped for the other (what a load "
        "balancer does). A canary sends one of 3 warmed prompts every 0.25 s (2 s deadline).",
        "",
        f"Per fault, from a healthy cluster: inject, hold ({plan['hold_s']:g} s; "
        f"{plan['hang_hold_s']:g} s for faults that can hang a client; a lease + 2 s for the "
        "worker restart; none for one-shot faults), repair, observe until the canary "
        "serves exact-KV hits again (≤ "
        f"{plan['observe_s']:g} s). *Requests* started in that window; *failed*: not a 200 "
        f"that completed; *hung*: slower than {plan['hung_s']:g} s; *exact hits back*: "
        "since the injection, when the canary's last run of exact hits began. Then the "
        "cluster is restored (sim faults cleared, lost workers re-registered, ready again) "
        "— after the measurement, never during it.", "",
        f"Baseline before the first fault: {report['baseline']['requests']} requests, "
        f"{report['baseline']['failed']} failed, {report['baseline']['exact']} exact hits.", "",
        *table(("fault", "requests", "failed", "hung", "slowest", "exact hits back",
                "fault's own numbers"),
               [(f["title"], f["requests"], f"**{f['failed']}**" if f["failed"] else "0",
                 f"**{f['hung']}**" if f["hung"] else "0", f"{f['slowest_s']:.1f} s",
                 _seconds(f["exact_back_s"], f["exact_lost_s"]),
                 "; ".join(f"{k}: {v}" for k, v in f["notes"].items()) or "—")
                for f in report["faults"]]),
    ]
    lines += ["", "## Details", ""]
    for f in report["faults"]:
        reasons = ", ".join(f"{k or 'ok'} x {v}" for k, v in f["failures"].items()) or "none"
        lines += [f"**{f['name']}** — failures: {reasons}; median {f['p50_s'] * 1000:.0f} ms; "
                  f"gateway failovers {f['failovers']}; canary probes {f['canary_probes']}; "
                  f"restore: {f['restore']}."
                  + (f" Errors: {'; '.join(f['errors'])}." if f["errors"] else ""), ""]
    lines += [
        "## Reproduce", "",
        "```sh",
        ".venv/bin/cortex bench faults            # every fault (~10 min)",
        ".venv/bin/cortex bench faults --quick    # 3 faults, short holds (CI)",
        ".venv/bin/cortex bench faults --only kill_index,redis_empty",
        "```", "",
        "Raw numbers: [faults.json](faults.json).", "",
    ]
    return "\n".join(lines)


def _main(args: argparse.Namespace) -> int:
    only = tuple(a for a in (args.only or "").split(",") if a)
    if args.quick:
        plan = Plan.quick_plan(only or None)
    else:
        plan = Plan(faults=only or tuple(f.name for f in FAULTS), hold_s=args.hold,
                    long_generation_s=args.long_generation)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="cortex-faults-") as tmp:
        log_dir = Path(args.log_dir) if args.log_dir else Path(tmp)
        try:
            report = run(plan, log_dir)
        except (ClusterError, ValueError) as exc:
            print(f"cortex bench faults: error: {exc}", file=sys.stderr)
            return 1
    (out / "faults.json").write_text(json.dumps(report, indent=2) + "\n")
    text = render(report)
    (out / "faults.md").write_text(text)
    print(text)
    return 0


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help=f"only {', '.join(QUICK)} with short holds (< 1 min)")
    parser.add_argument("--only", metavar="NAMES",
                        help="comma list of faults: " + ", ".join(f.name for f in FAULTS))
    parser.add_argument("--hold", type=float, default=8.0, metavar="S",
                        help="how long a fault lasts before it is repaired (default 8)")
    parser.add_argument("--long-generation", type=float, default=60.0, metavar="S",
                        help="length of long_generation's answer (default 60)")
    parser.add_argument("--out", default="docs/bench", help="report directory")
    parser.add_argument("--log-dir", help="keep the cluster's logs here")
    parser.set_defaults(func=_main)


def register(bench_subparsers: argparse._SubParsersAction[Any]) -> None:
    """Add ``faults`` to ``cortex bench``."""
    parser = bench_subparsers.add_parser(
        "faults", help="inject every fault of issue 14 under load; failures, hangs, recovery",
        description="A local cluster under steady load; each fault in turn; what it cost.")
    _add_arguments(parser)
