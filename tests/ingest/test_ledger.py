"""Ledger: copy counting and parents-first snapshots, in the compiled table and in the dicts
(every test runs with both cores; a differential test drives both with random op streams of
each engine's hash format -- removals, clears, copies, lookups of unknown hashes, inputs the
table cannot hold -- and compares every answer and map, insertion order included)."""

from __future__ import annotations

import random
from array import array
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cortex.ingest.ledger import Ledger
from cortex.ledger import cores


@pytest.fixture(autouse=True, params=list(cores.Core), ids=lambda core: f"core={core}")
def tree_core(request: pytest.FixtureRequest) -> Iterator[cores.Core]:
    before = cores.active()
    cores.use(request.param)
    yield request.param
    cores.use(before)


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


# ---- the compiled table against the dicts (the specification) --------------------------

VLLM = [0, 1, 2, 3, 2**63 - 1, 2**63, 2**63 + 5, 2**64 - 1]  # uint64
SGLANG = [0, 1, 2, 3, -1, -2, -(2**63), 2**63 - 1]  # int64
FOREIGN = [b"x" * 32, 2**64, -(2**63) - 1, True, "s"]  # bytes, out of range, bool, other
KEYS = st.sampled_from([0, 7, 100, 101, 102, 103, 2**63, 2**64 - 1])


def steps(pool: list[int]) -> st.SearchStrategy[list[tuple[Any, ...]]]:
    """Random ops over one engine's hash format; ``foreign`` ones (rare) cannot stay in the
    table: the ledger must move its state into the dicts without a difference."""
    hashes = st.sampled_from(pool)
    chain = st.lists(st.tuples(hashes, KEYS), max_size=5)
    return st.lists(st.one_of(
        st.tuples(st.just("store"), chain, KEYS, st.booleans()),
        st.tuples(st.just("remove"), st.lists(st.one_of(hashes, st.sampled_from(
            [2**64 - 2, -3, 12345])), max_size=5), st.booleans()),
        st.tuples(st.just("place"), st.lists(hashes, max_size=4), st.sampled_from([1, 2, 61]),
                  KEYS, st.integers(0, 2**32)),
        st.tuples(st.just("lookup"), st.one_of(hashes, st.sampled_from(
            [2**64 - 2, -3, 2**63 + 1, b"y" * 32])), KEYS),
        st.tuples(st.just("ragged"), st.lists(hashes, min_size=1, max_size=3)),
        st.tuples(st.just("clear")),
        st.tuples(st.just("copy")),
        st.tuples(st.just("foreign"), st.sampled_from(FOREIGN), KEYS),
    ), max_size=40)


def packed(values: list[int], signed: bool) -> array[int] | list[int]:
    """The decoder's array of a list of hashes (its reading), else the list."""
    try:
        return array("q" if signed or any(v < 0 for v in values) else "Q", values)
    except OverflowError:
        return values


def run(ledger: Ledger, ops: list[tuple[Any, ...]], signed: bool) -> list[object]:
    """Apply ``ops``; every answer (and error type), in order."""
    seen: list[object] = []
    for op in ops:
        try:
            if op[0] == "store":
                hashes = [h for h, _ in op[1]]
                ledger.store(packed(hashes, signed) if op[3] else hashes, [k for _, k in op[1]],
                             op[2])
            elif op[0] == "remove":
                seen.append(ledger.remove(packed(op[1], signed) if op[2] else op[1]))
            elif op[0] == "place":
                rng = random.Random(op[4])
                tokens = array("I", [rng.randrange(2**32) for _ in range(len(op[1]) * op[2])])
                seen.append(ledger.place(packed(op[1], signed), tokens.tobytes(), op[2], op[3]))
            elif op[0] == "lookup":
                key = ledger.key_of(op[1])
                seen.append((key, ledger.parent_of(op[2]), op[2] in ledger,
                             None if key is None else ledger.parent_of(key)))
            elif op[0] == "ragged":  # one key fewer than hashes
                ledger.store(op[1], list(range(200, 200 + len(op[1]) - 1)), 0)
            elif op[0] == "clear":
                ledger.clear()
            elif op[0] == "copy":
                ledger = ledger.copy()
            else:
                ledger.store([1, op[1], 3], [101, op[2], 103], 0)
        except (ValueError, TypeError) as exc:
            seen.append(type(exc))
        seen.append(state(ledger))
    return seen


def state(ledger: Ledger) -> tuple[object, ...]:
    key_of, parent_of, dup_hash, dup_key = ledger.maps()
    return (list(key_of.items()), list(parent_of.items()), dup_hash, dup_key, len(ledger),
            ledger.hashes(), list(ledger.keys()), ledger.pairs())


@pytest.mark.parametrize("pool", [VLLM, SGLANG], ids=["vllm", "sglang"])
@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(data=st.data())
def test_the_compiled_table_answers_as_the_dicts_do(pool: list[int],
                                                    data: st.DataObject) -> None:
    ops = data.draw(steps(pool))
    signed = pool is SGLANG
    spec, table = Ledger(compiled=False), Ledger(compiled=True)
    assert table.compiled
    assert run(table, ops, signed) == run(spec, ops, signed)


@pytest.mark.parametrize("pool", [VLLM, SGLANG], ids=["vllm", "sglang"])
def test_one_engines_hashes_stay_in_the_table(pool: list[int], tree_core: cores.Core) -> None:
    rng = random.Random(5)
    ledger = Ledger(compiled=True)
    for _ in range(2000):
        hashes = [rng.choice(pool) for _ in range(rng.randrange(1, 4))]
        if rng.random() < 0.5:
            ledger.store(packed(hashes, pool is SGLANG),
                         [rng.choice([5, 6, 2**64 - 1]) for _ in hashes], rng.randrange(9))
        else:
            ledger.remove(hashes)
        ledger.key_of(rng.choice([*pool, b"z" * 32, 2**70]))  # type: ignore[arg-type]
    assert ledger.compiled
    ledger.store([b"b" * 32], [1], 0)  # a bytes hash: into the dicts, for good
    assert not ledger.compiled and ledger.key_of(b"b" * 32) == 1
    ledger.clear()
    assert ledger.compiled is (tree_core is cores.Core.NATIVE)  # empty: the active core's


def test_the_table_grows_compacts_and_keeps_order() -> None:
    spec, table = Ledger(compiled=False), Ledger(compiled=True)
    rng = random.Random(11)
    live: list[int] = []
    for step in range(60_000):
        if live and rng.random() < 0.45:
            gone = [live.pop(rng.randrange(len(live))) for _ in range(min(len(live), 3))]
            assert table.remove(array("Q", gone)) == spec.remove(gone)
        else:
            hashes = [rng.randrange(2**64) for _ in range(rng.randrange(1, 6))]
            keys = [rng.randrange(2**64) for _ in hashes]
            parent = rng.randrange(2**64)
            spec.store(hashes, keys, parent)
            table.store(array("Q", hashes), keys, parent)
            live.extend(hashes)
        if step % 10_000 == 0:
            assert state(table) == state(spec)
    assert state(table) == state(spec) and table.compiled


def test_a_table_made_without_init_is_whole() -> None:
    from cortex.ledger._core import KeyTable

    table = KeyTable.__new__(KeyTable)
    assert table.store([1], [2], 0) is None and table.key_of(1) == 2 and len(table) == 1
