"""``cortex bench``: benchmark tools, each writing a markdown report.

Every benchmark module exposes ``register(bench_subparsers)``. They are imported
only when ``cortex bench`` runs; a benchmark whose module is absent is listed as
unavailable instead of breaking the others.
"""

from __future__ import annotations

import argparse
from typing import Any

from cortex.edge.main import register_subcommands

# benchmark name -> module that registers it
BENCHMARKS: dict[str, str] = {
    "hashing": "cortex.bench.hashing",
    "wire": "cortex.bench.wire",
    "transport": "cortex.bench.transport",
    "index": "cortex.bench.index",
    "ingest": "cortex.bench.ingest",
    "sim": "cortex.bench.sim",
    "overhead": "cortex.bench.overhead",
    "routing": "cortex.bench.routing.command",
    "fleet": "cortex.bench.fleet",
    "tokenize": "cortex.bench.tokenize",
    "replica": "cortex.bench.replica",
    "faults": "cortex.bench.faults",
    "soak": "cortex.bench.soak",
    "capacity": "cortex.bench.capacity",
    "core": "cortex.bench.core",
    "epp": "cortex.bench.epp",
    "ops-kit": "cortex.bench.opskit",
    "media": "cortex.bench.media",
}


def register(subparsers: argparse._SubParsersAction[Any]) -> None:
    parser = subparsers.add_parser("bench", help="run a benchmark and write its report")
    bench_sub = parser.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True)
    register_subcommands(bench_sub, BENCHMARKS)
