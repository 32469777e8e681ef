"""Ledger: copy counting and parents-first snapshots."""

from __future__ import annotations

from cortex.ingest.ledger import Ledger


def test_store_remove_and_copies() -> None:
    ledger = Ledger()
    ledger.store([101, 102], [1, 2], parent_key=0)
    ledger.store([101], [1], parent_key=0)  # a second physical copy of hash 101
    assert len(ledger) == 2
    assert ledger.remove([101]) == ([], 0)  # one copy left
    assert ledger.remove([101, 999]) == ([1], 1)
    assert ledger.key_of(102) == 2
    assert 1 not in ledger and 2 in ledger


def test_two_hashes_one_key_leave_together() -> None:
    ledger = Ledger()
    ledger.store([b"a" * 32], [7], parent_key=0)
    ledger.store([b"b" * 32], [7], parent_key=0)
    assert ledger.remove([b"a" * 32]) == ([], 0)
    assert ledger.remove([b"b" * 32]) == ([7], 0)
    assert len(ledger) == 0


def test_reused_hash_for_other_tokens_moves() -> None:
    ledger = Ledger()
    ledger.store([5], [50], parent_key=0)
    ledger.store([5], [51], parent_key=0)
    assert ledger.key_of(5) == 51 and 50 not in ledger and 51 in ledger


def test_pairs_are_parents_first_after_a_parent_is_restored() -> None:
    ledger = Ledger()
    ledger.store([1, 2, 3], [10, 20, 30], parent_key=0)
    assert ledger.remove([1]) == ([10], 0)  # the parent goes, its children stay
    ledger.store([1], [10], parent_key=0)  # and comes back: now inserted after them
    parents, keys = ledger.pairs()
    assert keys == [10, 20, 30]
    assert parents == [0, 10, 20]
    ledger.clear()
    assert ledger.pairs() == ([], [])
