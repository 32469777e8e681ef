"""The column store under a radix hash tree: nodes as slots in parallel numpy columns.

A Python object per node costs ~300 B, so a node is a *slot* in parallel numpy columns and one
dict maps a block key to its slot:

===========  =================  =============================================================
column       dtype              meaning
===========  =================  =============================================================
_slot_of     dict[int, int]     block key -> slot (~114 B/node with the two int objects)
_key         uint64[cap]        slot -> block key (to unlink it, to report evicted keys)
_parent      int32[cap]         parent slot; ``NO_PARENT`` for a root, ``FREE`` for a free slot
_children    int32[cap]         live children (0 = leaf)
_recency     uint64[cap]        clock tick of the last store or match touching the node
_holders     uint64[cap, W]     holder bitset: bit ``b`` of word ``w`` = source bit ``64*w+b``
===========  =================  =============================================================

:class:`SlotColumns` owns the columns, their growth, the free stack, the source bits and the
whole-store copies (:class:`TreeColumns`, a replica's snapshot); what the nodes mean — stores,
matches, eviction — is :class:`~cortex.ledger.tree.RadixHashTree`'s. A reclaimed slot goes on
the free stack and is zeroed, so a recycled slot never inherits holders.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Self

import numpy as np
import numpy.typing as npt

from cortex.ledger.errors import InvalidArgument
from cortex.ledger.model import Source

__all__ = ["FREE", "NO_PARENT", "SlotColumns", "TreeColumns", "node_bytes"]

if sys.byteorder != "little":  # pragma: no cover - holder bit counting views uint64 as bytes
    raise ImportError("cortex.ledger.slots needs a little-endian machine")

NO_PARENT = -1
"""``_parent`` of a node whose parent block is not in the tree."""
FREE = -2
"""``_parent`` of a slot on the free stack."""

_U64 = np.uint64

# Per-node cost outside the numpy columns, measured on CPython 3.11 (x86-64): the dict's
# index + entry tables at their average fill (~42 B), the key int object (2**60..2**64 ->
# 36 B, 40 B from pymalloc) and the slot int object (28 B, 32 B from pymalloc).
_DICT_BYTES_PER_NODE = 42 + 40 + 32
# key 8 + parent 4 + children 4 + recency 8, plus 8 per holder word
_COLUMN_BYTES_PER_NODE = 24


@dataclass(frozen=True, slots=True)
class TreeColumns:
    """A whole tree as columns (see :meth:`RadixHashTree.columns`): per slot its key
    (``uint64``), parent slot (``int32``: ``NO_PARENT``, ``FREE``) and holder bitset
    (``uint64[slots, words]``); ``sources[bit]`` is the source of each holder bit."""

    keys: npt.NDArray[np.uint64]
    parents: npt.NDArray[np.int32]
    holders: npt.NDArray[np.uint64]
    sources: list[Source | None]


def node_bytes(words: int) -> int:
    """Estimated bytes one node costs in a tree whose holder bitsets are ``words`` wide."""
    return _DICT_BYTES_PER_NODE + _COLUMN_BYTES_PER_NODE + 8 * words


class SlotColumns:
    """Slots of one tree's nodes in parallel columns, the free stack and the source bits.

    A base of :class:`~cortex.ledger.tree.RadixHashTree`; single-threaded, no I/O.
    """

    def __init__(self, initial_capacity: int = 1024) -> None:
        cap = max(16, initial_capacity)
        self._slot_of: dict[int, int] = {}
        self._key: npt.NDArray[np.uint64] = np.zeros(cap, _U64)
        self._parent: npt.NDArray[np.int32] = np.zeros(cap, np.int32)
        self._children: npt.NDArray[np.int32] = np.zeros(cap, np.int32)
        self._recency: npt.NDArray[np.uint64] = np.zeros(cap, _U64)
        self._holders: npt.NDArray[np.uint64] = np.zeros((cap, 1), _U64)
        self._free: npt.NDArray[np.int64] = np.zeros(64, np.int64)
        self._nfree = 0
        self._high = 0  # slots below this were handed out at least once
        self._bit_of: dict[Source, int] = {}
        self._source_at: list[Source | None] = [None] * 64
        self._free_bits: list[int] = list(range(63, -1, -1))  # pop() yields the lowest
        self._held: npt.NDArray[np.int64] = np.zeros(64, np.int64)  # holdings per source bit

    # ---- sizes ---------------------------------------------------------------------------

    @property
    def nodes(self) -> int:
        """Live nodes (blocks, placeholders included)."""
        return len(self._slot_of)

    @property
    def holdings(self) -> int:
        """(node, source) pairs."""
        return int(self._held.sum())

    @property
    def words(self) -> int:
        """Width of the holder bitsets in 64-bit words."""
        return int(self._holders.shape[1])

    @property
    def capacity(self) -> int:
        """Slots the columns have room for."""
        return len(self._key)

    @property
    def bytes_estimate(self) -> int:
        """Estimated bytes held by live nodes (see :func:`node_bytes`)."""
        return self.nodes * node_bytes(self.words)

    @property
    def sources(self) -> list[Source]:
        """Registered sources, in bit order."""
        return [s for s in self._source_at if s is not None]

    def blocks_of(self, source: Source) -> int:
        """Blocks ``source`` holds (0 for an unknown source)."""
        bit = self._bit_of.get(source)
        return 0 if bit is None else int(self._held[bit])

    def __contains__(self, key: object) -> bool:
        return key in self._slot_of

    def __len__(self) -> int:
        return len(self._slot_of)

    # ---- sources -------------------------------------------------------------------------

    def add_source(self, source: Source) -> int:
        """Register ``source`` (idempotent); returns its bit. Widens bitsets when full."""
        bit = self._bit_of.get(source)
        if bit is not None:
            return bit
        if not self._free_bits:
            self._widen()
        bit = self._free_bits.pop()
        self._bit_of[source] = bit
        self._source_at[bit] = source
        return bit

    def _widen(self) -> None:
        words = self.words
        extra = np.zeros((len(self._holders), 1), _U64)
        self._holders = np.ascontiguousarray(np.hstack([self._holders, extra]))
        self._source_at.extend([None] * 64)
        self._held = np.concatenate([self._held, np.zeros(64, np.int64)])
        base = 64 * words
        self._free_bits.extend(range(base + 63, base - 1, -1))
        self._free_bits.sort(reverse=True)

    def has_source(self, source: Source) -> bool:
        return source in self._bit_of

    def bit_of(self, source: Source) -> int:
        """The holder bit of a registered source (``KeyError`` otherwise)."""
        return self._bit_of[source]

    # ---- slots ---------------------------------------------------------------------------

    def _grow(self, need: int) -> None:
        cap = len(self._key)
        if need <= cap:
            return
        new_cap = max(need, cap * 2)

        def grown(col: npt.NDArray[np.generic]) -> npt.NDArray[np.generic]:
            # np.zeros is calloc: the untouched tail costs no resident memory
            out = np.zeros((new_cap, *col.shape[1:]), col.dtype)
            out[:cap] = col
            return out

        self._key = grown(self._key)  # type: ignore[assignment]
        self._parent = grown(self._parent)  # type: ignore[assignment]
        self._children = grown(self._children)  # type: ignore[assignment]
        self._recency = grown(self._recency)  # type: ignore[assignment]
        self._holders = grown(self._holders)  # type: ignore[assignment]

    def _alloc(self, n: int) -> npt.NDArray[np.int64]:
        out = np.empty(n, np.int64)
        take = min(n, self._nfree)
        if take:
            out[:take] = self._free[self._nfree - take : self._nfree]
            self._nfree -= take
        rest = n - take
        if rest:
            self._grow(self._high + rest)
            out[take:] = np.arange(self._high, self._high + rest)
            self._high += rest
        return out

    def _push_free(self, slots: npt.NDArray[np.int64]) -> None:
        need = self._nfree + len(slots)
        if need > len(self._free):
            grown = np.zeros(max(need, 2 * len(self._free)), np.int64)
            grown[: self._nfree] = self._free[: self._nfree]
            self._free = grown
        self._free[self._nfree : need] = slots
        self._nfree = need

    def _new_nodes(
        self, keys: list[int], parents: npt.NDArray[np.int64], now: int
    ) -> npt.NDArray[np.int64]:
        """Create nodes for ``keys`` (distinct, absent) under ``parents`` slots."""
        slots = self._alloc(len(keys))
        self._slot_of.update(zip(keys, slots.tolist(), strict=True))
        self._key[slots] = np.array(keys, _U64)
        self._parent[slots] = parents
        self._recency[slots] = now
        linked = parents[parents >= 0]
        if linked.size:
            np.add.at(self._children, linked, 1)
        return slots

    def _reclaim(self, rows: npt.NDArray[np.int64]) -> int:
        """Free holderless, childless ``rows`` and then every ancestor that becomes so."""
        freed = 0
        while rows.size:
            rows = np.unique(rows)
            slot_of = self._slot_of
            for key in self._key[rows].tolist():
                del slot_of[key]
            parents = self._parent[rows].astype(np.int64)
            self._parent[rows] = FREE
            self._key[rows] = 0
            self._recency[rows] = 0
            self._children[rows] = 0
            self._holders[rows] = 0
            self._push_free(rows)
            freed += len(rows)
            parents = parents[parents >= 0]
            if not parents.size:
                break
            np.subtract.at(self._children, parents, 1)
            up = np.unique(parents)
            rows = up[(self._children[up] == 0) & ~self._holders[up].any(axis=1)]
        return freed

    def _dead(self, rows: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """The subset of ``rows`` that has neither holders nor children."""
        dead: npt.NDArray[np.int64] = rows[
            (self._children[rows] == 0) & ~self._holders[rows].any(axis=1)
        ]
        return dead

    def bits(self) -> Iterator[tuple[int, Source]]:
        """``(bit, source)`` of every registered source."""
        for bit, source in enumerate(self._source_at):
            if source is not None:
                yield bit, source

    # ---- copies --------------------------------------------------------------------------

    def columns(self) -> TreeColumns:
        """A copy of every slot handed out so far (free ones included), and the source of
        each holder bit: what :meth:`from_columns` rebuilds the same tree from."""
        hi = self._high
        return TreeColumns(
            keys=self._key[:hi].copy(),
            parents=self._parent[:hi].copy(),
            holders=self._holders[:hi].copy(),
            sources=list(self._source_at),
        )

    @classmethod
    def from_columns(cls, columns: TreeColumns) -> Self:
        """The tree :meth:`columns` copied (recency starts at 0 everywhere).

        Raises :class:`InvalidArgument` when the columns are inconsistent (lengths, parents
        outside the slots, a key twice, holder bits without a source); nothing is kept then.
        """
        keys, parents, holders = columns.keys, columns.parents, columns.holders
        n = len(keys)
        if len(parents) != n or holders.ndim != 2 or holders.shape[0] != n:
            raise InvalidArgument("tree columns differ in length")
        words = holders.shape[1]
        if words < 1 or len(columns.sources) != 64 * words:
            raise InvalidArgument("tree columns: holder width and sources disagree")
        if n and (parents.min() < FREE or parents.max() >= n):
            raise InvalidArgument("tree columns: a parent slot is out of range")
        live = parents != FREE
        linked = parents[live]
        linked = linked[linked >= 0]
        if linked.size and np.any(parents[linked] == FREE):
            raise InvalidArgument("tree columns: a node's parent is a free slot")
        live_keys = keys[live].tolist()
        tree = cls(max(n, 16))
        slot_of = dict(zip(live_keys, np.flatnonzero(live).tolist(), strict=True))
        if len(slot_of) != len(live_keys):
            raise InvalidArgument("tree columns: a block key appears twice")
        sources = columns.sources
        named = {s for s in sources if s is not None}
        if len(named) != sum(s is not None for s in sources):
            raise InvalidArgument("tree columns: a source has two bits")
        bits = np.unpackbits(holders[live].view(np.uint8), axis=1, bitorder="little")
        held = bits.sum(axis=0, dtype=np.int64)
        if any(held[b] and sources[b] is None for b in range(len(sources))):
            raise InvalidArgument("tree columns: holder bits without a source")
        if words > 1:
            tree._holders = np.zeros((tree.capacity, words), _U64)
        tree._slot_of = slot_of
        tree._key[:n] = np.where(live, keys, 0)
        tree._parent[:n] = parents
        tree._holders[:n] = np.where(live[:, None], holders, 0)
        tree._children[:n] = np.bincount(linked, minlength=n)[:n] if n else 0
        tree._high = n
        free = np.flatnonzero(~live)
        tree._push_free(free.astype(np.int64))
        tree._source_at = list(sources)
        tree._bit_of = {s: b for b, s in enumerate(sources) if s is not None}
        tree._free_bits = sorted((b for b, s in enumerate(sources) if s is None), reverse=True)
        tree._held = held
        return tree

    # ---- checks --------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` when the columns disagree (tests; O(nodes))."""
        hi = self._high
        live = np.flatnonzero(self._parent[:hi] != FREE)
        assert len(live) == len(self._slot_of), "dict and live slots disagree"
        for slot in live.tolist():
            assert self._slot_of[int(self._key[slot])] == slot, "key column disagrees"
        free = set(self._free[: self._nfree].tolist())
        assert len(free) == self._nfree and free.isdisjoint(live.tolist()), "free stack bad"
        assert len(free) + len(live) == hi, "slots leaked"
        parents = self._parent[live]
        expected = np.bincount(parents[parents >= 0], minlength=hi)[:hi]
        assert np.array_equal(expected[live], self._children[live]), "child counts wrong"
        assert np.all(self._parent[parents[parents >= 0]] != FREE), "parent is free"
        held_any = self._holders[live].any(axis=1)
        assert np.all(held_any | (self._children[live] > 0)), "dead node not reclaimed"
        bits = np.unpackbits(self._holders[live].view(np.uint8), axis=1, bitorder="little")
        counts = bits.sum(axis=0, dtype=np.int64)
        assert np.array_equal(counts, self._held), "holding counters wrong"
        for bit, source in enumerate(self._source_at):
            if source is None:
                assert counts[bit] == 0, "a free bit holds blocks"
