"""``cortex bench soak``: a local cluster under moderate load for a long time; does any
service's memory grow?

A :class:`~cortex.devcluster.cluster.LocalCluster` (Redis, index, ingest, one gateway, 3 simulated
SGLang workers with small KV pools, so their caches fill and evict within the warm-up)
serves :class:`~cortex.bench.faults_load.LoadGenerator` load for ``--minutes`` (30). Every
``--sample`` seconds the RSS of each process is read from ``/proc``. After the warm-up
(``--warmup``, default a quarter of the run) a least-squares line through each service's
samples gives its slope in MB per 10 minutes (target: ≤ 2). Writes ``soak.md``, ``soak.json``
and ``soak.png`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from cortex.bench.faults_load import LoadGenerator, LoopThread
from cortex.bench.procstat import rss_mb
from cortex.bench.report import provenance, table
from cortex.devcluster.cluster import ClusterError, ClusterSpec, LocalCluster

__all__ = ["register", "slope_mb_per_10min"]

SERVICES = ("redis", "index", "ingest", "gateway-0")
TARGET_MB_PER_10MIN = 2.0


def slope_mb_per_10min(samples: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of ``(seconds, MB)`` samples, in MB per 10 minutes."""
    if len(samples) < 3:
        return None
    xs = [t for t, _ in samples]
    ys = [mb for _, mb in samples]
    if max(xs) == min(xs):
        return None
    return statistics.linear_regression(xs, ys).slope * 600.0


def run(minutes: float, warmup_min: float, rate: float, sample_s: float,
        log_dir: Path) -> dict[str, Any]:
    spec = ClusterSpec(workers=3, gateways=1, port=0, kv_capacity_blocks=2048,
                       ready_timeout_s=120.0)
    made = provenance()  # the code that runs is the code of this moment
    samples: dict[str, list[tuple[float, float]]] = {}
    windows: list[dict[str, float]] = []
    print(f"soak: {minutes:g} min (warm-up {warmup_min:g}), logs in {log_dir}",
          file=sys.stderr, flush=True)
    with LoopThread() as loop, LocalCluster(spec, log_dir) as cluster:
        load = LoadGenerator(list(cluster.gateway_urls), clients=4, rate=rate, timeout_s=30.0)
        loop.call(load.start())
        names = [*SERVICES, *cluster.workers]
        started = time.monotonic()
        seen = 0
        try:
            while (elapsed := time.monotonic() - started) < minutes * 60:
                cluster.check()
                for name in names:
                    mb = rss_mb(cluster.process(name).pid)
                    if mb is not None:
                        samples.setdefault(name, []).append((round(elapsed, 1), round(mb, 2)))
                records = list(load.records)[seen:]
                seen += len(records)
                windows.append({"t_s": round(elapsed, 1), "requests": len(records),
                                "failed": sum(1 for r in records if not r.ok),
                                "exact": sum(1 for r in records if r.exact)})
                time.sleep(max(0.0, started + len(windows) * sample_s - time.monotonic()))
        finally:
            loop.call(load.stop())
    warm = warmup_min * 60
    services: dict[str, dict[str, Any]] = {}
    for name, series in samples.items():
        after = [(t, mb) for t, mb in series if t >= warm]
        slope = slope_mb_per_10min(after)
        services[name] = {
            "start_mb": series[0][1], "after_warmup_mb": after[0][1] if after else None,
            "end_mb": series[-1][1], "max_mb": max(mb for _, mb in series),
            "slope_mb_per_10min": None if slope is None else round(slope, 2),
            "service": name in SERVICES,
        }
    requests = sum(w["requests"] for w in windows)
    return {
        **made,
        "minutes": minutes, "warmup_minutes": warmup_min, "rate": rate, "sample_s": sample_s,
        "requests": requests, "failed": sum(w["failed"] for w in windows),
        "exact": sum(w["exact"] for w in windows),
        "services": services, "samples": samples, "windows": windows,
    }


def render(report: dict[str, Any]) -> str:
    lines = [
        "# Soak (`cortex bench soak`)", "",
        f"Generated {report['generated']} at commit `{report['commit']}` on "
        f"{report['machine']}: {report['minutes']:g} minutes at {report['rate']:g} "
        f"requests/s (4 closed-loop clients, chat over shared system prompts, 60 % repeats, "
        f"half streamed), RSS sampled every {report['sample_s']:g} s; slopes fitted after "
        f"a {report['warmup_minutes']:g}-minute warm-up (the sims' 2,048-block KV pools are "
        "full and evicting by then, so the ledgers are at their steady size). "
        f"Target: ≤ {TARGET_MB_PER_10MIN:g} MB per 10 minutes per service.", "",
        f"Requests: {report['requests']}, failed {report['failed']}, exact-KV hits "
        f"{report['exact']}.", "",
    ]
    rows = []
    for name, s in report["services"].items():
        slope = s["slope_mb_per_10min"]
        if not s["service"]:
            verdict = "(simulated worker)"
        elif slope is None:
            verdict = "not enough samples"
        else:
            verdict = "met" if slope <= TARGET_MB_PER_10MIN else "**missed**"
        after = "—" if s["after_warmup_mb"] is None else f"{s['after_warmup_mb']:.1f} MB"
        rows.append((name, f"{s['start_mb']:.1f} MB", after, f"{s['end_mb']:.1f} MB",
                     f"{s['max_mb']:.1f} MB", "—" if slope is None else f"{slope:+.2f}",
                     verdict))
    lines += table(("process", "RSS at start", "after warm-up", "at the end", "max",
                    "slope (MB / 10 min)", "target"), rows)
    lines += ["", "![RSS over time](soak.png)", "", "## Reproduce", "", "```sh",
              ".venv/bin/cortex bench soak                 # 30 minutes",
              ".venv/bin/cortex bench soak --minutes 8     # a shorter run", "```", "",
              "Samples: [soak.json](soak.json).", ""]
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for name, series in report["samples"].items():
        if name in SERVICES:
            ax.plot([t / 60 for t, _ in series], [mb for _, mb in series], label=name)
    ax.axvspan(0, report["warmup_minutes"], color="grey", alpha=0.15, label="warm-up")
    ax.set_xlabel("minutes")
    ax.set_ylabel("RSS (MB)")
    ax.set_title("RSS per service under steady load")
    ax.legend(loc="upper left", fontsize="small")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _main(args: argparse.Namespace) -> int:
    if not args.minutes > 0 or args.sample <= 0:
        print("cortex bench soak: error: --minutes and --sample must be > 0", file=sys.stderr)
        return 2
    warmup = args.minutes / 4 if args.warmup is None else args.warmup
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="cortex-soak-") as tmp:
        try:
            report = run(args.minutes, warmup, args.rate, args.sample,
                         Path(args.log_dir) if args.log_dir else Path(tmp))
        except ClusterError as exc:
            print(f"cortex bench soak: error: {exc}", file=sys.stderr)
            return 1
    (out / "soak.json").write_text(json.dumps(report) + "\n")
    plot(report, out / "soak.png")
    text = render(report)
    (out / "soak.md").write_text(text)
    print(text)
    return 0


def register(bench_subparsers: argparse._SubParsersAction[Any]) -> None:
    """Add ``soak`` to ``cortex bench``."""
    parser = bench_subparsers.add_parser(
        "soak", help="RSS of every service under moderate load for 30 minutes",
        description="A local cluster under steady load; RSS per service and its slope.")
    parser.add_argument("--minutes", type=float, default=30.0, help="run length (default 30)")
    parser.add_argument("--warmup", type=float, metavar="MIN",
                        help="minutes excluded from the slope (default: a quarter of the run)")
    parser.add_argument("--rate", type=float, default=10.0, help="requests/s (default 10)")
    parser.add_argument("--sample", type=float, default=10.0, metavar="S",
                        help="seconds between RSS samples (default 10)")
    parser.add_argument("--out", default="docs/bench", help="report directory")
    parser.add_argument("--log-dir", help="keep the cluster's logs here")
    parser.set_defaults(func=_main)
