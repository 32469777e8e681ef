"""What a Cortex deployment costs when it routes nothing: each process's CPU per second
(``cortex up``: Redis, index, ingest, one gateway, two simulated vLLM workers), for one or
more source trees, rounds interleaved.

    flock /tmp/cortex-heavy.lock .venv/bin/python tools/idle_draw.py \
        --tree before=/work/wt-before --tree after=/work/main --rounds 3 --out docs/bench/idle

Each ``--tree NAME=DIR`` is a checkout with its own ``make venv``; its ``cortex up`` starts the
deployment (lease TTL 10 s: health probes and registry polls every second, load polls every
0.5 s per worker, as an operator's defaults). After ``--warm-s`` the processes' CPU (``/proc``)
is read over ``--seconds`` with nothing sent; then the deployment stops. Trees alternate in
each round; the report has each process's ms of CPU per second per tree (median of rounds,
and every round). Not a test: a measuring tool for docs/bench.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from cortex.bench.procstat import cpu_s

PROCESSES = ("gateway-0", "index", "ingest", "redis")


def _draw(tree: Path, warm_s: float, seconds: float) -> dict[str, float]:
    """One deployment of ``tree``: ms of CPU per second of each process, idle."""
    with tempfile.TemporaryDirectory(prefix="idle-draw-") as tmp:
        state = Path(tmp) / "state.json"
        up = subprocess.Popen([str(tree / ".venv/bin/cortex"), "up", "--workers", "2",
                               "--engine", "vllm", "--gateways", "1", "--port", "0",
                               "--state-file", str(state),
                               "--log-dir", str(Path(tmp) / "logs")],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tree)
        try:
            deadline = time.monotonic() + 120
            while not state.exists():
                if up.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"{tree}: cortex up did not become ready")
                time.sleep(0.2)
            pids = _pids(json.loads(state.read_text()))
            time.sleep(warm_s)
            before = {name: cpu_s(pid) for name, pid in pids.items()}
            time.sleep(seconds)
            after = {name: cpu_s(pid) for name, pid in pids.items()}
        finally:
            up.terminate()
            up.wait(timeout=60)
    return {name: round(((after[name] or 0.0) - (before[name] or 0.0)) / seconds * 1000, 2)
            for name in pids}


def _pids(state: dict[str, object]) -> dict[str, int]:
    found: dict[str, int] = {}
    for name in ("redis", "index", "ingest"):
        entry = state.get(name)
        if isinstance(entry, dict):
            found[name] = int(entry["pid"])
    gateways = state.get("gateways")
    if isinstance(gateways, list) and gateways:
        found["gateway-0"] = int(gateways[0]["pid"])
    missing = set(PROCESSES) - set(found)
    if missing:
        raise SystemExit(f"cortex up state has no pid for {sorted(missing)}")
    return found


def _report(trees: dict[str, Path], rounds: list[dict[str, dict[str, float]]],
            args: argparse.Namespace) -> str:
    lines = ["# Idle draw: CPU of a deployment that routes nothing", "",
             f"`tools/idle_draw.py {' '.join(f'--tree {n}={d}' for n, d in trees.items())} "
             f"--rounds {args.rounds} --seconds {args.seconds:g} --warm-s {args.warm_s:g}` — "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. `cortex up` (two simulated "
             "vLLM workers, one gateway, lease TTL 10 s), nothing sent; ms of CPU (user + "
             "system) per second of each process, median of the rounds, then each round.", "",
             "| tree | " + " | ".join(PROCESSES) + " | all | rounds (all) |",
             "|---|" + "---|" * (len(PROCESSES) + 2)]
    for name in trees:
        draws = [r[name] for r in rounds]
        medians = [statistics.median(d[p] for d in draws) for p in PROCESSES]
        totals = [sum(d[p] for p in PROCESSES) for d in draws]
        lines.append(f"| {name} | " + " | ".join(f"{m:.2f}" for m in medians)
                     + f" | {statistics.median(totals):.2f} | "
                     + ", ".join(f"{t:.2f}" for t in totals) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", action="append", required=True, metavar="NAME=DIR")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--warm-s", type=float, default=10.0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    trees = {name: Path(path).resolve() for name, _, path in
             (t.partition("=") for t in args.tree)}
    rounds: list[dict[str, dict[str, float]]] = []
    for i in range(args.rounds):
        order = list(trees) if i % 2 == 0 else list(trees)[::-1]
        draws = {name: _draw(trees[name], args.warm_s, args.seconds) for name in order}
        rounds.append(draws)
        print(f"round {i}: {json.dumps(draws)}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "report.json").write_text(json.dumps({"trees": {n: str(d) for n, d in
                                                                trees.items()},
                                                      "rounds": rounds}, indent=1) + "\n")
    report = _report(trees, rounds, args)
    (args.out / "report.md").write_text(report)
    print(report)


if __name__ == "__main__":
    main()
