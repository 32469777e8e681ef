"""RadixHashTree: the pure tree, unit tests and a property test against a naive model."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cortex.ledger.cores import new_tree, node_bytes
from cortex.ledger.errors import InvalidArgument
from cortex.ledger.model import Source
from cortex.ledger.tree import RadixHashTree

A, B, C = Source("a"), Source("b"), Source("c", 1)
ROOT = 0xFFFF_0000_0000_0001


def chain(start: int, n: int) -> list[int]:
    return [start + i for i in range(n)]


def counts(tree: RadixHashTree, keys: list[int], now: int = 1) -> dict[Source, int]:
    got = tree.match(keys, now)
    return {source: got[bit] for bit, source in tree.bits()}


def test_store_and_match_counts_consecutive_leading_blocks() -> None:
    tree = new_tree()
    tree.store(A, ROOT, chain(100, 5), now=1)
    tree.store(B, ROOT, chain(100, 3), now=1)
    assert counts(tree, chain(100, 5)) == {A: 5, B: 3}
    assert counts(tree, chain(100, 2)) == {A: 2, B: 2}
    assert counts(tree, [999, *chain(100, 5)]) == {A: 0, B: 0}
    assert counts(tree, []) == {A: 0, B: 0}
    assert tree.nodes == 6  # five blocks and the root placeholder
    assert tree.holdings == 8
    assert tree.parent_of(100) == ROOT and tree.parent_of(ROOT) is None
    assert tree.parent_of(101) == 100
    tree.check_invariants()


def test_removing_an_inner_block_drops_only_that_holding() -> None:
    tree = new_tree()
    tree.store(A, ROOT, chain(100, 4), now=1)
    dropped = tree.remove(A, [101])
    assert dropped.tolist() == [101]
    assert counts(tree, chain(100, 4)) == {A: 1}
    # the holderless inner node stays while it has children: links stay exact
    assert 101 in tree and tree.nodes == 5
    assert tree.remove(A, [101]).size == 0  # not held any more
    tree.remove(A, [102, 103])
    assert 101 not in tree and 102 not in tree and tree.nodes == 2
    tree.check_invariants()


def test_clear_and_remove_source_reclaim_every_node() -> None:
    tree = new_tree()
    tree.store(A, ROOT, chain(100, 50), now=1)
    tree.store(B, 120, chain(200, 10), now=2)  # branches off block 120
    assert tree.clear(A) == 50
    assert tree.has_source(A) and tree.blocks_of(A) == 0
    assert counts(tree, chain(100, 21) + chain(200, 10)) == {A: 0, B: 0}
    assert tree.keys_of(B) == set(chain(200, 10))
    tree.check_invariants()
    assert tree.remove_source(B) == 10
    assert tree.nodes == 0 and tree.sources == [A]
    tree.check_invariants()


def test_a_retired_ledger_stops_counting_at_once_and_drains_in_bounded_steps() -> None:
    tree = new_tree(16)
    tree.sync_clear_max = 10
    tree.store(A, ROOT, chain(100, 400), now=1)
    tree.store(B, ROOT, chain(100, 5), now=1)
    old_bit = tree.bit_of(A)
    assert tree.retire(A, rejoin=True) == 400  # a clear: A stays, under a fresh bit
    assert tree.bit_of(A) != old_bit and tree.retiring and tree.retired == 400
    assert counts(tree, chain(100, 400)) == {A: 0, B: 5}
    tree.store(A, ROOT, chain(100, 3), now=2)  # what A stores after its clear counts
    assert counts(tree, chain(100, 400)) == {A: 3, B: 5} and tree.blocks_of(A) == 3
    tree.evict_older_than(cutoff=0)  # nothing that old; the retired holdings stay
    steps = 0
    while tree.sweep(slots=64):
        steps += 1
        assert tree.retired < 400
        tree.check_invariants()
    assert steps >= 5 and tree.retired == 0 and not tree.retiring
    assert tree.nodes == 6 and tree.holdings == 8  # the root placeholder, B's five, A's three
    assert tree.retire(B) == 5 and not tree.retiring  # small: cleared at once
    assert tree.add_source(C) == old_bit  # the drained bit is reused
    tree.check_invariants()


def test_a_retired_ledger_can_be_evicted_before_it_is_drained() -> None:
    tree = new_tree(16)
    tree.sync_clear_max = 1
    tree.store(A, ROOT, chain(100, 50), now=1)
    tree.store(B, ROOT, chain(500, 5), now=9)
    tree.remove_source(A)
    eviction = tree.evict_older_than(cutoff=1)
    assert eviction.nodes == 50 and eviction.dropped == ()  # the loss concerns nobody
    assert tree.retired == 0
    assert not tree.sweep() and tree.nodes == 6
    tree.check_invariants()


def test_recycled_slots_never_inherit_holders() -> None:
    tree = new_tree(16)
    tree.store(A, ROOT, chain(100, 10), now=1)
    tree.clear(A)
    tree.store(B, ROOT, chain(500, 10), now=2)
    assert counts(tree, chain(500, 10)) == {A: 0, B: 10}
    assert not tree.holds(A, 500)
    tree.check_invariants()


def test_unknown_parent_becomes_a_placeholder_that_is_linked_later() -> None:
    tree = new_tree()
    tree.store(A, 103, chain(104, 2), now=1)  # parent 103 not known yet
    assert 103 in tree and tree.parent_of(103) is None
    tree.store(B, ROOT, chain(100, 4), now=2)  # now 103 is stored under 102
    assert tree.parent_of(103) == 102
    assert counts(tree, chain(100, 6)) == {A: 0, B: 4}
    tree.check_invariants()
    tree.remove_source(B)
    tree.check_invariants()  # 100..103 stay as holderless path to A's blocks
    tree.remove_source(A)
    assert tree.nodes == 0


def test_store_pairs_must_be_parents_first_and_change_nothing_otherwise() -> None:
    tree = new_tree()
    with pytest.raises(InvalidArgument, match="parents-first"):
        tree.store_pairs(A, [101, ROOT], [102, 101], now=1)
    with pytest.raises(InvalidArgument, match="parents-first"):
        tree.store(A, 100, [100], now=1)
    with pytest.raises(InvalidArgument, match="parent keys"):
        tree.store_pairs(A, [ROOT], [1, 2], now=1)
    assert tree.nodes == 0
    assert tree.store_pairs(A, [ROOT, 101, 101], [101, 102, 103], now=1) == 3
    assert counts(tree, [101, 102]) == {A: 2}
    assert counts(tree, [101, 103]) == {A: 2}
    tree.check_invariants()


def test_more_than_64_sources_widen_the_bitsets() -> None:
    tree = new_tree()
    sources = [Source(f"w{i}", i % 4) for i in range(150)]
    for i, source in enumerate(sources):
        tree.store(source, ROOT, chain(1000, 1 + i % 7), now=i)
    assert tree.words == 3
    got = counts(tree, chain(1000, 7))
    assert all(got[s] == 1 + i % 7 for i, s in enumerate(sources))
    tree.remove_source(sources[70])
    tree.store(Source("late"), ROOT, chain(1000, 2), now=999)
    assert counts(tree, chain(1000, 2))[Source("late")] == 2
    tree.check_invariants()


def test_eviction_takes_least_recently_matched_subtrees_only() -> None:
    tree = new_tree()
    tree.store(A, ROOT, chain(100, 3), now=1)
    tree.store(A, ROOT, chain(200, 3), now=2)
    tree.store(B, 101, [150], now=6)
    tree.match(chain(100, 3), now=10)  # the 100-chain is now the most recent
    tree.store(A, 202, [203], now=7)  # a young leaf protects the old 200-chain
    assert tree.evict_older_than(cutoff=5).nodes == 0
    eviction = tree.evict_older_than(cutoff=7)
    # 200..203 go (their subtree is old); 100..102 are newer, 150 (6) hangs below 101
    assert sorted(eviction.keys.tolist()) == [150, 200, 201, 202, 203]
    assert {s: sorted(k.tolist()) for s, k in eviction.dropped} == {
        A: [200, 201, 202, 203], B: [150]}
    assert counts(tree, chain(100, 3)) == {A: 3, B: 0}
    assert tree.evicted == 5
    tree.check_invariants()


def test_bytes_estimate_follows_nodes() -> None:
    tree = new_tree()
    tree.store(A, ROOT, chain(100, 10), now=1)
    assert tree.bytes_estimate == 11 * node_bytes(1)
    assert "nodes=11," in repr(tree) and f"core={tree.core}" in repr(tree)


def test_a_young_leaf_protects_every_old_ancestor_from_eviction() -> None:
    tree = new_tree()
    tree.store(A, ROOT, chain(100, 4), now=1)
    tree.store(B, 100, chain(200, 2), now=1)
    tree.touch([103], now=5)  # the leaf only: its ancestors stay old
    eviction = tree.evict_older_than(3)
    assert set(eviction.keys.tolist()) == {200, 201}
    assert counts(tree, chain(100, 4)) == {A: 4, B: 0}
    tree.check_invariants()


# ---- property test against a naive model --------------------------------------------------


class NaiveModel:
    """Source -> set of held keys; match counts leading held keys."""

    def __init__(self) -> None:
        self.held: dict[Source, set[int]] = {}

    def store(self, source: Source, keys: list[int]) -> None:
        self.held.setdefault(source, set()).update(keys)

    def remove(self, source: Source, keys: list[int]) -> None:
        self.held.get(source, set()).difference_update(keys)

    def clear(self, source: Source) -> None:
        if source in self.held:
            self.held[source] = set()

    def remove_source(self, source: Source) -> None:
        self.held.pop(source, None)

    def match(self, keys: list[int]) -> dict[Source, int]:
        out = {}
        for source, held in self.held.items():
            n = 0
            for key in keys:
                if key not in held:
                    break
                n += 1
            out[source] = n
        return out


SOURCES = [Source("w0"), Source("w1"), Source("w1", 1), Source("w2")]
ops = st.lists(
    st.tuples(
        st.sampled_from(["store", "store", "store", "remove", "clear", "drop", "match", "evict",
                         "retire", "leave", "drain"]),
        st.integers(0, len(SOURCES) - 1),
        st.integers(0, 10**6),
        st.integers(1, 12),
    ),
    min_size=1,
    max_size=60,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), script=ops)
def test_random_operations_agree_with_the_naive_model(
    seed: int, script: list[tuple[str, int, int, int]]
) -> None:
    rnd = random.Random(seed)
    # a random forest of 40 blocks: block i's parent is an earlier block or the root
    parent = [-1] + [rnd.randrange(-1, i) for i in range(1, 40)]
    key = [rnd.getrandbits(64) for _ in range(40)]

    def path(node: int) -> list[int]:
        out = []
        while node >= 0:
            out.append(node)
            node = parent[node]
        return out[::-1]

    tree, model = new_tree(16), NaiveModel()
    tree.sync_clear_max = 2  # bigger ledgers are retired and drained in steps
    for step, (op, si, pick, length) in enumerate(script):
        source = SOURCES[si]
        full = path(pick % 40)
        start = pick % len(full)
        nodes = full[start : start + length]
        keys = [key[n] for n in nodes]
        parent_key = ROOT if start == 0 else key[full[start - 1]]
        if op == "store":
            tree.store(source, parent_key, keys, now=step)
            model.store(source, keys)
        elif op == "remove":
            dropped = set(tree.remove(source, keys).tolist())
            assert dropped == set(keys) & model.held.get(source, set())
            model.remove(source, keys)
        elif op == "clear":
            tree.clear(source)
            model.clear(source)
        elif op == "drop":
            tree.remove_source(source)
            model.remove_source(source)
        elif op == "retire":
            tree.retire(source, rejoin=True)
            model.clear(source)
        elif op == "leave":
            tree.retire(source)
            model.remove_source(source)
        elif op == "drain":
            tree.sweep(slots=length)
        elif op == "evict":
            for s, k in tree.evict_older_than(cutoff=step - length).dropped:
                model.remove(s, k.tolist())
        query = [key[n] for n in full]
        expected = model.match(query)
        got = counts(tree, query, now=step)
        assert {s: n for s, n in got.items() if s in expected} == expected
        assert all(n == 0 for s, n in got.items() if s not in expected)
        tree.check_invariants()
    for source in SOURCES:
        assert tree.keys_of(source) == model.held.get(source, set())
        tree.remove_source(source)
    tree.settle()
    assert tree.nodes == 0 and tree.holdings == 0 and not tree.retiring


def test_match_of_a_large_tree_is_consistent_with_numpy_reference() -> None:
    rng = np.random.default_rng(7)
    tree = new_tree()
    keys = rng.integers(1, 2**63, size=2000, dtype=np.uint64).tolist()
    for i in range(8):
        tree.store(Source(f"w{i}"), ROOT, keys[: 250 * (i + 1)], now=i)
    got = counts(tree, keys)
    assert got == {Source(f"w{i}"): 250 * (i + 1) for i in range(8)}
