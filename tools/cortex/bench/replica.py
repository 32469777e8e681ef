"""``cortex bench replica``: the index's ledger, replicated into gateway-like processes.

Setup, each its own process on 127.0.0.1: ``cortex index``; a *feeder* playing ingest (one
Sync stream, snapshots then stores of ``--blocks-per-update`` blocks chained per source at a
paced rate); ``--replicas`` *replica* processes, each a gateway's
:class:`~cortex.gateway.ledger.replica_client.ReplicaClient` and nothing else.

Measured:

1. **lag**: for every live batch a replica applies, its wall time minus the batch's
   ``applied_unix_s`` (the index applying the change; one host, one clock), p50/p99/max, at
   each offered rate (blocks/s);
2. **CPU** per process (``/proc``), per stored block: what the index and each replica spend;
3. **memory**: a replica's RSS growth per block held, against the index's estimate;
4. **exactness**: after the run, every replica's answers to sampled prefix queries equal the
   index's ``Match`` over gRPC (mismatches are counted and reported, never hidden);
5. **in-process match**: a replica's match time for a 256-block query.

``--baseline``: each rate runs twice, first with a Python object per update on both sides --
the index applying a Sync batch update by update (``--no-columnar-sync``) and the replicas
every op one by one (``LedgerReplica(wire_replay=False)``), the paths before a batch went to
the compiled core in one call -- then as the index and a gateway run by default: the report
gives both and their ratios.

Writes ``docs/bench/replica.md`` and ``replica.png`` (``--out``).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from cortex.bench import pyspy
from cortex.bench.procstat import cpu_s, rss_bytes
from cortex.bench.report import table
from cortex.devcluster.supervisor import Child, Supervisor
from cortex.hashing import Engine, HashDomain
from cortex.testing import free_port, wait_until

__all__ = ["main", "register", "run_rate"]

DOMAIN = HashDomain("bench-model", 16, Engine.SGLANG)
SOURCES = 8


# ---- the child processes ------------------------------------------------------------------


async def _feeder(target: str, rate: float, seconds: float, blocks: int, per_batch: int,
                  seed: int) -> None:
    """Stores at ``rate`` blocks/s for ``seconds``, two batches in flight as an ingest keeps
    them (``max_inflight_batches``); prints how many blocks it sent."""
    import numpy as np

    from cortex.ledger.client import stream_channel
    from cortex.testing.index_sync import LedgerUpdates, SyncSession

    rng = random.Random(seed)
    keygen = np.random.default_rng(seed)
    channel = stream_channel(target, frames=True)  # as the ingest streams
    builders = [LedgerUpdates(f"w{i}", DOMAIN, epoch=seed + 1) for i in range(SOURCES)]
    tails = [DOMAIN.root_key()] * SOURCES
    sent = 0
    async with SyncSession(channel, ingest_id=f"bench-feeder-{seed}") as session:
        await session.send([b.snapshot([], []) for b in builders])
        interval = per_batch * blocks / rate
        started = time.perf_counter()
        deadline = started + seconds
        tick = started
        inflight = 0
        while time.perf_counter() < deadline:
            batch = []
            chains = keygen.integers(1, 1 << 63, (per_batch, blocks), np.uint64)
            for chain in chains:
                i = rng.randrange(SOURCES)
                if rng.random() < 0.05:
                    tails[i] = DOMAIN.root_key()  # a new conversation
                batch.append(builders[i].store_packed(tails[i], chain.astype("<u8").tobytes()))
                tails[i] = int(chain[-1])
            if inflight == 2:
                await session.reply()
                inflight -= 1
            await session.post(batch)
            inflight += 1
            sent += per_batch * blocks
            tick += interval
            delay = tick - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
        for _ in range(inflight):
            await session.reply()
    channel.close()
    print(json.dumps({"blocks": sent, "seconds": time.perf_counter() - started}), flush=True)


async def _replica(target: str, seconds: float, per_op: bool = False) -> None:
    """A gateway's replica client for ``seconds``; then lag samples, match time and an
    exactness check against the index's Match, as JSON on stdout. ``per_op``: its replica
    applies every op one by one (the baseline)."""
    import numpy as np
    from grpclib.exceptions import GRPCError, StreamTerminatedError

    from cortex.gateway import GatewayMetrics, IndexConfig, ReplicaClient
    from cortex.ledger.client import IndexStub, index_channel, match_request
    from cortex.ledger.replica import LedgerReplica

    lags: list[float] = []

    class Measured(ReplicaClient):
        def _apply(self, batch: Any) -> None:
            super()._apply(batch)
            if batch.ops and batch.applied_unix_s:
                lags.append(time.time() - batch.applied_unix_s)

    client = Measured(IndexConfig(targets=(target,)), (DOMAIN.model,), GatewayMetrics(),
                      lambda changes: None, replica_id=f"bench-{os.getpid()}")
    if per_op:
        client.replica = LedgerReplica(wire_replay=False)
    rss0 = rss_bytes(os.getpid()) or 0
    async with client:
        await asyncio.sleep(seconds)
        replica = client.replica
        blocks = replica.view.blocks
        rss = rss_bytes(os.getpid()) or 0
        tree = replica.view.trees.get(DOMAIN)
        queries: list[list[int]] = []
        if tree is not None and tree.sources:
            keys = np.array(sorted(tree.keys_of(tree.sources[0])), np.uint64)
            rng = np.random.default_rng(1)
            for key in rng.choice(keys, size=min(200, len(keys)), replace=False).tolist():
                chain = [key]  # the key's whole prefix, root first
                while (parent := tree.parent_of(chain[-1])) is not None:
                    chain.append(parent)
                queries.append(chain[::-1][:256])
        version = replica.version
        started = time.perf_counter()
        local = [replica.match(DOMAIN, q) for q in queries]
        match_s = (time.perf_counter() - started) / max(1, len(queries))
        mismatches = unanswered = 0
        channel = index_channel(target)
        stub = IndexStub(channel)
        for query, mine in zip(queries, local, strict=True):
            try:
                reply = await stub.match(match_request(DOMAIN.model, block_keys=query),
                                         timeout=5)
            except (TimeoutError, GRPCError, StreamTerminatedError, ConnectionError):
                unanswered += 1  # a saturated index: counted, the other answers still checked
                continue
            theirs = sorted((m.worker_id, m.dp_rank, m.matched_blocks) for m in reply.matches)
            if reply.index_version == version and theirs != sorted(
                    (s.worker_id, s.dp_rank, b) for s, b, _ in mine.sources):
                mismatches += 1
        channel.close()
    print(json.dumps({"lags": lags, "blocks": blocks, "rss_growth": rss - rss0,
                      "match_us": match_s * 1e6, "queries": len(queries),
                      "mismatches": mismatches, "unanswered": unanswered,
                      "snapshots": replica.snapshots}), flush=True)


# ---- the driver ---------------------------------------------------------------------------


@dataclass
class RateResult:
    rate: float
    blocks: int
    seconds: float
    lag_p50_ms: float
    lag_p99_ms: float
    lag_max_ms: float
    index_cpu_us_per_block: float
    replica_cpu_us_per_block: float
    replica_bytes_per_block: float
    match_us: float
    mismatches: int
    queries: int
    index_bytes_per_block: float
    profiles: dict[str, Path] = field(default_factory=dict)  # process -> raw py-spy stacks
    per_op: bool = False  # the baseline: index update by update, replicas op by op
    unanswered: int = 0  # sampled queries the index's Match did not answer in time
    failed: list[str] = field(default_factory=list)  # replica processes that did not finish


def _child(sup: Supervisor, name: str, *args: str) -> Child:
    return sup.start(name, [sys.executable, "-m", "cortex.bench.replica", "--child", *args])


def _result(child: Child, timeout: float) -> dict[str, Any]:
    """The JSON line a child prints last, once it exited."""
    try:
        child.proc.wait(timeout)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{child.name} did not finish in {timeout:g} s") from None
    if child.returncode != 0:
        raise RuntimeError(f"{child.name} failed ({child.returncode}):\n{child.log_tail()}")
    result: dict[str, Any] = json.loads(child.log_path.read_text().strip().splitlines()[-1])
    return result


def run_rate(rate: float, replicas: int, seconds: float, blocks: int, per_batch: int,
             seed: int, profile: tuple[str, Path] | None = None, per_op: bool = False
             ) -> RateResult:
    """One rate; ``profile`` = (py-spy, directory): the index and the first replica are
    sampled over the feeding window. ``per_op``: the index applies update by update and the
    replicas op by op (the baseline)."""
    port, metrics_port = free_port(), free_port()
    target = f"127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="cortex-bench-replica-") as logs, \
            Supervisor(Path(logs)) as sup:
        index = sup.start_cortex("index", [
            "index", "--host", "127.0.0.1", "--port", str(port), "--metrics-host", "127.0.0.1",
            "--metrics-port", str(metrics_port), "--log-level", "WARNING",
            "--memory-budget-bytes", "0", *(["--no-columnar-sync"] if per_op else [])])
        wait_until(lambda: _port_open(port), 30, 0.05, "index")
        children = [_child(sup, f"replica-{i}", "replica", target, str(seconds + 2),
                           *(["per-op"] if per_op else [])) for i in range(replicas)]
        wait_until(lambda: _subscribers(metrics_port) == replicas, 30, 0.05,
                   "the replicas to subscribe")
        procs = [index, *children]
        cpu0 = {p.pid: cpu_s(p.pid) or 0.0 for p in procs}
        feeder = _child(sup, "feeder", "feeder", target, str(rate), str(seconds), str(blocks),
                        str(per_batch), str(seed))
        spies, profiles = [], {}
        if profile is not None:
            for name, proc in (("index", index), ("replica", children[0])):
                tag = "-per-op" if per_op else ""
                profiles[name] = profile[1] / f"replica-{name}-{rate:.0f}{tag}.txt"
                spies.append(pyspy.record(profile[0], proc.pid, seconds, profiles[name]))
        fed = _result(feeder, seconds + 60)
        cpu1 = {p.pid: cpu_s(p.pid) or 0.0 for p in procs}
        for spy in spies:
            spy.wait(30)
        index_rss = rss_bytes(index.pid) or 0
        outs, finished, failed = [], [], []
        for c in children:  # a replica that fell over is reported, not the end of the run
            try:
                outs.append(_result(c, seconds + 120))
                finished.append(c)
            except RuntimeError as exc:
                failed.append(f"{c.name}: {str(exc).splitlines()[-1][:200]}")
    if not outs:
        raise RuntimeError(f"no replica finished at {rate:,.0f} blocks/s: {'; '.join(failed)}")
    sent = max(1, fed["blocks"])
    lags = sorted(x for o in outs for x in o["lags"])
    q = statistics.quantiles(lags, n=100) if len(lags) > 1 else [0.0] * 99
    replica_cpu = statistics.fmean(cpu1[c.pid] - cpu0[c.pid] for c in finished)
    held = max(1, statistics.fmean(o["blocks"] for o in outs))
    return RateResult(
        rate=rate, blocks=sent, seconds=fed["seconds"],
        lag_p50_ms=q[49] * 1e3, lag_p99_ms=q[98] * 1e3, lag_max_ms=(lags[-1] if lags else 0) * 1e3,
        index_cpu_us_per_block=(cpu1[index.pid] - cpu0[index.pid]) / sent * 1e6,
        replica_cpu_us_per_block=replica_cpu / sent * 1e6,
        replica_bytes_per_block=statistics.fmean(o["rss_growth"] for o in outs) / held,
        match_us=statistics.fmean(o["match_us"] for o in outs),
        mismatches=sum(o["mismatches"] for o in outs),
        queries=sum(o["queries"] for o in outs),
        index_bytes_per_block=index_rss / held,
        profiles=profiles,
        per_op=per_op,
        unanswered=sum(o.get("unanswered", 0) for o in outs),
        failed=failed,
    )


def _subscribers(metrics_port: int) -> int:
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=1) as r:
            text = r.read().decode()
    except OSError:
        return -1
    for line in text.splitlines():
        if line.startswith("cortex_index_replica_subscribers "):
            return int(float(line.split()[1]))
    return 0


def _port_open(port: int) -> bool:
    import socket

    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def render(results: list[RateResult], replicas: int, blocks: int, per_batch: int,
           command: str) -> str:
    lines = [
        "# Replica benchmark: the index's ledger in every gateway",
        "",
        f"Generated by `{command}` on {datetime.now(UTC):%Y-%m-%d %H:%M} UTC; "
        f"{os.cpu_count()} cores, Python {platform.python_version()}, load average "
        f"{os.getloadavg()[1]:.1f} over the last 5 minutes. One `cortex index`, "
        f"one feeder process (Sync, {blocks}-block stores over {SOURCES} sources, {per_batch} "
        f"updates a batch), {replicas} replica processes (a gateway's `ReplicaClient` each), "
        "both streams over Cortex frames as the ingest's and gateways' are, "
        "all on 127.0.0.1 and one machine: the replicas compete with the index for the cores.",
        "",
        *table(("offered blocks/s", "index and replicas apply", "sent", "achieved blocks/s",
                "lag p50", "p99", "max", "index CPU / block", "replica CPU / block",
                "replica RSS / block", "match (256 keys)", "answers ≠ index"),
               [(f"{r.rate:,.0f}", "per update (baseline)" if r.per_op else "batch (default)",
                 f"{r.blocks:,}", f"{r.blocks / r.seconds:,.0f}",
                 f"{r.lag_p50_ms:.1f} ms",
                 f"{r.lag_p99_ms:.1f} ms", f"{r.lag_max_ms:.0f} ms",
                 f"{r.index_cpu_us_per_block:.2f} µs", f"{r.replica_cpu_us_per_block:.2f} µs",
                 f"{r.replica_bytes_per_block:.0f} B", f"{r.match_us:.0f} µs",
                 f"{r.mismatches} of {r.queries}"
                 + (f" ({r.unanswered} unanswered)" if r.unanswered else ""))
                for r in results], "rl" + "r" * 10),
    ]
    for r in results:
        if r.failed:
            lines += ["", f"**At {r.rate:,.0f} blocks/s, {len(r.failed)} of {replicas} replica "
                      "processes did not finish** (the row is the others'): "
                      + "; ".join(f"`{f}`" for f in r.failed)]
    pairs = [(b, r) for b, r in itertools.pairwise(results)
             if b.per_op and not r.per_op and b.rate == r.rate]
    if pairs:
        lines += ["", "CPU per block, per update / batch (same run, same rate): " + "; ".join(
            f"{r.rate:,.0f}/s: index "
            f"{b.index_cpu_us_per_block / r.index_cpu_us_per_block:.2f}x, replica "
            f"{b.replica_cpu_us_per_block / r.replica_cpu_us_per_block:.2f}x"
            for b, r in pairs) + "."]
    lines += [
        "",
        "- **lag**: a replica applying a live batch, minus the index's `applied_unix_s` for",
        "  it (the index stamps a batch when it flushes its journal after applying a Sync",
        "  batch). Target: p99 ≤ 50 ms at 1M blocks/s offered. *achieved* is what the",
        "  feeder got through (two batches in flight, as an ingest keeps them): below the",
        "  offered rate, the index (or the machine) is saturated.",
        "- **CPU / block**: process CPU over the feeding window divided by blocks sent; the",
        "  index's includes decoding, sequencing, the tree, the journal and encoding once for",
        "  every replica; a replica's, decoding and applying the same ops to its own tree.",
        "  Targets: index ≤ 0.5 µs with 4 replicas, replica ≤ 0.25 µs.",
        "- **RSS / block**: a replica process's RSS growth divided by the blocks it holds",
        "  (target ≤ 256 B; the tree's estimate is 146 B + 8 B per 64 sources).",
        "- **answers ≠ index**: sampled prefix queries whose per-source matched blocks differ",
        "  between the replica and the index's gRPC Match at the same version (*unanswered*:",
        "  the index's Match did not answer within 5 s; the others are still compared).",
        "",
    ]
    last = results[-1]
    shown = [r for r in results if r.rate == last.rate]
    for r in shown:
        for name, raw in r.profiles.items():
            how = " (per update: the baseline)" if r.per_op else ""
            if raw.exists():
                lines += [f"## Where the {name}'s time goes at {r.rate:,.0f} blocks/s offered"
                          f"{how} (py-spy)", "", *pyspy.top_frames_table(raw), ""]
    return "\n".join(lines)


def plot(results: list[RateResult], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6, 3.5))
    rates = [r.rate / 1000 for r in results]
    ax.plot(rates, [r.lag_p50_ms for r in results], marker="o", label="lag p50")
    ax.plot(rates, [r.lag_p99_ms for r in results], marker="o", label="lag p99")
    ax.axhline(50, color="grey", linestyle="--", linewidth=0.8, label="p99 target")
    ax.set_xlabel("offered blocks/s (thousands)")
    ax.set_ylabel("ms")
    ax.set_title("Replica lag, index apply → gateway replica")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _main(args: argparse.Namespace) -> int:
    if args.child:
        kind, *rest = args.child
        if kind == "feeder":
            target, rate, seconds, blocks, per_batch, seed = rest
            asyncio.run(_feeder(target, float(rate), float(seconds), int(blocks),
                                int(per_batch), int(seed)))
        else:
            target, seconds, *how = rest
            asyncio.run(_replica(target, float(seconds), per_op=how == ["per-op"]))
        return 0
    rates = [float(r) for r in args.rates.split(",")]
    results = []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    profile = (pyspy.find_py_spy(args.py_spy), out) if args.profile else None
    for i, rate in enumerate(rates):
        for per_op in (True, False) if args.baseline else (False,):
            how = " (per update: the baseline)" if per_op else ""
            print(f"rate {rate:,.0f} blocks/s{how} ...", flush=True)
            result = run_rate(rate, args.replicas, args.seconds, args.blocks_per_update,
                              args.updates_per_batch, i, profile, per_op)
            print(f"  lag p50 {result.lag_p50_ms:.1f} ms p99 {result.lag_p99_ms:.1f} ms, "
                  f"index {result.index_cpu_us_per_block:.2f} µs/block, "
                  f"replica {result.replica_cpu_us_per_block:.2f} µs/block, "
                  f"{result.mismatches} mismatches"
                  + (f", {result.unanswered} unanswered" if result.unanswered else "")
                  + (f", failed: {'; '.join(result.failed)}" if result.failed else ""),
                  flush=True)
            results.append(result)
    command = "cortex bench replica " + " ".join(sys.argv[3:] if len(sys.argv) > 3 else [])
    (out / "replica.md").write_text(render(results, args.replicas, args.blocks_per_update,
                                           args.updates_per_batch, command.strip()),
                                    encoding="utf-8")
    if plot(results, out / "replica.png"):
        with (out / "replica.md").open("a", encoding="utf-8") as f:
            f.write("\n![replica lag](replica.png)\n")
    print(out / "replica.md")
    return 0


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="docs/bench", help="report directory")
    parser.add_argument("--rates", default="25000,50000,100000",
                        help="offered blocks/s, comma separated")
    parser.add_argument("--replicas", type=int, default=2, help="replica processes")
    parser.add_argument("--seconds", type=float, default=10.0, help="feeding time per rate")
    parser.add_argument("--blocks-per-update", type=int, default=16,
                        help="blocks per store (an engine event)")
    parser.add_argument("--updates-per-batch", type=int, default=8,
                        help="stores per Sync batch (1: a quiet ingest, one event per batch)")
    parser.add_argument("--profile", action="store_true",
                        help="sample the index and one replica with py-spy (top frames in "
                             "the report)")
    parser.add_argument("--py-spy", default="", help="py-spy executable (default: on PATH)")
    parser.add_argument("--baseline", action="store_true",
                        help="run each rate first with the index applying update by update "
                             "and the replicas op by op (ratios)")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)


def register(bench_subparsers: argparse._SubParsersAction[Any]) -> None:
    parser = bench_subparsers.add_parser(
        "replica", help="ledger replica lag, CPU and memory",
        description="Lag, CPU per block, memory per block and exactness of gateway replicas.")
    _add_arguments(parser)
    parser.set_defaults(func=_main)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cortex.bench.replica")
    _add_arguments(parser)
    return _main(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
