"""The compiled tree core agrees with its pure-Python specification.

Differential test: random operation streams (chain and pair stores — some malformed —,
removals, clears, source removals past 64 sources, matches, touches, evictions by age and by
key, copies through columns into the other core) drive a :class:`PythonTree` and a
:class:`NativeTree` side by side. After every step each observable — the operation's result,
sizes, per-source holdings, match counts, holders, parents, recency — must be equal (key
results as sets: their order is unspecified), and both trees' invariants must hold.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cortex.ledger import cores
from cortex.ledger.errors import InvalidArgument
from cortex.ledger.model import LedgerState, Source
from cortex.ledger.native import NativeTree
from cortex.ledger.pytree import PythonTree
from cortex.ledger.tree import Eviction, RadixHashTree

ROOT = 0xFFFF_0000_0000_0001
NODES = 48

OPS = ["store", "store", "store", "pairs", "remove", "clear", "drop", "touch", "evict",
       "evict_keys", "copy"]
script = st.lists(
    st.tuples(st.sampled_from(OPS), st.integers(0, 79), st.integers(0, 10**6),
              st.integers(1, 14)),
    min_size=1, max_size=50,
)


def eviction_view(eviction: Eviction) -> tuple[set[int], dict[Source, set[int]]]:
    return (set(eviction.keys.tolist()),
            {source: set(keys.tolist()) for source, keys in eviction.dropped})


def arguments(op: str, key: list[int], parent: list[int], keys: list[int], parent_key: int,
              pick: int, length: int, step: int) -> tuple[Any, ...]:
    """The arguments of one operation (the same for both trees)."""
    if op == "store":
        # now and then a bogus chain (its parent among its keys)
        return (keys[-1] if length == 14 and keys else parent_key, keys, step)
    if op == "pairs":
        picked = sorted(random.Random(pick).sample(range(NODES), min(length, NODES)))
        parents = [ROOT if parent[n] < 0 else key[parent[n]] for n in picked]
        pairs: list[int] | npt.NDArray[np.uint64] = [key[n] for n in picked]
        if length == 14:
            parents, pairs = parents[::-1], pairs[::-1]  # maybe not parents-first
        if length % 2:
            pairs = np.array(pairs, np.uint64)
        return (parents, pairs, step)
    if op == "remove":
        return ([*keys, *keys[:1]],)
    if op == "touch":
        # a leaf alone, below old ancestors, or a segment and an unknown key
        return (keys[-1:] if length % 2 else [*keys, 1], step)
    if op == "evict":
        return (step - length,)
    return (keys,)


def apply(tree: RadixHashTree, op: str, source: Source, args: tuple[Any, ...]) -> object:
    if op == "store":
        return tree.store(source, *args)
    if op == "pairs":
        return tree.store_pairs(source, *args)
    if op == "remove":
        return tree.remove(source, *args)
    if op == "clear":
        return tree.clear(source)
    if op == "drop":
        return tree.remove_source(source)
    if op == "touch":
        return tree.touch(*args)
    if op == "evict":
        return tree.evict_older_than(*args)
    if op == "evict_keys":
        return tree.evict_keys(*args)
    raise AssertionError(op)


def outcome(op: Callable[..., object], *args: Any) -> object:
    """An operation's result in comparable form (an InvalidArgument is a result too)."""
    try:
        result = op(*args)
    except InvalidArgument:
        return "invalid"
    if isinstance(result, Eviction):
        return eviction_view(result)
    if isinstance(result, np.ndarray):
        return set(result.tolist())
    return result


def observe(tree: RadixHashTree, sources: list[Source], probe: list[int], now: int) -> object:
    counts = tree.match(probe, now)
    return (
        tree.nodes, tree.holdings, tree.words, tree.evicted, len(tree),
        tree.bytes_estimate // tree.node_bytes(tree.words),
        [(s, tree.has_source(s), tree.blocks_of(s)) for s in sources],
        {s: counts[b] for b, s in tree.bits()},
        sorted(tree.sources),
        [(k, k in tree, tree.parent_of(k), tree.recency_of(k)) for k in probe],
        sorted(tree.live_recency().tolist()),
        {s: tree.keys_of(s) for s in sources[:6]},
        tree.held_columns(probe, [b for b, _ in tree.bits()][:5]).tolist(),
        tree.match_roster(probe, now, [(b, s, LedgerState.READY) for b, s in tree.bits()]),
    )


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), steps=script)
def test_random_operation_streams_give_equal_results_in_both_cores(
    seed: int, steps: list[tuple[str, int, int, int]]
) -> None:
    rnd = random.Random(seed)
    parent = [-1] + [rnd.randrange(-1, i) for i in range(1, NODES)]
    key = [rnd.getrandbits(64) for _ in range(NODES)]
    sources = [Source(f"w{i % 40}", i // 40) for i in range(80)]  # past 64: wider bitsets

    def path(node: int) -> list[int]:
        out = []
        while node >= 0:
            out.append(node)
            node = parent[node]
        return out[::-1]

    spec: RadixHashTree = PythonTree(16)
    core: RadixHashTree = NativeTree(16)
    for step, (op, si, pick, length) in enumerate(steps):
        source = sources[si if rnd.random() < 0.3 else si % 6]
        full = path(pick % NODES)
        start = pick % len(full)
        nodes = full[start : start + length]
        keys = [key[n] for n in nodes]
        parent_key = ROOT if start == 0 else key[full[start - 1]]
        args = arguments(op, key, parent, keys, parent_key, pick, length, step)
        if op == "copy":  # each core loads the other's columns
            spec, core = (PythonTree.from_columns(core.columns()),
                          NativeTree.from_columns(spec.columns()))
        else:
            got = [outcome(apply, tree, op, source, args) for tree in (spec, core)]
            assert got[0] == got[1], (op, got)
        # a query from the root, or from mid-path (it refreshes no ancestors: eviction's case)
        probe = [key[n] for n in path(rnd.randrange(NODES))][rnd.choice([0, 0, 1, 2]):]
        assert observe(spec, sources, probe, step) == observe(core, sources, probe, step)
        spec.check_invariants()
        core.check_invariants()


def test_native_is_the_default_core_and_a_tree_of_each_reports_its_core() -> None:
    assert cores.Core.NATIVE in cores.available()
    for core in cores.Core:
        tree = cores.tree_type(core)()
        assert tree.core == core.value and f"core={core.value}" in repr(tree)


@pytest.mark.parametrize("keys", [[1, 2, -3], ["x"], np.array([1.0, 2.0])])
def test_native_core_refuses_keys_that_are_not_uint64_and_changes_nothing(keys: object) -> None:
    tree = NativeTree()
    with pytest.raises((InvalidArgument, TypeError)):
        tree.store_pairs(Source("a"), [ROOT, ROOT, ROOT][: len(keys)], keys, now=1)  # type: ignore[arg-type]
    assert tree.nodes == 0 and not tree.has_source(Source("a"))


def test_native_core_reads_strided_arrays_and_numpy_ints_like_lists() -> None:
    keys = np.arange(10, 50, dtype=np.uint64)[::2]  # not contiguous: read item by item
    by_list, by_array, by_scalars = NativeTree(), NativeTree(), NativeTree()
    by_list.store(Source("a"), ROOT, keys.tolist(), now=1)
    by_array.store(Source("a"), ROOT, keys, now=1)
    by_scalars.store(Source("a"), ROOT, list(keys), now=1)
    for tree in (by_array, by_scalars):
        assert tree.keys_of(Source("a")) == by_list.keys_of(Source("a"))
        assert tree.match(keys[::-1][::-1], now=2) == by_list.match(keys.tolist(), now=2)


def test_trees_past_the_huge_page_threshold_grow_shrink_and_widen_alike() -> None:
    """A tree whose columns pass 2 MiB lives in its own mappings (huge pages) in the
    compiled core: growing them (mremap), widening the holder bitsets past 64 sources and
    freeing them must keep every answer equal to the pure core's."""
    rng = np.random.default_rng(5)
    chains = rng.integers(1, 1 << 63, (2_000, 160), np.uint64)  # 320k keys: 2.5 MiB of keys
    sources = [Source(f"w{i}") for i in range(70)]  # a second holder word
    trees = [NativeTree(), PythonTree()]
    for tree in trees:
        for i, chain in enumerate(chains):
            tree.store(sources[i % 70], 7, chain, i)
        tree.remove(sources[0], chains[0][80:])
        assert tree.words == 2 and tree.nodes == 320_000 + 1 - 80  # + the parent, 7
    native, python = trees
    for chain in chains[:50]:
        assert native.match(chain, 9) == python.match(chain, 9)
    assert native.keys_of(sources[3]) == python.keys_of(sources[3])
    native.check_invariants()
    copy = cores.tree_type(cores.Core.NATIVE).from_columns(native.columns())
    assert copy.match(chains[1], 1) == python.match(chains[1], 1)
    del copy, native  # unmapped
