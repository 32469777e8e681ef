"""``cortex bench core``: the ledger's two tree cores side by side, in one process and run.

The workload of ``cortex bench index`` (~1M distinct blocks: shared 32-block prefixes and
unique suffixes over 64 workers, 256-block queries). For each core (compiled, then pure
Python), measured on the same bytes:

1. **tree apply**: the StoreBlocks chains, decoded as the index decodes them (``array('Q')``),
   stored straight into one tree (blocks per CPU second);
2. **index**: UpdateBatch bytes (64 updates each, as ingest sends them) applied by
   :class:`PrefixIndex` (sequencing, view, journal) as the index's Sync does -- with the
   compiled core, the in-order stores and removals from the batch's bytes in one call
   (:meth:`PrefixIndex.apply_planned`), and again update by update (each decoded and
   validated: the path before) for the ratio -- and the journal encoded once into
   ReplicaBatch bytes: CPU per stored block and blocks per CPU second;
3. **replica**: those ReplicaBatch bytes decoded and applied by a :class:`LedgerReplica`
   (a gateway's copy): CPU per block; with the compiled core also op by op
   (``wire_replay=False``, the path before a batch's stores went to the core in one call),
   for the ratio between the two; and in a steady state (``--churn`` batches, each storing
   32 new 32-block chains and removing the 32 stored 8 batches earlier: the tree keeps its
   size, as once the engines' pools are full), CPU per update (block stored or removed);
4. **Match** through the index's core: 256 keys, 64 workers, p50/p99;
5. **memory**: the RSS growth of the index per distinct block; with ``--big N`` also of one
   compiled tree of N blocks (the pure core is projected from its 1M figure: it would need
   minutes and gigabytes).

Ratios are compiled over pure Python, measured in the same run. Writes ``docs/bench/core.md``.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import time
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from cortex.bench.index import DOMAIN, Workload, make_workload, percentiles, sources, updates
from cortex.bench.procstat import rss_bytes
from cortex.bench.report import table
from cortex.index import PrefixIndex
from cortex.ledger import cores
from cortex.ledger.codec import (
    domain_from_bytes,
    pb,
    source_from_bytes,
    update_from_pb,
    update_to_pb,
)
from cortex.ledger.model import Source
from cortex.ledger.replica import LedgerReplica, journal_batch, journal_bytes, snapshot_batches
from cortex.ledger.view import Remove, Store, ViewOp

__all__ = ["register", "run"]

BATCH_UPDATES = 64


@dataclass
class CoreRun:
    """One core's numbers (rates in blocks/s, times in µs, sizes in bytes)."""

    core: cores.Core
    tree_rate: float = 0.0
    index_rate: float = 0.0
    index_us: float = 0.0
    index_per_update_us: float = 0.0
    replica_us: float = 0.0
    replica_per_op_us: float = 0.0
    churn_us: float = 0.0
    churn_per_op_us: float = 0.0
    match: tuple[float, float] = (0.0, 0.0)
    rss_per_block: float = 0.0
    estimate_per_block: float = 0.0
    notes: list[str] = field(default_factory=list)


def update_batches(work: Workload) -> list[bytes]:
    """The workload as ingest sends it: UpdateBatch bytes of 64 updates, keys packed."""
    out: list[bytes] = []
    batch = pb.UpdateBatch(ingest_id="bench")
    for update in updates(work):
        update_to_pb(update, batch.updates.add())
        if len(batch.updates) == BATCH_UPDATES:
            out.append(batch.SerializeToString())
            batch = pb.UpdateBatch(ingest_id="bench")
    if batch.updates:
        out.append(batch.SerializeToString())
    return out


def timed(fn: Callable[[], Any]) -> tuple[float, float]:
    """``(wall s, CPU s)`` of ``fn()``, with the cyclic GC off as in the services' hot
    loops (they allocate no cycles)."""
    gc.collect()
    gc.disable()
    try:
        wall, cpu = time.perf_counter(), time.process_time()
        fn()
        return time.perf_counter() - wall, time.process_time() - cpu
    finally:
        gc.enable()


def tree_apply(work: Workload) -> float:
    chains = [(w, parent, array("Q", keys.tobytes())) for w, parent, keys in work.stores]
    srcs = sources(work.workers)
    tree = cores.new_tree()
    store = tree.store
    _, cpu = timed(lambda: [store(srcs[w], p, k, 1) for w, p, k in chains])
    return work.stored_blocks / cpu


CHURN_CHAINS, CHURN_LENGTH, CHURN_LAG = 32, 32, 8


def churn_journal(work: Workload, batches: int) -> list[bytes]:
    """ReplicaBatch bytes of a steady state: batch i stores 32 new chains of 32 random keys
    (each under the last key of one of the workload's chains, from its worker) and removes
    the chains batch i - 8 stored."""
    rng = np.random.default_rng(11)
    srcs = sources(work.workers)
    out: list[bytes] = []
    stored: list[list[tuple[Source, npt.NDArray[np.uint64]]]] = []
    for i in range(batches):
        ops: list[ViewOp] = []
        mine = []
        for _ in range(CHURN_CHAINS):
            w, _, keys = work.stores[int(rng.integers(len(work.stores)))]
            chain = rng.integers(1, 2**64 - 1, CHURN_LENGTH, np.uint64)
            mine.append((srcs[w], chain))
            ops.append(Store(srcs[w], int(keys[-1]), chain))
        if i >= CHURN_LAG:
            ops += [Remove(source, chain) for source, chain in stored[i - CHURN_LAG]]
        stored.append(mine)
        out.append(journal_batch(ops, "bench", 1, 1.0).SerializeToString())
    return out


def apply_batch(index: PrefixIndex, batch: pb.UpdateBatch, planned: bool) -> None:
    """Apply one UpdateBatch as the index's Sync does: ``planned``, its in-order stores and
    removals from its bytes in one call of the compiled core (the rest update by update);
    else update by update."""
    plan = cores.plan_updates(batch.SerializeToString()) if planned else None
    updates = batch.updates
    if plan is None:
        for msg in updates:
            index.apply(update_from_pb(msg))
        return
    srcs = [source_from_bytes(raw) for raw in plan.sources]
    domains = [domain_from_bytes(raw) for raw in plan.domains]
    i, n = 0, len(updates)
    while i < n:
        stop, _, _ = index.apply_planned(plan, i, srcs, domains)
        if stop > i:
            i = stop
        else:
            index.apply(update_from_pb(updates[i]))
            i += 1


def index_and_replica(work: Workload, batches: list[bytes], run: CoreRun,
                      queries: list[list[int]], churn_batches: int = 0) -> None:
    index = PrefixIndex(memory_budget_bytes=0, start_version=1)
    index.start_journal()
    replica = LedgerReplica()
    per_op = LedgerReplica(wire_replay=False)  # the same with the compiled core: op by op
    seq = 0
    for follower in (replica, per_op):
        follower.begin()
        for seq, batch in enumerate(snapshot_batches(index.view, (), "bench", index.version),
                                    1):
            batch.seq = seq
            follower.apply(batch)
    journal: list[bytes] = []
    planned = run.core is cores.Core.NATIVE

    def feed() -> None:
        for data in batches:
            apply_batch(index, pb.UpdateBatch.FromString(data), planned)
            ops = [op for _, op in index.take_journal()]
            journal.append(journal_bytes(ops, "bench", index.version, 1.0))

    gc.collect()
    rss0 = rss_bytes(os.getpid()) or 0
    _, cpu = timed(feed)
    gc.collect()
    rss1 = rss_bytes(os.getpid()) or 0
    stats = index.stats()
    run.index_rate = work.stored_blocks / cpu
    run.index_us = cpu / work.stored_blocks * 1e6
    kept = sum(len(data) for data in journal)  # the replica's input, not the index's
    run.rss_per_block = (rss1 - rss0 - kept) / stats.blocks
    run.estimate_per_block = stats.bytes_estimate / stats.blocks

    if planned:  # the same updates, update by update (the path before), into a new index
        before = PrefixIndex(memory_budget_bytes=0, start_version=1)
        before.start_journal()

        def feed_per_update() -> None:
            for data in batches:
                apply_batch(before, pb.UpdateBatch.FromString(data), False)
                ops = [op for _, op in before.take_journal()]
                journal_bytes(ops, "bench", before.version, 1.0)

        _, cpu = timed(feed_per_update)
        run.index_per_update_us = cpu / work.stored_blocks * 1e6
        assert before.version == index.version
        for keys in queries[:50]:
            assert (before.match(DOMAIN.model, block_keys=keys).sources
                    == index.match(DOMAIN.model, block_keys=keys).sources)
        del before
        gc.collect()

    def follow(follower: LedgerReplica) -> None:
        for at, data in enumerate(journal, seq + 1):
            batch = pb.ReplicaBatch.FromString(data)
            batch.seq = at
            follower.apply(batch)

    _, cpu = timed(lambda: follow(replica))
    run.replica_us = cpu / work.stored_blocks * 1e6
    if run.core is cores.Core.NATIVE:
        _, cpu = timed(lambda: follow(per_op))
        run.replica_per_op_us = cpu / work.stored_blocks * 1e6
        for keys in queries[:50]:
            assert per_op.match(DOMAIN, keys).sources == replica.match(DOMAIN, keys).sources
    for keys in queries[:50]:  # the replica answers as the index does
        assert (replica.match(DOMAIN, keys).sources
                == index.match(DOMAIN.model, block_keys=keys).sources)
    if churn_batches:
        churn = churn_journal(work, churn_batches)
        base = seq + len(journal)
        warm, timed_part = churn[:CHURN_LAG], churn[CHURN_LAG:]
        updates_timed = (len(timed_part) * 2 * CHURN_CHAINS * CHURN_LENGTH)
        followers = [replica, per_op] if run.core is cores.Core.NATIVE else [replica]
        for follower in followers:
            for at, data in enumerate(warm, base + 1):
                batch = pb.ReplicaBatch.FromString(data)
                batch.seq = at
                follower.apply(batch)

        def churned(follower: LedgerReplica) -> None:
            for at, data in enumerate(timed_part, base + CHURN_LAG + 1):
                batch = pb.ReplicaBatch.FromString(data)
                batch.seq = at
                follower.apply(batch)

        _, cpu = timed(lambda: churned(replica))
        run.churn_us = cpu / updates_timed * 1e6
        if run.core is cores.Core.NATIVE:
            _, cpu = timed(lambda: churned(per_op))
            run.churn_per_op_us = cpu / updates_timed * 1e6
            for keys in queries[:50]:
                assert per_op.match(DOMAIN, keys).sources == replica.match(DOMAIN, keys).sources
    for keys in queries[:200]:
        index.match(DOMAIN.model, block_keys=keys)
    samples = []
    for keys in queries:
        t0 = time.perf_counter()
        index.match(DOMAIN.model, block_keys=keys)
        samples.append(time.perf_counter() - t0)
    p50, p99, _ = percentiles(samples)
    run.match = (p50, p99)


def big_tree_bytes(blocks: int, workers: int) -> tuple[float, int]:
    """RSS growth per distinct block of one compiled tree holding ``blocks`` blocks."""
    work = make_workload(blocks, workers, 0, seed=3)
    chains = [(w, parent, array("Q", keys.tobytes())) for w, parent, keys in work.stores]
    del work
    srcs = sources(workers)
    gc.collect()
    rss0 = rss_bytes(os.getpid()) or 0
    tree = cores.tree_type(cores.Core.NATIVE)(1024)
    for w, parent, keys in chains:
        tree.store(srcs[w], parent, keys, 1)
    rss1 = rss_bytes(os.getpid()) or 0
    return (rss1 - rss0) / tree.nodes, tree.nodes


def measure(core: cores.Core, work: Workload, batches: list[bytes],
            queries: list[list[int]], churn_batches: int = 0) -> CoreRun:
    cores.use(core)
    run = CoreRun(core)
    print(f"core {core}: tree apply ...", flush=True)
    run.tree_rate = tree_apply(work)
    gc.collect()
    print(f"core {core}: index + replica + match ...", flush=True)
    index_and_replica(work, batches, run, queries, churn_batches)
    gc.collect()
    return run


def rows(native: CoreRun, python: CoreRun, big: tuple[float, int] | None
         ) -> Iterator[tuple[str, str, str, str, str]]:
    def ratio(a: float, b: float) -> str:
        return f"{a / b:.1f}x" if b else ""

    yield ("tree apply (StoreBlocks chains into one tree), per CPU second",
           f"{native.tree_rate:,.0f} blocks/s", f"{python.tree_rate:,.0f} blocks/s",
           ratio(native.tree_rate, python.tree_rate), "≥ 10,000,000/s")
    yield ("index apply in-process (decode + sequence + tree + journal encode), per CPU "
           "second",
           f"{native.index_rate:,.0f} blocks/s", f"{python.index_rate:,.0f} blocks/s",
           ratio(native.index_rate, python.index_rate), "≥ 10,000,000/s")
    yield ("index CPU per block (same)", f"{native.index_us:.3f} µs",
           f"{python.index_us:.3f} µs", ratio(python.index_us, native.index_us), "≤ 0.5 µs")
    yield ("index CPU per block, update by update (compiled core; before: no planned Sync "
           "batch)", f"{native.index_per_update_us:.3f} µs", "",
           ratio(native.index_per_update_us, native.index_us), "")
    yield ("replica CPU per block (decode + apply)", f"{native.replica_us:.3f} µs",
           f"{python.replica_us:.3f} µs", ratio(python.replica_us, native.replica_us),
           "≤ 0.25 µs")
    yield ("replica CPU per block, op by op (compiled core; before: no batch replay)",
           f"{native.replica_per_op_us:.3f} µs", "", ratio(native.replica_per_op_us,
                                                          native.replica_us), "")
    if native.churn_us:
        yield ("replica CPU per update, steady state (stores = removals, the tree keeps its "
               "size): batch replay", f"{native.churn_us:.3f} µs",
               f"{python.churn_us:.3f} µs", ratio(python.churn_us, native.churn_us),
               "≤ 0.25 µs")
        yield ("same, op by op (compiled core)", f"{native.churn_per_op_us:.3f} µs", "",
               ratio(native.churn_per_op_us, native.churn_us), "")
    yield ("Match, 256 keys, 64 workers, p50 / p99", f"{native.match[0]:.1f} / "
           f"{native.match[1]:.1f} µs", f"{python.match[0]:.1f} / {python.match[1]:.1f} µs",
           ratio(python.match[0], native.match[0]), "p50 ≤ 10 µs")
    yield ("index RSS growth per distinct block", f"{native.rss_per_block:.0f} B",
           f"{python.rss_per_block:.0f} B", ratio(python.rss_per_block, native.rss_per_block),
           "")
    yield ("bytes_estimate per block", f"{native.estimate_per_block:.0f} B",
           f"{python.estimate_per_block:.0f} B", "", "")
    if big is not None:
        per_block, nodes = big
        yield (f"one tree's RSS growth per block ({nodes / 1e6:.1f}M blocks)",
               f"{per_block:.0f} B", "(not run)", "", "≤ 80 B")


def write_report(path: Path, args: argparse.Namespace, native: CoreRun, python: CoreRun,
                 big: tuple[float, int] | None, work: Workload, seconds: float) -> None:
    command = f"cortex bench core --blocks {args.blocks} --churn {args.churn}" + (
        f" --big {args.big}" if args.big else "")
    lines = [
        "# `cortex bench core`",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}, numpy {np.__version__}. Generated by `{command}` "
        f"in {seconds:.0f} s; load average {os.getloadavg()[1]:.1f} over its last 5 minutes "
        "(other processes sharing the cores slow both cores' figures alike).",
        "",
        f"Workload: {work.distinct_blocks:,} distinct blocks, {len(work.stores):,} StoreBlocks "
        f"chains ({work.stored_blocks:,} blocks stored) over {work.workers} workers, in "
        f"UpdateBatch messages of {BATCH_UPDATES} updates; {len(work.queries):,} queries of "
        "256 blocks. Both cores run the same bytes in the same process, one after the other. "
        "Rates are blocks per CPU second of the (single-threaded) process: on a shared "
        "machine its wall-clock rate is lower by the share of the core it got; Match "
        "latencies are wall-clock.",
        "",
        *table(("measurement", "compiled core", "pure Python", "ratio", "target"),
               list(rows(native, python, big))),
        "",
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))
    print(f"report written to {path}")


def run(args: argparse.Namespace) -> int:
    if cores.Core.NATIVE not in cores.available():
        raise SystemExit("the compiled ledger core is not built: nothing to compare")
    started = time.perf_counter()
    work = make_workload(args.blocks, args.workers, args.queries)
    batches = update_batches(work)
    queries = [q.tolist() for q in work.queries]
    native = measure(cores.Core.NATIVE, work, batches, queries, args.churn)
    python = measure(cores.Core.PYTHON, work, batches, queries, args.churn)
    cores.use(cores.Core.NATIVE)
    big = big_tree_bytes(args.big, args.workers) if args.big else None
    for row in rows(native, python, big):
        print("  " + " | ".join(row), flush=True)
    write_report(Path(args.out), args, native, python, big, work,
                 time.perf_counter() - started)
    return 0


def register(bench_subparsers: argparse._SubParsersAction[Any]) -> None:
    parser = bench_subparsers.add_parser(
        "core", help="ledger tree cores: compiled vs pure Python (apply, Match, CPU, bytes)")
    parser.add_argument("--blocks", type=int, default=1_000_000, help="distinct blocks")
    parser.add_argument("--workers", type=int, default=64)
    parser.add_argument("--queries", type=int, default=5000, help="Match queries")
    parser.add_argument("--big", type=int, default=0,
                        help="also measure one compiled tree of this many blocks (bytes)")
    parser.add_argument("--churn", type=int, default=300,
                        help="steady-state replica batches (stores and removals; 0: none)")
    parser.add_argument("--out", default="docs/bench/core.md", help="report path")
    parser.set_defaults(func=run)
