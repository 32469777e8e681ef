"""The index applies a Sync batch from its bytes (the compiled core's planned path) exactly as
it applies it update by update (the pure-Python path, the specification).

Differential test: random ingest streams (snapshots, stores, removals, clears, state changes,
removals of sources, gaps, duplicates, stale epochs, domain moves, updates without a source,
empty stores, keys in the repeated field instead of the packed twin) are cut into UpdateBatch
messages and fed through :meth:`IndexService.sync_batches` twice: once with the pure-Python
tree core and ``columnar_sync`` off, once with the compiled core and it on. With a replica
subscribed (the journal on) and a memory budget that evicts, after every batch both must
agree on the replies, the version, every source's record, the change log, the replica
journal (as records) and every Match.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any
from unittest import mock

import numpy as np
import pytest
from google.protobuf.message import DecodeError
from hypothesis import example, given, settings
from hypothesis import strategies as st

from cortex.hashing import Engine, HashDomain
from cortex.index.config import IndexConfig
from cortex.index.metrics import IndexMetrics
from cortex.index.prefix_index import PrefixIndex
from cortex.index.service import IndexService
from cortex.ledger import cores
from cortex.ledger.codec import ops_from_wire, pb, update_to_pb
from cortex.ledger.cores import node_bytes
from cortex.ledger.model import (
    ClearBlocks,
    LedgerState,
    LedgerUpdate,
    RemoveBlocks,
    RemoveSource,
    SetState,
    Snapshot,
    Source,
    StoreBlocks,
)
from cortex.ledger.view import ViewOp, WireOps

DOMAINS = (HashDomain("alpha", 16, Engine.SGLANG), HashDomain("beta", 4, Engine.VLLM))
SOURCES = (Source("w0"), Source("w1"), Source("w1", 1), Source("w2"))
CHAINS, LENGTH = 4, 10


def chain(domain: HashDomain, c: int) -> list[int]:
    base = (DOMAINS.index(domain) + 1) << 40
    return [base + c * 1000 + i for i in range(LENGTH)]


STEP = st.tuples(
    st.sampled_from(["snapshot", "store", "store", "store", "store", "remove", "remove",
                     "clear", "state", "drop", "gap", "dup", "stale", "move", "nosource",
                     "empty", "repeated", "cut"]),
    st.integers(0, len(SOURCES) - 1), st.integers(0, CHAINS - 1),
    st.integers(0, LENGTH - 1), st.integers(1, 6),
)


def batches(steps: list[tuple[str, int, int, int, int]]) -> list[bytes]:
    """The ingest stream the steps describe, as encoded UpdateBatch messages."""
    epoch: dict[Source, int] = {}
    seq: dict[Source, int] = {}
    where: dict[Source, HashDomain] = {}
    out: list[bytes] = []
    batch = pb.UpdateBatch(ingest_id="ingest-a")

    def add(source: Source, op: Any, *, gap: int = 0, at_seq: int | None = None,
            at_epoch: int | None = None) -> pb.LedgerUpdate:
        if isinstance(op, Snapshot):
            epoch[source] = epoch.get(source, 0) + 1
            seq[source] = 0
        elif at_seq is None:
            seq[source] = seq.get(source, 0) + 1 + gap
        update = LedgerUpdate(source, where.setdefault(source, DOMAINS[0]),
                              epoch.get(source, 1) if at_epoch is None else at_epoch,
                              seq.get(source, 0) if at_seq is None else at_seq, op)
        msg = batch.updates.add()
        update_to_pb(update, msg)
        return msg

    for s in SOURCES:  # every source starts in sync
        domain = where.setdefault(s, DOMAINS[0])
        keys = chain(domain, 0)[:4]
        add(s, Snapshot([domain.root_key(), *keys[:-1]], keys))
    for kind, si, c, start, length in steps:
        source = SOURCES[si]
        if kind == "cut":
            out.append(batch.SerializeToString())
            batch = pb.UpdateBatch(ingest_id="ingest-a" if start % 3 else "ingest-b")
            continue
        if kind == "move":
            where[source] = DOMAINS[1] if where.get(source, DOMAINS[0]) == DOMAINS[0] else \
                DOMAINS[0]
        domain = where.setdefault(source, DOMAINS[0])
        keys = chain(domain, c)
        parent = domain.root_key() if c == 0 else chain(domain, c - 1)[start // 2]
        if kind in ("snapshot", "move"):
            held = keys[:start + length]
            add(source, Snapshot([parent, *held[:-1]], held))
        elif kind in ("store", "gap", "repeated"):
            msg = add(source, StoreBlocks(parent, keys[start:start + length] or keys[-1:]),
                      gap=1 if kind == "gap" else 0)
            if kind == "repeated":  # the repeated field instead of the packed twin
                msg.store.keys.extend(np.frombuffer(msg.store.keys_le, "<u8").tolist())
                msg.store.keys_le = b""
        elif kind == "empty":
            add(source, StoreBlocks(parent, []))
        elif kind == "remove":
            add(source, RemoveBlocks(keys[start:start + length]))
        elif kind == "clear":
            add(source, ClearBlocks("all_blocks_cleared"))
        elif kind == "state":
            add(source, SetState(LedgerState.STALE if length % 2 else LedgerState.READY, "x"))
        elif kind == "drop":
            add(source, RemoveSource("lease_lost"))
        elif kind == "dup":
            add(source, StoreBlocks(parent, keys[:2]), at_seq=max(0, seq.get(source, 0) - 1))
        elif kind == "stale":
            add(source, StoreBlocks(parent, keys[:2]),
                at_epoch=max(0, epoch.get(source, 1) - 1), at_seq=1)
        else:  # "nosource"
            add(source, StoreBlocks(parent, keys[:2])).ClearField("source")
    out.append(batch.SerializeToString())
    return out


def record(op: ViewOp) -> tuple[Any, ...]:
    """``op``'s fields; a removal's or an eviction's keys as a set (the cores walk them in
    the order of their own slots, which is no part of the contract: a replica evicts the
    set, ``RadixHashTree.evict_keys``)."""
    fields: list[Any] = [type(op).__name__]
    for name in op.__slots__:
        value = getattr(op, name)
        if hasattr(value, "__len__") and not isinstance(value, str | tuple):
            value = [int(k) for k in value]
            if fields[0] in ("Remove", "Evict"):
                value.sort()
        fields.append(value)
    return tuple(fields)


def observe(core: PrefixIndex) -> Iterator[object]:
    yield core.version
    yield sorted((r.source, r.domain, r.epoch, r.seq, r.effective_state, r.reason, r.removed)
                 for r in core.ledger)
    yield sorted((s, p.domain, p.state) for s, p in core.view.places.items())
    yield [(c.version, c.domain, c.source, None if c.keys is None else sorted(c.keys.tolist()))
           for c in core.changes._ring]  # each record at the version its update took
    for change in core.changes.since(1, core.version, model=""):
        yield (change.from_version, change.to_version, change.domain, change.removed_source,
               [sorted(k.tolist()) for k in change.removed_keys], change.cleared, change.reset)
    for model, op in core.take_journal():
        for one in ops_from_wire(op) if isinstance(op, WireOps) else [op]:
            yield model, record(one)
    for domain in DOMAINS:
        for c in range(CHAINS):
            result = core.match(domain.model, block_keys=chain(domain, c))
            yield sorted((s, b, int(state)) for s, b, state in result.sources)
    yield sorted(core.owners._owner.items())


async def run(encoded: list[bytes], core_kind: cores.Core, columnar: bool,
              budget_nodes: int) -> list[list[object]]:
    before = cores.active()
    cores.use(core_kind)
    try:
        core = PrefixIndex(memory_budget_bytes=budget_nodes * node_bytes(1), start_version=1,
                           wall_clock=lambda: 1000.0)
        service = IndexService(core, IndexConfig(columnar_sync=columnar),
                               IndexMetrics(lambda: core), "index-a")
        core.start_journal()
        seen: list[list[object]] = []

        async def stream() -> AsyncIterator[pb.UpdateBatch]:
            for data in encoded:
                yield pb.UpdateBatch.FromString(data)

        async for reply in service.sync_batches(stream()):
            seen.append([reply.applied_batches, reply.index_version,
                         sorted((s.worker_id, s.dp_rank) for s in reply.resync),
                         *observe(core)])
        return seen
    finally:
        cores.use(before)


@settings(max_examples=200, deadline=None)
@given(steps=st.lists(STEP, min_size=3, max_size=60), budget_nodes=st.sampled_from([0, 30, 70]))
@example(steps=[("snapshot", 0, 0, 0, 1)] * 5 + [  # a removal the cores drop in other orders
    ("snapshot", 0, 3, 2, 1), ("snapshot", 1, 0, 0, 1), ("snapshot", 1, 2, 0, 2),
    ("remove", 1, 2, 0, 2)], budget_nodes=0)
def test_planned_sync_applies_like_the_pure_python_path(
        steps: list[tuple[str, int, int, int, int]], budget_nodes: int) -> None:
    encoded = batches(steps)
    want = asyncio.run(run(encoded, cores.Core.PYTHON, False, budget_nodes))
    got = asyncio.run(run(encoded, cores.Core.NATIVE, True, budget_nodes))
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g == w, i


def test_a_batch_of_in_order_stores_takes_the_planned_path() -> None:
    """The planned path is taken (not only agreed with): a batch of stores of in-sync
    sources leaves no update to the per-update path."""
    encoded = batches([("store", i % len(SOURCES), i % CHAINS, 0, 5) for i in range(12)])
    with mock.patch.object(IndexService, "_apply", autospec=True,
                           side_effect=IndexService._apply) as per_update:
        asyncio.run(run(encoded, cores.Core.NATIVE, True, 0))
    assert per_update.call_count == len(SOURCES)  # the four snapshots only


@settings(max_examples=150, deadline=None)
@given(steps=st.lists(STEP, min_size=1, max_size=20),
       edits=st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 255)),
                      min_size=1, max_size=4),
       cut=st.integers(0, 64))
# a memory-budget eviction whose keys the cores list in different orders (CI, 2026-12-06)
@example(steps=[("snapshot", 0, 0, 0, 1)] * 12 + [
    ("snapshot", 1, 0, 0, 1), ("snapshot", 3, 0, 0, 1), ("store", 2, 0, 4, 1),
    ("move", 0, 0, 0, 1), ("snapshot", 2, 1, 2, 2), ("snapshot", 0, 0, 0, 5),
    ("snapshot", 1, 3, 4, 6), ("store", 0, 2, 0, 6)], edits=[(2, 0)], cut=0)
def test_mutated_batches_apply_alike_or_are_refused(
        steps: list[tuple[str, int, int, int, int]], edits: list[tuple[int, int]],
        cut: int) -> None:
    """Bytes flipped or cut off: the planner refuses them with ValueError or plans them; the
    protobuf runtime parses them or refuses them (the codec's INVALID_ARGUMENT); what it
    parses applies on both paths alike (unknown fields, odd lengths and all)."""
    mutated = []
    for data in batches(steps):
        raw = bytearray(data)
        for at, value in edits:
            raw[at % len(raw)] = value
        mutated.append(bytes(raw[:max(1, len(raw) - cut)]))
    parsed = []
    for data in mutated:
        try:
            cores.plan_updates(data)  # never crashes; None when not a message
            parsed.append(pb.UpdateBatch.FromString(data).SerializeToString())
        except DecodeError:
            continue
    want = asyncio.run(run(parsed, cores.Core.PYTHON, False, 30))
    got = asyncio.run(run(parsed, cores.Core.NATIVE, True, 30))
    assert got == want


@pytest.mark.parametrize("raw", [b"", b"\x12", b"\x12\x05\x0a", b"\x12\x03\x0a\x01", b"\xff" * 9,
                                 b"\x12\x02\x52\x05"])
def test_bytes_that_are_not_a_batch_are_not_planned_or_plan_nothing(raw: bytes) -> None:
    planned = cores.plan_updates(raw)
    if planned is not None:
        assert planned.count <= 1
        core = PrefixIndex(start_version=1)
        stop, stores, removes = core.apply_planned(planned, 0, [None] * len(planned.sources),
                                                   [None] * len(planned.domains))
        assert (stop, stores, removes) == (0, 0, 0)


def test_a_forged_plan_is_refused_without_touching_a_tree() -> None:
    from cortex.ledger._core import apply_update_run, plan_update_batch

    data = batches([("store", 0, 1, 0, 3)])[0]
    plan, sources, _ = plan_update_batch(data)
    tree = cores.tree_type(cores.Core.NATIVE)()
    tree.add_source(SOURCES[0])
    forged = bytearray(plan)
    forged[-16:-8] = (1 << 40).to_bytes(8, "little")  # the last update's keys far outside
    target = cores.sync_target(tree, SOURCES[0], 0, 1, 0)
    targets = [target] * len(sources)
    with pytest.raises(ValueError, match="not this batch's"):
        apply_update_run(data, bytes(forged), len(plan) // 56 - 1, targets, 0, 1 << 62,
                         sources, True)
    assert tree.nodes == 0
    forged[-16:-8] = plan[-16:-8]  # the plan as made: the same call applies the store
    stop, *_ = apply_update_run(data, bytes(forged), len(plan) // 56 - 1, targets, 0, 1 << 62,
                                sources, True)
    assert stop == len(plan) // 56 and tree.nodes == 4  # its 3 keys and their parent
