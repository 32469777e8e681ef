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

:class:`SlotColumns` owns the columns, their growth, the free stack and the whole-store copies
(:class:`~cortex.ledger.tree.TreeColumns`, a replica's snapshot); what the nodes mean — stores,
matches, eviction — is :class:`~cortex.ledger.pytree.PythonTree`'s. The compiled core
(:mod:`cortex.ledger.native`) keeps the same columns in C, with a uint64 hash table for the
dict. A reclaimed slot goes on the free stack and is zeroed, so a recycled slot never
inherits holders.
"""

from __future__ import annotations

import sys

import numpy as np
import numpy.typing as npt

from cortex.ledger.model import Source
from cortex.ledger.tree import FREE, RadixHashTree, TreeColumns, check_columns

__all__ = ["SlotColumns"]

if sys.byteorder != "little":  # pragma: no cover - holder bit counting views uint64 as bytes
    raise ImportError("cortex.ledger.slots needs a little-endian machine")

_U64 = np.uint64

# Per-node cost outside the numpy columns, measured on CPython 3.11 (x86-64): the dict's
# index + entry tables at their average fill (~42 B), the key int object (2**60..2**64 ->
# 36 B, 40 B from pymalloc) and the slot int object (28 B, 32 B from pymalloc).
_DICT_BYTES_PER_NODE = 42 + 40 + 32
# key 8 + parent 4 + children 4 + recency 8, plus 8 per holder word
_COLUMN_BYTES_PER_NODE = 24


class SlotColumns(RadixHashTree):
    """Slots of one tree's nodes in parallel numpy columns and the free stack.

    A base of :class:`~cortex.ledger.pytree.PythonTree`; single-threaded, no I/O.
    """

    def __init__(self, initial_capacity: int = 1024) -> None:
        super().__init__(initial_capacity)
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
        self._held: npt.NDArray[np.int64] = np.zeros(64, np.int64)  # holdings per source bit
        self._evicted = 0

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
    def evicted(self) -> int:
        return self._evicted

    @staticmethod
    def node_bytes(words: int) -> int:
        return _DICT_BYTES_PER_NODE + _COLUMN_BYTES_PER_NODE + 8 * words

    def blocks_of(self, source: Source) -> int:
        """Blocks ``source`` holds (0 for an unknown source)."""
        bit = self._bit_of.get(source)
        return 0 if bit is None else int(self._held[bit])

    def _held_at(self, bit: int) -> int:
        return int(self._held[bit])

    def __contains__(self, key: object) -> bool:
        return key in self._slot_of

    def _widen(self) -> None:
        extra = np.zeros((len(self._holders), 1), _U64)
        self._holders = np.ascontiguousarray(np.hstack([self._holders, extra]))
        self._held = np.concatenate([self._held, np.zeros(64, np.int64)])

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

    # ---- copies --------------------------------------------------------------------------

    def columns(self) -> TreeColumns:
        """A copy of every slot handed out so far (free ones included), and the source of
        each holder bit: what :meth:`from_columns` rebuilds the same tree from."""
        self.settle()
        return self._columns()

    def _columns(self) -> TreeColumns:
        hi = self._high
        return TreeColumns(
            keys=self._key[:hi].copy(),
            parents=self._parent[:hi].copy(),
            holders=self._holders[:hi].copy(),
            sources=list(self._source_at),
        )

    def _load(self, columns: TreeColumns, held: npt.NDArray[np.int64]) -> None:
        keys, parents, holders = columns.keys, columns.parents, columns.holders
        n, words = len(keys), holders.shape[1]
        self._grow(n)
        live = parents != FREE
        linked = parents[live]
        linked = linked[linked >= 0]
        self._slot_of = dict(zip(keys[live].tolist(), np.flatnonzero(live).tolist(),
                                 strict=True))
        if words > 1:
            self._holders = np.zeros((self.capacity, words), _U64)
        self._key[:n] = np.where(live, keys, 0)
        self._parent[:n] = parents
        self._holders[:n] = np.where(live[:, None], holders, 0)
        self._children[:n] = np.bincount(linked, minlength=n)[:n] if n else 0
        self._high = n
        self._push_free(np.flatnonzero(~live).astype(np.int64))
        self._held = held

    # ---- checks --------------------------------------------------------------------------

    def check_invariants(self) -> None:
        hi = self._high
        live = np.flatnonzero(self._parent[:hi] != FREE)
        assert len(live) == len(self._slot_of), "dict and live slots disagree"
        for slot in live.tolist():
            assert self._slot_of[int(self._key[slot])] == slot, "key column disagrees"
        check_columns(self._columns(), self._children[:hi], self._free[: self._nfree],
                      self._held, self._retired)
