"""A live replica batch applied from its bytes by the compiled core (``PlannedOps``) changes
a replica exactly as the per-op path does: the same trees slot for slot (keys, parents,
holders, recency), the same places, the same reported changes, and the same refusals —
for well-formed ops and for every malformed or unusual one (ragged key lists, a missing or
invalid source, pair lists of two lengths, repeated and unknown fields, an unplaced source,
a chain the tree refuses)."""

from __future__ import annotations

from typing import Any
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cortex.hashing import Engine, HashDomain
from cortex.ledger import cores
from cortex.ledger.codec import domain_to_pb, keys_to_le, pb, source_to_pb
from cortex.ledger.model import LedgerState, Source, Tier
from cortex.ledger.replica import LedgerReplica, OutOfSync, ReplicaChanges, snapshot_batches
from cortex.ledger.view import LedgerView

DOMAINS = (HashDomain("alpha", 16, Engine.SGLANG), HashDomain("beta", 4, Engine.VLLM))
SOURCES = (Source("w0"), Source("w1"), Source("w1", 1), Source("w2", 0, Tier.HOST),
           Source("ghost"))  # the last is never attached
ROOT = DOMAINS[0].root_key()
KEYS = st.integers(1, 24)

WEIRD = ("repeated_keys", "unknown_field", "ragged", "no_source", "bad_tier",
         "pair_lengths", "two_sources", "parent_in_keys")
CHAIN = st.tuples(KEYS, st.integers(0, 6))  # keys chain as k - 1 -> k (ROOT -> 1)
OP = st.one_of(
    st.tuples(st.just("store"), st.integers(0, 4), CHAIN),
    st.tuples(st.just("store_pairs"), st.integers(0, 4), st.lists(KEYS, max_size=5)),
    st.tuples(st.just("remove"), st.integers(0, 4), st.lists(KEYS, max_size=5)),
    st.tuples(st.just("attach"), st.integers(0, 4), st.integers(0, 1),
              st.sampled_from([LedgerState.READY, LedgerState.STALE])),
    st.tuples(st.sampled_from(["clear", "detach"]), st.integers(0, 4)),
    st.tuples(st.just("evict"), st.integers(0, 1), st.lists(KEYS, max_size=4)),
    st.tuples(st.just("weird"), st.integers(0, 3), st.sampled_from(WEIRD), CHAIN),
)


def parent(key: int) -> int:
    return ROOT if key == 1 else key - 1


def chain(start: int, length: int) -> list[int]:
    return list(range(start, min(start + length, 25)))


def encode(spec: tuple[Any, ...]) -> pb.ReplicaOp:
    op = pb.ReplicaOp()
    kind = spec[0]
    if kind == "evict":
        domain_to_pb(DOMAINS[spec[1]], op.evict.domain)
        op.evict.keys_le = keys_to_le(spec[2])
        return op
    source_to_pb(SOURCES[spec[1]], op.source)
    if kind == "store":
        keys = chain(*spec[2])
        op.store.parent_key = parent(keys[0]) if keys else 0
        op.store.keys_le = keys_to_le(keys)
    elif kind == "store_pairs":
        keys = sorted(spec[2])  # parents first
        op.store_pairs.parent_keys_le = keys_to_le([parent(k) for k in keys])
        op.store_pairs.keys_le = keys_to_le(keys)
    elif kind == "remove":
        op.remove.keys_le = keys_to_le(spec[2])
    elif kind == "attach":
        domain_to_pb(DOMAINS[spec[2]], op.attach.domain)
        op.attach.state = int(spec[3])  # type: ignore[assignment]
    elif kind == "clear":
        op.clear.SetInParent()
    elif kind == "detach":
        op.detach.SetInParent()
    else:
        return weird(op, spec[2], chain(*spec[3]) or [1])
    return op


def weird(op: pb.ReplicaOp, how: str, keys: list[int]) -> pb.ReplicaOp:
    """A store or removal encoded the way the compiled core leaves to the protobuf runtime,
    or malformed."""
    op.store.parent_key = parent(keys[0])
    op.store.keys_le = keys_to_le(keys)
    if how == "repeated_keys":  # the per-op path reads keys_le only
        op.store.keys.extend(k + 100 for k in keys)
    elif how == "unknown_field":  # kept by the runtime, ignored by the reader
        return pb.ReplicaOp.FromString(op.SerializeToString() + b"\x98\x06\x01")
    elif how == "ragged":
        op.store.keys_le += b"\x01"
    elif how == "no_source":
        op.ClearField("source")
    elif how == "bad_tier":
        op.source.tier = 9  # type: ignore[assignment]
    elif how == "pair_lengths":
        op.store_pairs.parent_keys_le = keys_to_le([parent(k) for k in keys[:-1]])
        op.store_pairs.keys_le = keys_to_le(keys)
    elif how == "two_sources":  # the runtime merges them: dp_rank from the second
        extra = pb.ReplicaOp()
        extra.source.dp_rank = 1
        return pb.ReplicaOp.FromString(op.SerializeToString() + extra.SerializeToString())
    else:  # "parent_in_keys": the tree refuses the chain when it gets to it
        op.store.parent_key = keys[0]
    return op


def start_view() -> LedgerView:
    view = LedgerView()
    for i, source in enumerate(SOURCES[:4]):
        view.attach(source, DOMAINS[i % 2], LedgerState.READY)
        view.store(source, ROOT if i % 2 == 0 else DOMAINS[1].root_key(),
                   [1000 * (i + 1) + j for j in range(4)], 1)
    view.store(SOURCES[0], ROOT, [1, 2, 3], 1)
    return view


def synced(wire_replay: bool) -> LedgerReplica:
    replica = LedgerReplica(clock=lambda: 0.0, wire_replay=wire_replay)
    replica.begin()
    for seq, batch in enumerate(snapshot_batches(start_view(), (), "i", 1), 1):
        batch.seq = seq
        replica.apply(batch)
    return replica


def state(replica: LedgerReplica) -> object:
    trees = {}
    for domain, tree in replica.view.trees.items():
        c = tree.columns()
        trees[domain] = (c.keys.tolist(), c.parents.tolist(), c.holders.tolist(), c.sources,
                         tree.live_recency().tolist())
    return trees, dict(replica.view.places), replica.version, replica.state


def outcome(replica: LedgerReplica, batch: pb.ReplicaBatch) -> object:
    try:
        changes = replica.apply(pb.ReplicaBatch.FromString(batch.SerializeToString()))
    except OutOfSync:
        return "out of sync"
    return (sorted((s, k.tolist()) for s, k in changes.removed), changes.cleared,
            changes.reset)


@settings(max_examples=150, deadline=None)
@given(batches=st.lists(st.lists(OP, max_size=8), min_size=1, max_size=4))
def test_wire_replay_changes_a_replica_as_the_per_op_path_does(
        batches: list[list[tuple[Any, ...]]]) -> None:
    planned, per_op = synced(True), synced(False)
    for seq, specs in enumerate(batches, 2):
        batch = pb.ReplicaBatch(index_id="i", seq=seq, version=seq, applied_unix_s=1.0)
        for spec in specs:
            batch.ops.add().CopyFrom(encode(spec))
        got, want = outcome(planned, batch), outcome(per_op, batch)
        assert got == want
        assert state(planned) == state(per_op)
        if got == "out of sync":
            break
    for tree in planned.view.trees.values():
        tree.check_invariants()


def test_stores_and_removals_take_the_compiled_path_in_one_call(
        tree_core: cores.Core) -> None:
    replica = synced(True)
    batch = pb.ReplicaBatch(index_id="i", seq=2, version=2)
    for spec in [("store", 0, (1, 5)), ("store", 1, (7, 1)), ("remove", 0, [2, 3]),
                 ("store_pairs", 2, [9])]:
        batch.ops.add().CopyFrom(encode(spec))
    if tree_core is cores.Core.PYTHON:
        assert cores.plan_ops(batch.SerializeToString()) is None
        changes = replica.apply(batch)
    else:
        from cortex.ledger.native import PlannedOps

        with mock.patch.object(PlannedOps, "replay", autospec=True,
                               side_effect=PlannedOps.replay) as replay:
            changes = replica.apply(batch)
        assert replay.call_count == 1  # every op in one call
        planned = PlannedOps(batch.SerializeToString())
        assert (planned.count, planned.python_ops, len(planned.sources)) == (4, [], 3)
    assert [(s, k.tolist()) for s, k in changes.removed] == [(SOURCES[0], [2, 3])]
    assert changes == ReplicaChanges(removed=changes.removed)
    holds = {s: b for s, b, _ in replica.match(DOMAINS[0], [1, 2, 3, 4, 5]).sources}
    assert holds[SOURCES[0]] == 1


@pytest.mark.parametrize("raw", [b"\x42\x05ab", b"\xff", b"\x43\x00"])
def test_bytes_that_are_not_a_batch_are_not_planned(raw: bytes) -> None:
    assert cores.plan_ops(raw) is None


def test_a_forged_plan_is_refused_without_touching_a_tree(tree_core: cores.Core) -> None:
    if tree_core is cores.Core.PYTHON:
        pytest.skip("the compiled core's interface")
    from cortex.ledger._core import Tree, replay_replica_ops

    batch = pb.ReplicaBatch()
    batch.ops.add().CopyFrom(encode(("store", 0, (1, 2))))
    raw = batch.SerializeToString()
    plan = bytearray(cores.plan_ops(raw)._plan)  # type: ignore[union-attr]
    view = np.frombuffer(plan, np.int64)
    view[2] = len(raw)  # keys (the third word) past the end of the batch
    tree = Tree()
    with pytest.raises(ValueError, match="not this batch's"):
        replay_replica_ops(raw, plan, 0, [(tree, 0)], 0)
    with pytest.raises(TypeError, match="Tree, bit"):
        replay_replica_ops(raw, cores.plan_ops(raw)._plan, 0, [("tree", 0)], 0)  # type: ignore[union-attr,list-item]
    with pytest.raises(ValueError, match="source bit"):
        replay_replica_ops(raw, cores.plan_ops(raw)._plan, 0, [(tree, 64)], 0)  # type: ignore[union-attr]
    assert tree.nodes == 0
