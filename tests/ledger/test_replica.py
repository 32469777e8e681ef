"""A gateway's replica answers every Match exactly like the index it replicates.

Differential test: random ingest-like update streams (snapshots, stores, removals, clears,
state changes, removals of sources, gaps, stale epochs, malformed updates, lost ingests,
evictions under a small memory budget) go into a real :class:`PrefixIndex`; its journal,
encoded and decoded as on the wire, goes into a :class:`LedgerReplica` (after a snapshot,
also re-taken mid-stream and after an index restart). After every step both answer random
prefix queries, and must agree source for source.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cortex.hashing import Engine, HashDomain
from cortex.index.prefix_index import PrefixIndex
from cortex.ledger.codec import pb
from cortex.ledger.cores import new_tree, node_bytes, tree_from_columns
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
    Tier,
)
from cortex.ledger.replica import (
    LedgerReplica,
    OutOfSync,
    ReplicaChanges,
    ReplicaState,
    journal_batch,
    snapshot_batches,
)
from cortex.ledger.tree import RadixHashTree

DOMAINS = (HashDomain("alpha", 16, Engine.SGLANG), HashDomain("beta", 4, Engine.VLLM))
# tier sources too: a replica's tiered matches must agree with the index's
SOURCES = (Source("w0"), Source("w1"), Source("w1", 1), Source("w2"),
           Source("w1", 0, Tier.HOST), Source("w1", 0, Tier.DISK), Source("w2", 0, Tier.SHARED))
CHAINS = 6
LENGTH = 12


def universe(domain: HashDomain) -> list[list[int]]:
    """Chains of keys (where each branches off is drawn by the test)."""
    base = (DOMAINS.index(domain) + 1) << 40
    return [[base + c * 1000 + i for i in range(LENGTH)] for c in range(CHAINS)]


@dataclass
class Feeder:
    """Ingest's side: per source an epoch, a seq and a domain; numbers every update."""

    chains: dict[HashDomain, list[list[int]]]
    parents: dict[tuple[HashDomain, int], int]
    epoch: dict[Source, int] = field(default_factory=dict)
    seq: dict[Source, int] = field(default_factory=dict)
    domain: dict[Source, HashDomain] = field(default_factory=dict)

    def parent(self, domain: HashDomain, chain: int, i: int) -> int:
        if i:
            return self.chains[domain][chain][i - 1]
        return self.parents[(domain, chain)]

    def update(self, source: Source, op: object, *, gap: int = 0) -> LedgerUpdate:
        if isinstance(op, Snapshot):
            self.epoch[source] = self.epoch.get(source, 0) + 1
            self.seq[source] = 0
        else:
            self.seq[source] = self.seq.get(source, 0) + 1 + gap
        domain = self.domain.setdefault(source, DOMAINS[0])
        return LedgerUpdate(source, domain, self.epoch.get(source, 1), self.seq[source],
                            op)  # type: ignore[arg-type]


def wire(batch: pb.ReplicaBatch, seq: int) -> pb.ReplicaBatch:
    """Through the wire, numbered like a stream does."""
    batch.seq = seq
    return pb.ReplicaBatch.FromString(batch.SerializeToString())


class Link:
    """One replica stream from ``core`` to ``replica``."""

    def __init__(self, core: PrefixIndex, replica: LedgerReplica, index_id: str) -> None:
        self.core, self.replica, self.index_id = core, replica, index_id
        self.seq = 0
        core.start_journal()
        core.take_journal()  # what is already applied reaches the replica by its snapshot
        replica.begin()
        for batch in snapshot_batches(core.view, (), index_id, core.version, max_bytes=2048):
            self.send(batch)
        assert replica.state is ReplicaState.SYNCED

    def send(self, batch: pb.ReplicaBatch) -> None:
        self.seq += 1
        self.replica.apply(wire(batch, self.seq))

    def flush(self) -> None:
        ops = [op for _, op in self.core.take_journal()]
        if ops:
            self.send(journal_batch(ops, self.index_id, self.core.version, 1.0))


def answers(core: PrefixIndex, replica: LedgerReplica, query: list[int],
            domain: HashDomain) -> tuple[list[tuple[Source, int, int]], ...]:
    got = sorted((s, b, int(st)) for s, b, st in replica.match(domain, query).sources)
    result = core.match(domain.model, block_keys=query) if query else None
    want = sorted((s, b, int(st)) for s, b, st in result.sources) if result else got
    return got, want


OPS = st.lists(
    st.tuples(
        st.sampled_from(["snapshot", "snapshot", "store", "store", "store", "store", "remove",
                         "remove", "clear", "state", "drop", "gap", "stale", "bad",
                         "lose_ingest", "move", "resubscribe", "restart", "drain"]),
        st.integers(0, len(SOURCES) - 1),
        st.integers(0, CHAINS - 1),
        st.integers(0, LENGTH - 1),
        st.integers(1, 5),
    ),
    min_size=5, max_size=45,
)


@mock.patch.object(RadixHashTree, "sync_clear_max", 3)  # clears and removals drain in steps
@settings(max_examples=40, deadline=None)
@given(ops=OPS, branches=st.lists(st.tuples(st.integers(0, CHAINS - 1),
                                            st.integers(0, LENGTH - 1)),
                                  min_size=CHAINS, max_size=CHAINS),
       budget_nodes=st.sampled_from([0, 40, 90]))
def test_replica_answers_like_the_index(ops: list[tuple[str, int, int, int, int]],
                                        branches: list[tuple[int, int]],
                                        budget_nodes: int) -> None:
    chains = {d: universe(d) for d in DOMAINS}
    parents = {}
    for d in DOMAINS:
        for c, (other, at) in enumerate(branches):
            parents[(d, c)] = (d.root_key() if other >= c or c == 0
                               else chains[d][other][at])
    feeder = Feeder(chains, parents)

    def new_core() -> PrefixIndex:
        return PrefixIndex(memory_budget_bytes=budget_nodes * node_bytes(1),
                           ingest_grace_s=1.0, start_version=1, wall_clock=lambda: 1000.0)

    def snapshot_all(core: PrefixIndex, length: int) -> None:
        """What ingest sends a (new) index first: every source's ledger."""
        for i, source in enumerate(SOURCES):
            domain = feeder.domain.get(source, DOMAINS[0])
            keys = chains[domain][i % CHAINS][:length]
            parents = [feeder.parent(domain, i % CHAINS, j) for j in range(len(keys))]
            core.apply(feeder.update(source, Snapshot(parents, keys)), "ingest")

    core = new_core()
    replica = LedgerReplica(clock=lambda: 0.0)
    snapshot_all(core, LENGTH // 2)  # before the replica subscribes: its snapshot has them
    link = Link(core, replica, "index-a")
    clock = 0.0
    for step, (kind, si, chain, start, length) in enumerate(ops):
        source = SOURCES[si]
        domain = feeder.domain.get(source, DOMAINS[0])
        keys = chains[domain][chain]
        held = keys[start:start + length]
        clock += 0.1
        if kind == "restart":
            core = new_core()
            link = Link(core, replica, f"index-{step}")
            snapshot_all(core, length)  # after: they reach the replica as live batches
            link.flush()
            continue
        if kind == "drain":  # either side takes retired ledgers off at its own pace
            for _ in range(length):
                (core.view if start % 2 else replica.view).sweep(slots=chain + 1)
            continue
        if kind == "resubscribe":
            link.flush()
            link = Link(core, replica, link.index_id)
            continue
        if kind == "lose_ingest":
            core.expire_ingests(clock + 10.0)
            link.flush()
            continue
        if kind == "move":  # the source's next snapshot names another domain
            feeder.domain[source] = DOMAINS[1] if domain == DOMAINS[0] else DOMAINS[0]
            kind = "snapshot"
            domain = feeder.domain[source]
            keys = chains[domain][chain]
            held = keys[start:start + length]
        prefix = keys[:start + length]  # chains are matched from their first block
        if kind == "snapshot":
            pairs = [(feeder.parent(domain, chain, i), keys[i]) for i in range(len(prefix))]
            op: object = Snapshot([p for p, _ in pairs], [k for _, k in pairs])
        elif kind in ("store", "gap"):
            op = StoreBlocks(feeder.parent(domain, chain, 0), prefix)
        elif kind == "remove":
            op = RemoveBlocks(held[:2])
        elif kind == "clear":
            op = ClearBlocks("all_blocks_cleared")
        elif kind == "state":
            op = SetState(LedgerState.STALE if length % 2 else LedgerState.READY, "x")
        elif kind == "drop":
            op = RemoveSource("lease_lost")
        elif kind == "bad":
            core.reject(source, domain, "malformed")
            link.flush()
            continue
        else:  # "stale": an update of an older epoch is ignored
            update = feeder.update(source, StoreBlocks(parents[(domain, 0)], keys[:1]))
            core.apply(LedgerUpdate(source, domain, max(0, update.epoch - 1), 1, update.op),
                       "ingest")
            link.flush()
            continue
        update = feeder.update(source, op, gap=1 if kind == "gap" else 0)
        core.ingest_heard("ingest", clock)
        core.apply(update, "ingest")
        link.flush()
        for d in DOMAINS:
            for c in range(CHAINS):
                for cut in (LENGTH // 2, LENGTH):
                    got, want = answers(core, replica, chains[d][c][:cut], d)
                    assert got == want, (step, kind, d.model, c, cut)
        records = {r.source: (r.domain, r.effective_state) for r in core.ledger if not r.removed}
        placed = {s: (p.domain, p.state) for s, p in core.view.places.items()}
        assert placed == records, (step, kind)  # the view shows every sequencing record
        assert replica.states() == {s: st for s, (_, st) in placed.items()}
    for tree in replica.view.trees.values():
        tree.check_invariants()


def test_snapshot_larger_than_one_batch_is_assembled() -> None:
    core = PrefixIndex(start_version=1)
    domain = DOMAINS[0]
    keys = list(range(1, 20_001))
    devices = SOURCES[:4]  # each its own prefix (a tier's count depends on its device's)
    for i, source in enumerate(devices):
        core.apply(LedgerUpdate(source, domain, 1, 0,
                                Snapshot([domain.root_key(), *keys[:-1]][: 5000 * (i + 1)],
                                         keys[: 5000 * (i + 1)])))
    batches = list(snapshot_batches(core.view, (), "i", core.version, max_bytes=64 << 10))
    assert len(batches) > 4 and batches[-1].synced and not batches[0].synced
    replica = LedgerReplica()
    replica.begin()
    for seq, batch in enumerate(batches, 1):
        replica.apply(wire(batch, seq))
    got = sorted((s, b) for s, b, _ in replica.match(domain, keys).sources)
    assert got == [(s, 5000 * (i + 1)) for i, s in enumerate(devices)]


def journal_changes(link: Link) -> ReplicaChanges:
    """Send what ``link``'s index journaled since the last call; what the replica lost."""
    link.seq += 1
    ops = [op for _, op in link.core.take_journal()]
    return link.replica.apply(wire(journal_batch(ops, link.index_id, link.core.version, 1.0),
                                   link.seq))


def test_a_snapshot_after_a_lost_ingest_reports_the_source_cleared() -> None:
    """Once its ingest is lost the index holds nothing for a source, so the restarted
    ingest's snapshot replaces an empty ledger. It may still stand for removals nobody
    journaled (blocks stored and evicted while no ingest forwarded them): the replica must
    report the source cleared, or a gateway keeps predicting the evicted blocks."""
    core = PrefixIndex(start_version=1, ingest_grace_s=1.0)
    domain, source = DOMAINS[0], SOURCES[0]
    root, keys = domain.root_key(), list(range(1, 9))
    core.apply(LedgerUpdate(source, domain, 1, 0, Snapshot([root, *keys[:-1]], keys)), "ingest")
    core.ingest_heard("ingest", 0.0)
    link = Link(core, LedgerReplica(), "i")
    assert core.expire_ingests(2.0) == [("ingest", [source])]  # silent past the grace
    assert journal_changes(link).cleared == {source}
    # the restarted ingest's snapshot: the engine evicted keys[4:] meanwhile
    core.apply(LedgerUpdate(source, domain, 2, 0, Snapshot([root, *keys[:3]], keys[:4])),
               "ingest")
    assert journal_changes(link).cleared == {source}
    assert [(s, b) for s, b, _ in link.replica.match(domain, keys).sources] == [(source, 4)]


def test_out_of_order_batches_are_refused_and_leave_the_view() -> None:
    core = PrefixIndex(start_version=1)
    domain = DOMAINS[0]
    core.apply(LedgerUpdate(SOURCES[0], domain, 1, 0, Snapshot([domain.root_key()], [7])))
    replica = LedgerReplica()
    replica.begin()
    (snap,) = snapshot_batches(core.view, (), "i", core.version)
    with pytest.raises(OutOfSync, match="seq"):
        replica.apply(wire(snap, 2))
    with pytest.raises(OutOfSync, match="snapshot"):
        replica.apply(wire(journal_batch([], "i", 1, 0.0), 1))
    replica.begin()
    replica.apply(wire(snap, 1))
    with pytest.raises(OutOfSync, match="index_id"):
        replica.apply(wire(journal_batch([], "other", 1, 0.0), 2))
    bad = pb.ReplicaBatch(index_id="i", seq=2)  # the refused batch did not count
    bad.ops.add().store.keys_le = b"\x01\x02"  # no source, ragged keys
    with pytest.raises(OutOfSync, match="malformed"):
        replica.apply(bad)
    assert [(s, b) for s, b, _ in replica.match(domain, [7]).sources] == [(SOURCES[0], 1)]


def test_columns_round_trip_and_bad_columns_are_refused() -> None:
    tree = new_tree()
    tree.store(SOURCES[0], 1, [2, 3, 4], now=1)
    tree.store(SOURCES[1], 2, [5], now=1)
    tree.remove(SOURCES[0], [4])
    copy = tree_from_columns(tree.columns())
    copy.check_invariants()
    assert copy.match([2, 3, 4], 2) == tree.match([2, 3, 4], 2)
    assert copy.match([2, 5], 2) == tree.match([2, 5], 2)
    columns = tree.columns()
    columns.parents[0] = 10_000
    with pytest.raises(ValueError, match="out of range"):
        tree_from_columns(columns)
    columns = tree.columns()
    live = np.flatnonzero(columns.parents != -2)
    columns.keys[live[1]] = columns.keys[live[0]]
    with pytest.raises(ValueError, match="twice"):
        tree_from_columns(columns)


def test_evicting_keys_of_another_tree_keeps_children_as_roots() -> None:
    tree = new_tree()
    tree.store(SOURCES[0], 1, [2, 3, 4], now=1)
    eviction = tree.evict_keys([3])  # not closed under descendants: 4 stays, as a root
    assert eviction.keys.tolist() == [3] and tree.parent_of(4) is None
    assert tree.match([2, 3, 4], 2)[0] == 1
    tree.check_invariants()
    assert tree.touch([2, 99], now=5) == 1
    assert np.array_equal(tree.evict_keys([404]).keys, np.zeros(0, np.uint64))
