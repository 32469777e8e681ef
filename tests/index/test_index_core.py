"""The pure core: ledger sequencing, the change log, and PrefixIndex (in memory)."""

from __future__ import annotations

import numpy as np
import pytest

from cortex.hashing import Engine, HashDomain
from cortex.index.changes import Change, ChangeLog
from cortex.index.prefix_index import PrefixIndex
from cortex.index.sequencing import Ledger, Verdict
from cortex.ledger.errors import InvalidArgument
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
from cortex.ledger.tree import node_bytes

D = HashDomain("m", 16, Engine.SGLANG)
D2 = HashDomain("m", 16, Engine.VLLM)
S = Source("w", 0)
ROOT = D.root_key()


def upd(
    epoch: int, seq: int, op: object, domain: HashDomain = D, source: Source = S
) -> LedgerUpdate:
    return LedgerUpdate(source, domain, epoch, seq, op)  # type: ignore[arg-type]


def snap(keys: list[int], parent: int = ROOT) -> Snapshot:
    return Snapshot([parent, *keys[:-1]], keys)


# ---- ledger ---------------------------------------------------------------------------------


def test_ledger_verdicts() -> None:
    ledger = Ledger(resync_retry_s=10)
    store = StoreBlocks(ROOT, [1])
    first = ledger.admit(upd(1, 5, store), now_s=0)
    assert first.verdict is Verdict.RESYNC and first.request_resync  # unknown source
    again = ledger.admit(upd(1, 6, store), now_s=1)
    assert again.verdict is Verdict.RESYNC and not again.request_resync  # retry not due
    assert ledger.admit(upd(1, 7, store), now_s=11).request_resync  # due again
    assert ledger.admit(upd(1, 1, Snapshot([], [])), now_s=12).verdict is Verdict.APPLY
    ledger.snapshot_applied(S, D, LedgerState.READY, "", now_s=12)
    rec = ledger.get(S)
    assert rec is not None and rec.effective_state is LedgerState.READY
    assert ledger.admit(upd(1, 2, store), now_s=13).verdict is Verdict.APPLY
    assert ledger.admit(upd(1, 2, store), now_s=13).verdict is Verdict.DUPLICATE
    assert ledger.admit(upd(1, 1, Snapshot([], [])), now_s=13).verdict is Verdict.DUPLICATE
    assert ledger.admit(upd(0, 9, store), now_s=13).verdict is Verdict.STALE
    gap = ledger.admit(upd(1, 4, store), now_s=14)
    assert (gap.verdict, gap.left_ready, gap.request_resync) == (Verdict.RESYNC, True, True)
    assert rec.effective_state is LedgerState.SYNCING and rec.seq == 2
    assert ledger.admit(upd(1, 5, store), now_s=15).verdict is Verdict.RESYNC
    assert ledger.admit(upd(1, 6, Snapshot([], [])), now_s=16).verdict is Verdict.APPLY
    ledger.snapshot_applied(S, D, LedgerState.READY, "", now_s=16)
    newer = ledger.admit(upd(2, 1, store), now_s=17)
    assert newer.verdict is Verdict.RESYNC and newer.discard and newer.left_ready
    # removal applies even out of order; the tombstone keeps duplicates duplicates
    assert ledger.admit(upd(2, 9, RemoveSource()), now_s=18).verdict is Verdict.APPLY
    ledger.removed(S, "lease", now_s=18)
    assert rec.effective_state is LedgerState.REMOVED
    assert ledger.admit(upd(2, 9, RemoveSource()), now_s=19).verdict is Verdict.DUPLICATE
    assert ledger.admit(upd(2, 3, store), now_s=19).verdict is Verdict.DUPLICATE
    assert ledger.admit(upd(2, 10, store), now_s=19).verdict is Verdict.RESYNC
    assert rec.effective_state is LedgerState.SYNCING


def test_ledger_bounds_tombstones() -> None:
    ledger = Ledger(max_tombstones=2)
    for i in range(4):
        source = Source(f"w{i}")
        ledger.admit(upd(1, 1, RemoveSource(), source=source), now_s=0)
        ledger.removed(source, "", now_s=0)
    assert sorted(r.source.worker_id for r in ledger) == ["w2", "w3"]


# ---- change log -----------------------------------------------------------------------------


def test_change_log_batches_chain_split_and_reset() -> None:
    log = ChangeLog(100, max_keys=10, max_records=100)
    a, b = Source("a"), Source("b")
    log.append(Change(101, D, a, np.arange(3, dtype=np.uint64)))
    log.append(Change(102, D, b))
    log.append(Change(103, D, a, np.arange(3, 6, dtype=np.uint64)))
    log.append(Change(104, D2, b, np.arange(6, 9, dtype=np.uint64)))
    sets = log.since(100, 110, max_batch_keys=4)
    assert [(c.from_version, c.to_version) for c in sets] == [(100, 102), (102, 103), (103, 110)]
    assert sets[0].keys().tolist() == [0, 1, 2] and sets[0].cleared == [b]
    assert sets[1].removed_source == a and sets[1].keys().tolist() == [3, 4, 5]
    assert sets[2].domain == D2
    assert log.since(104, 110) == []
    assert [c.to_version for c in log.since(101, 110, model="m")][-1] == 110
    assert log.since(100, 110, model="other") == []
    assert log.since(99, 110)[0].reset  # before the start
    assert log.since(111, 110)[0].reset  # from another process
    log.append(Change(105, D, a, np.arange(9, 15, dtype=np.uint64)))  # weight 16 > 10
    assert log.floor >= 101 and log.since(100, 110)[0].reset
    split = ChangeLog(0)
    split.append(Change(1, D, a, np.arange(10, dtype=np.uint64)))
    pieces = split.since(0, 1, max_batch_keys=4)
    assert [len(p.keys()) for p in pieces] == [4, 4, 2]


# ---- PrefixIndex ----------------------------------------------------------------------------


def test_prefix_index_match_and_domains() -> None:
    index = PrefixIndex(start_version=1)
    tokens = list(range(64))
    keys = D.keys(tokens)
    assert index.apply(upd(1, 1, snap(keys))).verdict is Verdict.APPLY
    result = index.match("m", token_ids=tokens)
    assert result.sources == ((S, 4, LedgerState.READY),) and result.query_blocks == 4
    assert index.match("m", block_keys=keys, max_blocks=2).blocks_of("w") == 2
    assert index.match("m", block_keys=keys, candidate_workers=["x"]).sources == ()
    # a second engine for the model makes the model ambiguous
    index.apply(upd(1, 1, Snapshot([], []), domain=D2, source=Source("v")))
    with pytest.raises(InvalidArgument, match="2 hash domains"):
        index.match("m", block_keys=keys)
    assert index.match("m", block_keys=keys, engine=Engine.SGLANG).blocks_of("w") == 4
    with pytest.raises(InvalidArgument, match="model is required"):
        index.match("", block_keys=keys)
    # a source moving to another domain leaves the old tree
    index.apply(upd(2, 1, snap(D2.keys(tokens)), domain=D2))
    assert index.match("m", block_keys=keys, engine=Engine.SGLANG).sources == ()
    assert D not in index.trees
    assert index.match("m", token_ids=tokens, engine=Engine.VLLM).blocks_of("w") == 4
    assert "PrefixIndex(version=" in repr(index)


def test_prefix_index_versions_and_change_records() -> None:
    index = PrefixIndex(start_version=10)
    keys = D.keys(list(range(64)))
    index.apply(upd(1, 1, snap(keys)))
    assert index.version == 11 and len(index.changes) == 0  # nothing held before
    index.apply(upd(1, 2, StoreBlocks(keys[-1], [5, 6])))
    assert index.version == 12 and len(index.changes) == 0
    index.apply(upd(1, 3, RemoveBlocks([keys[1], 12345])))
    [change] = index.changes.since(12, index.version)
    assert change.keys().tolist() == [keys[1]]
    index.apply(upd(1, 4, SetState(LedgerState.STALE)))
    index.apply(upd(1, 5, ClearBlocks()))
    cleared = index.changes.since(13, index.version)
    assert [c.cleared for c in cleared] == [[S]]
    assert index.workers()[0].state is LedgerState.STALE
    index.apply(upd(1, 6, RemoveSource()))
    assert index.workers()[0].state is LedgerState.REMOVED and not index.trees


def test_budget_eviction_never_over_reports() -> None:
    budget = 300 * node_bytes(1)
    index = PrefixIndex(memory_budget_bytes=budget, low_watermark=0.8, start_version=1)
    sources = [Source(f"w{i}") for i in range(4)]
    held: dict[Source, set[int]] = {s: set() for s in sources}
    for s in sources:
        index.apply(upd(1, 1, Snapshot([], []), source=s))
    rng = np.random.default_rng(3)
    prompts = [D.keys(rng.integers(0, 1000, 16 * 40).tolist()) for _ in range(12)]
    cursor = index.version
    for step in range(40):
        s = sources[step % 4]
        keys = prompts[step % 12]
        index.apply(upd(1, 2 + step // 4, StoreBlocks(ROOT, keys), source=s))
        held[s].update(keys)
        for change in index.changes.since(cursor, index.version):
            if change.removed_source is not None:
                held[change.removed_source].difference_update(change.keys().tolist())
        cursor = index.version
        assert index.bytes_estimate <= budget
    assert index.evictions > 0
    for keys in prompts:
        result = index.match("m", block_keys=keys)
        for source, blocks, _ in result.sources:
            expect = next((i for i, k in enumerate(keys) if k not in held[source]), len(keys))
            assert blocks == expect
    index.stats()
    for tree in index.trees.values():
        tree.check_invariants()
