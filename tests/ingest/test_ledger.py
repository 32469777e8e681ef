"""Ledger: copy counting and parents-first snapshots, with its per-block loops in the
compiled core and in Python (every test runs with both; a differential test drives both with
random streams, bad input included, and compares every map, insertion order included)."""

from __future__ import annotations

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


HASHES = st.one_of(st.integers(0, 12), st.sampled_from([b"x" * 32, b"y" * 32]))
STEPS = st.lists(st.one_of(
    st.tuples(st.just("store"), st.lists(st.tuples(HASHES, st.integers(100, 110)), max_size=5),
              st.integers(0, 3)),
    st.tuples(st.just("remove"), st.lists(HASHES, max_size=5)),
    st.tuples(st.just("ragged"), st.lists(HASHES, min_size=1, max_size=3)),
    st.tuples(st.just("unhashable"), st.integers(0, 2)),
), max_size=30)


def run(steps: list[tuple[Any, ...]]) -> tuple[list[object], Ledger]:
    ledger = Ledger()
    seen: list[object] = []
    for step in steps:
        try:
            if step[0] == "store":
                ledger.store([h for h, _ in step[1]], [k for _, k in step[1]], step[2])
                seen.append(None)
            elif step[0] == "remove":
                seen.append(ledger.remove(step[1]))
            elif step[0] == "ragged":  # one key fewer than hashes
                ledger.store(step[1], list(range(200, 200 + len(step[1]) - 1)), 0)
            else:
                ledger.store([1, [2], 3][: step[1] + 1], [101, 102, 103][: step[1] + 1], 0)
                seen.append(None)
        except (ValueError, TypeError) as exc:
            seen.append(type(exc))
    return seen, ledger


def maps(ledger: Ledger) -> list[list[tuple[object, int]]]:
    return [list(m.items()) for m in (ledger._key_of, ledger._parent_of, ledger._dup_hash,
                                      ledger._dup_key)]


@settings(max_examples=200, deadline=None)
@given(steps=STEPS)
def test_compiled_loops_leave_the_maps_as_python_does(steps: list[tuple[Any, ...]]) -> None:
    compiled, want = run(steps)
    cores.use(cores.Core.PYTHON)
    python, got = run(steps)
    assert compiled == python
    assert maps(want) == maps(got)
    assert want.pairs() == got.pairs()
