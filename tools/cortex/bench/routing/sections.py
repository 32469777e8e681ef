"""The report's sections on deployment variants: replicas, churn, KV pressure, PD (pure but
for the plot).

Each reads the :class:`WorkloadResult` of the variants present (``VARIANTS`` names them) and
adds its targets: Cortex with 4 replicas within 2 points of its 1-replica hit rate, and no
over-prediction on a restarted or flushed worker once the event's KV events had time to
arrive (:data:`cortex.bench.routing.runner.EVENT_ALLOWANCE_S`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from cortex.bench.routing.contenders import CONTENDERS
from cortex.bench.routing.metrics import RunSummary
from cortex.bench.routing.results import Target, WorkloadResult, fmt_ms
from cortex.bench.routing.scenarios import VARIANTS, Variant

__all__ = ["REPLICA_TOLERANCE", "variant_json", "variant_sections", "variant_targets",
           "write_replica_plot"]

REPLICA_TOLERANCE = 0.02
"""Cortex's hit rate with 4 replicas may be at most this far below its 1-replica rate."""


def _variant(res: WorkloadResult) -> Variant | None:
    return VARIANTS.get(res.workload.name)


def _variants(results: Sequence[WorkloadResult], keep: Callable[[Variant], bool]
              ) -> Iterator[tuple[WorkloadResult, Variant]]:
    """The results of the variants ``keep`` selects, with their variant."""
    for res in results:
        if (v := _variant(res)) is not None and keep(v):
            yield res, v


def _runs(res: WorkloadResult) -> Iterator[tuple[str, RunSummary]]:
    """The contenders that ran, in report order."""
    for c in CONTENDERS:
        if (run := res.runs.get(c)) is not None:
            yield c, run


_ReplicaRuns = dict[str, dict[str, dict[int, RunSummary]]]
"""base workload -> contender -> replicas -> run."""


def _replica_table(results: Sequence[WorkloadResult]) -> _ReplicaRuns:
    out: _ReplicaRuns = {}
    for res, v in _variants(results, lambda v: v.replicas > 0):
        for c, run in res.runs.items():
            out.setdefault(v.base, {}).setdefault(c, {})[v.replicas] = run
    return out


def _pct(x: float | None) -> str:
    return "—" if x is None or math.isnan(x) else f"{x:.1%}"


def variant_targets(results: Sequence[WorkloadResult]) -> list[Target]:
    """The replica and churn targets of the variants present."""
    out: list[Target] = []
    for base, by_contender in _replica_table(results).items():
        runs = by_contender.get("cortex", {})
        if 1 in runs and 4 in runs:
            drop = runs[1].hit_rate - runs[4].hit_rate
            out.append(Target(f"{base} replicas", "4 replicas within 2 points of 1",
                              drop <= REPLICA_TOLERANCE,
                              f"{runs[4].hit_rate:.1%} vs {runs[1].hit_rate:.1%}"
                              f" ({-drop * 100:+.1f} points)"))
    for res in results:
        cx = res.runs.get("cortex")
        if cx is None or not cx.extra.get("churn"):
            continue
        for e in cx.extra["churn"]:
            if e.get("at_s") is None:
                out.append(Target(res.workload.name, f"{e['action']}: event happened", False,
                                  f"{e['worker']} never accepted it ({e['attempts']} tries)"))
                continue
            late = e["over_predictions_after_allowance"]
            out.append(Target(
                res.workload.name, f"no over-prediction on the {e['action']} worker after its"
                " events", late == 0,
                f"{late} after the allowance, {e['over_predictions']} in the whole window"
                f" ({e['worker_requests']} requests to {e['worker']})"))
    return out


def _replicas_section(results: Sequence[WorkloadResult]) -> list[str]:
    table = _replica_table(results)
    if not table:
        return []
    counts = sorted({n for by_c in table.values() for runs in by_c.values() for n in runs})
    lines = ["## Router replicas behind a load balancer", "",
             "HAProxy (round robin, started by the benchmark on 127.0.0.1) in front of N"
             " replicas: N Cortex gateways sharing one index (each with its own ledger"
             " replica), or N independent router processes of a peer. Every replica count"
             " runs behind the balancer, 1 included. Hit rate · TTFT p50 / p90 ms:", "",
             "| workload | contender | " + " | ".join(f"{n} replica(s)" for n in counts)
             + f" | {counts[-1]} vs {counts[0]} |",
             "|---|---|" + "---|" * (len(counts) + 1)]
    for base, by_c in table.items():
        for c in CONTENDERS:
            runs = by_c.get(c)
            if not runs:
                continue
            cells = [f"{runs[n].hit_rate:.1%} · {fmt_ms(runs[n].ttft_ms[0])} /"
                     f" {fmt_ms(runs[n].ttft_ms[1])}" if n in runs else "—" for n in counts]
            lo, hi = runs.get(counts[0]), runs.get(counts[-1])
            delta = ("—" if lo is None or hi is None else
                     f"{(hi.hit_rate - lo.hit_rate) * 100:+.1f} points")
            lines.append(f"| {base} | {c} | " + " | ".join(cells) + f" | {delta} |")
    return [*lines, "", "![hit rate vs replicas](replicas.png)", ""]


def _window_cells(e: Mapping[str, Any]) -> str:
    b = e["before"]
    return (f"{e['requests']} · {_pct(e['hit_rate'])} (before {_pct(b['hit_rate'])}) ·"
            f" {fmt_ms(_num(e['ttft_p50_ms']))} / {fmt_ms(_num(e['ttft_p90_ms']))}"
            f" (before {fmt_ms(_num(b['ttft_p50_ms']))} / {fmt_ms(_num(b['ttft_p90_ms']))})")


def _num(value: float | None) -> float:
    return math.nan if value is None else float(value)


def _churn_section(results: Sequence[WorkloadResult]) -> list[str]:
    lines: list[str] = []
    for res, _ in _variants(results, lambda v: bool(v.churn)):
        lines += ["## Churn: a worker restarted, another flushed", "",
                  f"`{res.workload.name}`: {res.workload.title}. A restart is the sim's restart"
                  " fault (empty cache, event seq from 0, `AllBlocksCleared`; requests in"
                  " flight finish), a flush is SGLang's `/flush_cache`, retried every 10 ms"
                  " until the engine accepts it (it refuses while requests run). Each window"
                  " is the requests *sent* in the given time after the event, against the"
                  " same length before it. Over-predictions: Cortex's predicted hit above the"
                  " engine's `cached_tokens` on the event's worker, all of them and those sent"
                  " more than 1 s after the event. Stale sends: requests sent to the last"
                  " server of their prefix that found less of it cached (whole run).", "",
                  "| contender | event | at s (tries) | window s | requests · hit · TTFT p50 /"
                  " p90 ms | on the worker: requests · hit | over-predictions (after 1 s) |"
                  " stale sends |", "|---|---|---|---|---|---|---|---|"]
        for c, run in _runs(res):
            stale = run.extra.get("stale") or {}
            for e in run.extra.get("churn") or []:
                if e.get("at_s") is None:
                    lines.append(f"| {c} | {e['action']} {e['worker']} | never"
                                 f" ({e['attempts']}) | — | — | — | — | — |")
                    continue
                over = (f"{e['over_predictions']} ({e['over_predictions_after_allowance']})"
                        if run.prediction is not None else "—")
                lines.append(
                    f"| {c} | {e['action']} {e['worker']} | {e['at_s']:.1f}"
                    f" ({e['attempts']}) | {e['window_s']:g} | {_window_cells(e)} |"
                    f" {e['worker_requests']} · {_pct(e['worker_hit_rate'])} | {over} |"
                    f" {stale.get('stale', '—')} of {stale.get('affine', '—')} |")
        lines.append("")
    return lines


def _pressure_section(results: Sequence[WorkloadResult]) -> list[str]:
    lines: list[str] = []
    for res, _ in _variants(results, lambda v: v.capacity_fraction is not None):
        lines += ["## KV pressure", "",
                  f"`{res.workload.name}`: every worker holds {res.capacity_blocks:,} blocks,"
                  f" {res.capacity_blocks / max(res.unique_pages, 1):.0%} of the working set"
                  f" ({res.unique_pages:,} pages). *Sent for a prefix it no longer held*:"
                  " for Cortex, requests whose predicted hit (what it routed on) exceeded the"
                  " engine's `cached_tokens`; for a peer, which says nothing of its intent,"
                  " its *stale sends*: requests sent to the worker that last served their"
                  " longest already-served prefix that found fewer of those tokens cached."
                  " Stale sends are counted for every contender alike, from the engines'"
                  " reports.", "",
                  "| contender | hit rate | TTFT p50 / p90 ms | evicted blocks | sent for a"
                  " prefix it no longer held | sent to the last holder | stale sends |"
                  " stale tokens |", "|---|---|---|---|---|---|---|---|"]
        for c, run in _runs(res):
            stale = run.extra.get("stale") or {}
            evicted = sum(t.evicted_blocks for t in run.workers.values())
            affine = stale.get("affine", 0)
            share = f" ({stale['stale'] / affine:.1%})" if affine else ""
            p = run.prediction
            missed = (f"{p.over:,} of {p.requests:,} (over-predictions)" if p is not None else
                      f"{stale.get('stale', 0):,} of {run.requests_ok:,} (stale sends)")
            lines.append(f"| {c} | {run.hit_rate:.1%} | {fmt_ms(run.ttft_ms[0])} /"
                         f" {fmt_ms(run.ttft_ms[1])} | {evicted:,} | {missed} | {affine:,} |"
                         f" {stale.get('stale', 0):,}{share} | {stale.get('stale_tokens', 0):,}"
                         " |")
        lines.append("")
    return lines


def _pd_section(results: Sequence[WorkloadResult]) -> list[str]:
    lines: list[str] = []
    for res, _ in _variants(results, lambda v: v.pd):
        lines += ["## Prefill/decode pools", "",
                  f"`{res.workload.name}`: half the sims prefill, half decode (SGLang"
                  " bootstrap handshake between sim processes). Cortex picks the prefill"
                  " worker by its ledger and the decode worker by load;"
                  " `sglang-router --pd-disaggregation --policy cache_aware` by its text tree."
                  " Hit rate is the prefill pool's (`cached_tokens` / prompt tokens counted by"
                  " the prefill engines).", "",
                  "| contender | prefill-pool hit | TTFT p50 / p90 / p99 ms | prefill"
                  " imbalance (uncached) | decode-pool requests |", "|---|---|---|---|---|"]
        for c, run in _runs(res):
            decode = run.extra.get("decode_pool") or {}
            served = sum(int(t.get("requests", 0)) for t in decode.values())
            t = run.ttft_ms
            lines.append(f"| {c} | {run.hit_rate:.1%} | {fmt_ms(t[0])} / {fmt_ms(t[1])} /"
                         f" {fmt_ms(t[2])} | {run.imbalance('uncached_tokens'):.2f} |"
                         f" {served:,} |")
        lines.append("")
    return lines


def _skipped(results: Sequence[WorkloadResult]) -> list[str]:
    rows = [f"- `{res.workload.name}`, {c}: {why}" for res in results
            for c, why in res.skipped.items()]
    return ["## Contenders that could not run here", "", *rows, ""] if rows else []


def variant_sections(results: Sequence[WorkloadResult]) -> list[str]:
    """Markdown of every variant section with something to show."""
    return [*_replicas_section(results), *_churn_section(results),
            *_pressure_section(results), *_pd_section(results), *_skipped(results)]


def variant_json(results: Sequence[WorkloadResult]) -> dict[str, Any]:
    """The variants' shape (replicas, PD, churn, KV fraction) and skipped contenders."""
    out: dict[str, Any] = {}
    for res in results:
        v = _variant(res)
        if v is None and not res.skipped:
            continue
        out[res.workload.name] = {
            "base": v.base if v else res.workload.name, "replicas": v.replicas if v else 0,
            "pd": v.pd if v else False,
            "capacity_fraction": v.capacity_fraction if v else None,
            "real_tokens": v.real_tokens if v else False,
            "churn": [{"action": e.action.value, "worker": e.worker, "fraction": e.fraction}
                      for e in v.churn] if v else [],
            "window_s": v.window_s if v and v.churn else None, "skipped": dict(res.skipped)}
    return out


def write_replica_plot(results: Sequence[WorkloadResult], out: Path,
                       colors: Mapping[str, str]) -> Path | None:
    """``replicas.png``: hit rate and TTFT p50 against the replica count."""
    table = _replica_table(results)
    if not table:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    styles = ["o-", "s--", "^:"]
    for k, (base, by_c) in enumerate(table.items()):
        for c, runs in by_c.items():
            ns = sorted(runs)
            style = styles[k % len(styles)]
            ax1.plot(ns, [runs[n].hit_rate for n in ns], style, color=colors.get(c),
                     label=f"{c}, {base}")
            ax2.plot(ns, [runs[n].ttft_ms[0] for n in ns], style, color=colors.get(c))
    for ax in (ax1, ax2):
        ax.set_xlabel("router replicas behind HAProxy")
        ax.set_xticks(sorted({n for by_c in table.values() for r in by_c.values() for n in r}))
        ax.grid(alpha=0.3)
    ax1.set_ylabel("cache hit rate")
    ax1.set_ylim(0, 1)
    ax1.legend(fontsize=7)
    ax2.set_ylabel("TTFT p50 ms")
    fig.suptitle("Hit rate and TTFT against router replicas", fontsize=10)
    fig.tight_layout()
    path = out / "replicas.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
