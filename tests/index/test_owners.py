"""Source ownership and ingest liveness: SourceOwners and PrefixIndex (pure, fake clocks)."""

from __future__ import annotations

import pytest

from cortex.hashing import Engine, HashDomain
from cortex.index.owners import SourceOwners
from cortex.index.prefix_index import PrefixIndex
from cortex.ledger.model import (
    INGEST_LOST,
    LedgerState,
    LedgerUpdate,
    RemoveSource,
    Snapshot,
    Source,
    StoreBlocks,
)

D = HashDomain("m", 4, Engine.VLLM)
ROOT = D.root_key()
A, B, C = Source("a"), Source("b"), Source("c", 1)


def test_owners_expire_once_per_loss_and_report_the_lost_sources_on_return() -> None:
    owners = SourceOwners(grace_s=5.0)
    owners.heard("ingest-1", 0.0)
    owners.claim(A, "ingest-1")
    owners.claim(C, "ingest-1")
    owners.heard("ingest-2", 0.0)
    owners.claim(B, "ingest-2")
    assert owners.next_deadline() == 5.0
    assert owners.expire(5.0) == []  # a deadline is crossed, not met
    owners.heard("ingest-2", 4.0)
    assert owners.expire(5.5) == [("ingest-1", [A, C])]
    assert owners.is_lost("ingest-1") and not owners.is_lost("ingest-2")
    assert owners.expire(6.0) == []  # reported once
    assert owners.next_deadline() == 9.0  # only live ingests have deadlines
    assert owners.heard("ingest-1", 7.0) == {A, C}
    assert owners.heard("ingest-1", 7.5) == set()
    assert (owners.lost_ingests, owners.lost_sources) == (1, 2)
    assert sorted(owners) == [("ingest-1", False, 2), ("ingest-2", False, 1)]


def test_owners_claims_move_and_removed_sources_are_released() -> None:
    owners = SourceOwners(grace_s=1.0)
    owners.heard("x", 0.0)
    owners.heard("y", 0.0)
    owners.claim(A, "x")
    owners.claim(A, "y")  # e.g. a re-sharded fleet: the last applier owns it
    assert owners.owner(A) == "y"
    owners.claim(B, "y")
    owners.release(B)
    assert owners.owner(B) is None
    # x owns nothing: silent, it is forgotten rather than lost
    assert owners.expire(2.0) == [("y", [A])]
    assert [i for i, _, _ in owners] == ["y"]
    owners.release(A)  # y's only source removed meanwhile: nothing left to give back
    assert owners.expire(3.0) == [] and list(owners) == []


def test_owners_grace_zero_never_expires() -> None:
    owners = SourceOwners(grace_s=0.0)
    owners.heard("x", 0.0)
    owners.claim(A, "x")
    assert owners.next_deadline() is None and owners.expire(1e9) == []
    with pytest.raises(ValueError):
        SourceOwners(grace_s=-1.0)


def update(source: Source, epoch: int, seq: int, op: object) -> LedgerUpdate:
    return LedgerUpdate(source, D, epoch, seq, op)  # type: ignore[arg-type]


def ready(index: PrefixIndex, source: Source, keys: list[int], ingest: str, epoch: int) -> None:
    snapshot = Snapshot([ROOT, *keys[:-1]], keys, LedgerState.READY, "in sync")
    assert index.apply(update(source, epoch, 0, snapshot), ingest).verdict.value == "apply"


def states(index: PrefixIndex) -> dict[Source, tuple[LedgerState, str, int]]:
    return {w.source: (w.state, w.reason, w.blocks) for w in index.workers()}


def test_a_lost_ingest_demotes_only_its_own_sources_and_announces_them() -> None:
    index = PrefixIndex(ingest_grace_s=2.0, start_version=100)
    index.ingest_heard("one", 0.0)
    index.ingest_heard("two", 0.0)
    ready(index, A, [1, 2, 3], "one", epoch=1)
    ready(index, B, [1, 2], "two", epoch=1)
    assert index.apply(update(A, 1, 1, StoreBlocks(3, [4])), "one").verdict.value == "apply"
    index.ingest_heard("two", 1.5)  # two keeps talking (heartbeats)
    version = index.version
    assert index.expire_ingests(2.5) == [("one", [A])]
    assert states(index) == {
        A: (LedgerState.SYNCING, INGEST_LOST, 0),  # no credit, no memory held
        B: (LedgerState.READY, "in sync", 2),
    }
    match = index.match("m", block_keys=[1, 2, 3])
    assert {(s, n, st) for s, n, st in match.sources} == {
        (A, 0, LedgerState.SYNCING), (B, 2, LedgerState.READY)}
    (change,) = index.changes.since(version, index.version)
    assert change.cleared == [A] and not change.reset
    # a live update of the old epoch cannot be applied now: it asks for a snapshot
    result = index.apply(update(A, 1, 2, StoreBlocks(4, [5])), "one")
    assert result.verdict.value == "resync" and result.request_resync


def test_a_lost_ingest_that_comes_back_is_asked_for_snapshots_and_turns_ready() -> None:
    index = PrefixIndex(ingest_grace_s=2.0)
    index.ingest_heard("one", 0.0)
    ready(index, A, [1, 2], "one", epoch=1)
    ready(index, C, [7], "one", epoch=1)
    assert index.expire_ingests(3.0) == [("one", [A, C])]
    back = index.ingest_heard("one", 4.0)  # e.g. its next batch, with a snapshot of A
    assert back == [A, C] and index.ingest_heard("one", 4.1) == []
    ready(index, A, [1, 2], "one", epoch=2)
    assert index.snapshots_owed(back) == [C]  # only what the batch did not bring
    assert states(index)[A] == (LedgerState.READY, "in sync", 2)
    assert states(index)[C][0] is LedgerState.SYNCING
    assert index.owners.owner(A) == "one" and not index.owners.is_lost("one")


def test_heard_within_the_grace_changes_nothing_and_removed_sources_are_not_revived() -> None:
    index = PrefixIndex(ingest_grace_s=2.0)
    index.ingest_heard("one", 0.0)
    ready(index, A, [1], "one", epoch=1)
    ready(index, B, [2], "one", epoch=1)
    for t in (1.5, 3.0, 4.5):  # a restart / reconnect inside the grace, then heartbeats
        index.ingest_heard("one", t)
        assert index.expire_ingests(t + 0.5) == []
    assert index.apply(update(B, 1, 1, RemoveSource("lease_lost")), "one").verdict.value == "apply"
    assert index.owners.owner(B) is None
    assert index.expire_ingests(7.0) == [("one", [A])]
    assert states(index)[B][0] is LedgerState.REMOVED
    assert index.owners.lost_sources == 1
