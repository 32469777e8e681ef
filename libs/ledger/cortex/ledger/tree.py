"""Radix hash tree of one hash domain: which source holds which block, in compact columns.

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

Cortex keys are chained (a key determines its whole prefix), so matching needs only per-key
holder lookups; parent links give the structure: which nodes are leaves (eviction) and when a
holderless node can go. A parent key the tree has never seen gets a holderless *placeholder*
node (typically the chain root, which carries LoRA / cache-salt extras), so links stay exact
when that block is stored later. A node is reclaimed as soon as it has neither holders nor
children; its slot goes on a free stack and is zeroed, so a recycled slot never inherits
holders. Eviction only removes leaves, so it can only make a source look like it holds *less*.

The tree is pure and single-threaded; ``now`` arguments are ticks of the caller's clock.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from cortex.ledger.errors import InvalidArgument
from cortex.ledger.model import Source

__all__ = ["FREE", "NO_PARENT", "Eviction", "RadixHashTree", "TreeColumns", "no_eviction",
           "node_bytes"]

if sys.byteorder != "little":  # pragma: no cover - holder bit counting views uint64 as bytes
    raise ImportError("cortex.ledger.tree needs a little-endian machine")

NO_PARENT = -1
"""``_parent`` of a node whose parent block is not in the tree."""
FREE = -2
"""``_parent`` of a slot on the free stack."""

_U64 = np.uint64
_SMALL = 16
"""Pairs up to which a store runs element by element (see ``_store_small``)."""
_EMPTY_KEYS: npt.NDArray[np.uint64] = np.zeros(0, _U64)

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


@dataclass(frozen=True, slots=True)
class Eviction:
    """Nodes evicted from a tree: every one's key, and per holder the keys it lost."""

    keys: npt.NDArray[np.uint64]
    dropped: tuple[tuple[Source, npt.NDArray[np.uint64]], ...]

    @property
    def nodes(self) -> int:
        return len(self.keys)


_NO_EVICTION = Eviction(np.zeros(0, np.uint64), ())


def _count_bits(counts: list[int], before: list[int], after: list[int], count: int) -> None:
    """``counts[bit] = count`` for every bit set in ``before`` and clear in ``after``
    (holder words, 64 bits each)."""
    for word, (was, now) in enumerate(zip(before, after, strict=True)):
        dropped = was & ~now
        base = 64 * word
        while dropped:
            low = dropped & -dropped
            counts[base + low.bit_length() - 1] = count
            dropped ^= low


def no_eviction() -> Eviction:
    return _NO_EVICTION


def node_bytes(words: int) -> int:
    """Estimated bytes one node costs in a tree whose holder bitsets are ``words`` wide."""
    return _DICT_BYTES_PER_NODE + _COLUMN_BYTES_PER_NODE + 8 * words


class RadixHashTree:
    """Blocks of one hash domain, their parent links, holders and recency.

    Contract:

    * ``store`` / ``store_pairs`` make a source hold blocks; ``remove`` / ``clear`` /
      ``remove_source`` drop holdings; a node without holders and children is reclaimed at
      once (placeholders included).
    * ``match(keys)`` gives, per registered source, the count of consecutive leading ``keys``
      it holds.
    * ``evict_older_than(cutoff)`` / ``evict_keys(keys)`` forget whole old subtrees for every
      holder (the memory budget; a replica repeats its index's evictions by key).
    * ``columns()`` / ``from_columns()`` copy the whole tree (a replica's snapshot).
    * Counts are in blocks; ``bytes_estimate`` is in bytes (``nodes * node_bytes(words)``).
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
        self.evicted = 0
        """Nodes evicted for the memory budget since creation."""

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

    def __repr__(self) -> str:
        return (
            f"RadixHashTree(nodes={self.nodes}, holdings={self.holdings}, "
            f"sources={len(self._bit_of)}, capacity={self.capacity}, evicted={self.evicted})"
        )

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

    def _link_orphan(self, slot: int, parent: int) -> None:
        """Give a placeholder-rooted node its now known parent, unless that makes a cycle."""
        if parent < 0 or parent == slot:
            return
        p = parent
        for _ in range(len(self._slot_of)):
            if p == slot:
                return  # bogus input (keys are chained hashes): never create a cycle
            p = int(self._parent[p])
            if p < 0:
                break
        self._parent[slot] = parent
        self._children[parent] += 1

    # ---- updates -------------------------------------------------------------------------

    def store(self, source: Source, parent_key: int, keys: Sequence[int], now: int) -> int:
        """``source`` holds the chain ``keys`` following ``parent_key``; returns new holdings.

        Raises :class:`InvalidArgument` when the chain is not a path (``parent_key`` among
        ``keys``); nothing is changed then.
        """
        if not keys:
            return 0
        parents = [parent_key, *keys[:-1]]
        return self.store_pairs(source, parents, keys, now)

    def store_pairs(
        self, source: Source, parent_keys: Sequence[int], keys: Sequence[int], now: int
    ) -> int:
        """``source`` holds every ``keys[i]``, whose parent block is ``parent_keys[i]``.

        Pairs must be listed parents-first: a parent that is itself a key of the batch must
        appear at an earlier index. Returns the number of new holdings (blocks). Raises
        :class:`InvalidArgument` (before changing anything) when the lists differ in length
        or are not parents-first.
        """
        n = len(keys)
        if len(parent_keys) != n:
            raise InvalidArgument(f"{len(parent_keys)} parent keys for {n} keys")
        if n == 0:
            return 0
        first: dict[int, int] = {}
        for i, key in enumerate(keys):
            first.setdefault(key, i)
        for i, parent in enumerate(parent_keys):
            j = first.get(parent)
            if j is not None and j >= i:
                raise InvalidArgument(f"blocks not listed parents-first (block {i})")
        bit = self.add_source(source)
        if n <= _SMALL:
            return self._store_small(bit, parent_keys, keys, now)
        get = self._slot_of.get
        slots = [get(k, -1) for k in keys]
        fresh_keys = [k for k, s in zip(keys, slots, strict=True) if s < 0]
        created: npt.NDArray[np.int64] | None = None
        if fresh_keys:
            fresh_keys = list(dict.fromkeys(fresh_keys))
            # slots first, so that parents listed in the same batch resolve below
            created = self._alloc(len(fresh_keys))
            self._slot_of.update(zip(fresh_keys, created.tolist(), strict=True))
            slots = [get(k, -1) for k in keys]
        pslots = [get(p, -1) for p in parent_keys]
        if -1 in pslots:
            unknown = list(dict.fromkeys(p for p, s in zip(parent_keys, pslots, strict=True)
                                         if s < 0))
            self._new_nodes(unknown, np.full(len(unknown), NO_PARENT, np.int64), now)
            pslots = [get(p, -1) for p in parent_keys]
        slot_arr = np.array(slots, np.int64)
        pslot_arr = np.array(pslots, np.int64)
        if created is not None:
            # the first occurrence of each new key decides its parent
            idx = np.array([first[k] for k in fresh_keys], np.int64)
            par = pslot_arr[idx]
            self._key[created] = np.array(fresh_keys, _U64)
            self._parent[created] = par
            linked = par[par >= 0]
            if linked.size:
                np.add.at(self._children, linked, 1)
        orphans = np.flatnonzero(self._parent[slot_arr] == NO_PARENT)
        for i in orphans.tolist():
            self._link_orphan(slots[i], pslots[i])
        uniq = np.unique(slot_arr) if n > 1 else slot_arr
        word, mask = bit >> 6, _U64(1 << (bit & 63))
        col = self._holders[uniq, word]
        fresh = int(np.count_nonzero((col & mask) == 0))
        self._holders[uniq, word] = col | mask
        self._recency[uniq] = now
        self._held[bit] += fresh
        return fresh

    def _store_small(self, bit: int, parent_keys: Sequence[int], keys: Sequence[int],
                     now: int) -> int:
        """:meth:`store_pairs` of a few (validated) pairs, one at a time: what a single
        engine event carries. Per-call numpy overhead would cost more than the work."""
        slot_of = self._slot_of
        word, mask = bit >> 6, 1 << (bit & 63)
        self._grow(self._high + 2 * len(keys))  # room for every key and parent: no regrowth
        holders, recency = self._holders, self._recency
        fresh = 0
        for parent_key, key in zip(parent_keys, keys, strict=True):
            pslot = slot_of.get(parent_key)
            if pslot is None:  # an unknown parent: a holderless placeholder root
                pslot = self._new_slot(parent_key, NO_PARENT, now)
            slot = slot_of.get(key)
            if slot is None:
                slot = self._new_slot(key, pslot, now)
            elif self._parent[slot] == NO_PARENT:
                self._link_orphan(slot, pslot)
            held = int(holders[slot, word])
            if not held & mask:
                holders[slot, word] = held | mask
                fresh += 1
            recency[slot] = now
        self._held[bit] += fresh
        return fresh

    def _new_slot(self, key: int, parent: int, now: int) -> int:
        """A node for ``key`` under ``parent`` (a slot, or ``NO_PARENT``)."""
        if self._nfree:
            self._nfree -= 1
            slot = int(self._free[self._nfree])
        else:
            slot = self._high
            self._high += 1
        self._slot_of[key] = slot
        self._key[slot] = key
        self._parent[slot] = parent
        self._recency[slot] = now
        if parent >= 0:
            self._children[parent] += 1
        return slot

    def remove(self, source: Source, keys: Sequence[int]) -> npt.NDArray[np.uint64]:
        """``source`` no longer holds ``keys``; returns the keys it actually held (dropped)."""
        bit = self._bit_of.get(source)
        if bit is None or not keys:
            return _EMPTY_KEYS
        get = self._slot_of.get
        found = [s for s in (get(k) for k in keys) if s is not None]
        if not found:
            return _EMPTY_KEYS
        slots = np.unique(np.array(found, np.int64))
        word, mask = bit >> 6, _U64(1 << (bit & 63))
        col = self._holders[slots, word]
        slots = slots[(col & mask) != 0]
        if not slots.size:
            return _EMPTY_KEYS
        self._holders[slots, word] &= ~mask
        self._held[bit] -= len(slots)
        dropped: npt.NDArray[np.uint64] = self._key[slots].copy()
        self._reclaim(self._dead(slots))
        return dropped

    def clear(self, source: Source) -> int:
        """``source`` holds nothing any more (it stays registered); returns dropped holdings.

        Cost: one vectorised scan of the holder column (~1 ms per million slots).
        """
        bit = self._bit_of.get(source)
        if bit is None:
            return 0
        dropped = int(self._held[bit])
        if not dropped:
            return 0
        word, mask = bit >> 6, _U64(1 << (bit & 63))
        rows = np.flatnonzero(self._holders[: self._high, word] & mask)
        self._holders[rows, word] &= ~mask
        self._held[bit] = 0
        self._reclaim(self._dead(rows))
        return dropped

    def remove_source(self, source: Source) -> int:
        """Clear ``source`` and release its bit; returns dropped holdings."""
        dropped = self.clear(source)
        bit = self._bit_of.pop(source, None)
        if bit is not None:
            self._source_at[bit] = None
            self._free_bits.append(bit)
            self._free_bits.sort(reverse=True)
        return dropped

    def _dead(self, rows: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """The subset of ``rows`` that has neither holders nor children."""
        dead: npt.NDArray[np.int64] = rows[
            (self._children[rows] == 0) & ~self._holders[rows].any(axis=1)
        ]
        return dead

    # ---- queries -------------------------------------------------------------------------

    def match(self, keys: Sequence[int], now: int) -> list[int]:
        """Per source bit, the count of consecutive leading ``keys`` held (blocks).

        The list is indexed by source bit (see :meth:`bits`); found nodes get recency ``now``.
        """
        counts = [0] * (64 * self.words)
        idx = self._leading_slots(keys)
        n = len(idx)
        if n == 0:
            return counts
        cum = np.bitwise_and.accumulate(self._holders[idx], axis=0)
        self._recency[idx] = now
        # cumulative AND only loses bits: a source's count is the row where its bit drops
        # (the rows where anything drops are few, one per source at most), or n
        for row in (np.flatnonzero((cum[1:] != cum[:-1]).any(axis=1)) + 1).tolist():
            _count_bits(counts, cum[row - 1].tolist(), cum[row].tolist(), row)
        _count_bits(counts, cum[-1].tolist(), [0] * cum.shape[1], n)
        return counts

    def _leading_slots(self, keys: Sequence[int]) -> npt.NDArray[np.int64]:
        """Slots of the leading ``keys`` the tree has (up to the first absent one)."""
        if not keys:
            return np.zeros(0, np.int64)
        get = self._slot_of.get
        slots = [get(k, -1) for k in keys]
        try:
            n = slots.index(-1)
        except ValueError:
            n = len(slots)
        return np.array(slots[:n] if n < len(slots) else slots, np.int64)

    def held_columns(self, keys: Sequence[int], bits: Sequence[int]) -> npt.NDArray[np.bool_]:
        """``out[i, j]``: whether source bit ``bits[j]`` holds ``keys[i]``, for the leading
        keys the tree has (rows stop at the first absent key: nobody holds it)."""
        idx = self._leading_slots(keys)
        out = np.zeros((len(idx), len(bits)), np.bool_)
        if len(idx):
            rows = self._holders[idx]
            for j, bit in enumerate(bits):
                out[:, j] = (rows[:, bit >> 6] >> _U64(bit & 63)) & _U64(1) != 0
        return out

    def bits(self) -> Iterator[tuple[int, Source]]:
        """``(bit, source)`` of every registered source."""
        for bit, source in enumerate(self._source_at):
            if source is not None:
                yield bit, source

    def holds(self, source: Source, key: int) -> bool:
        """Whether ``source`` holds block ``key``."""
        bit = self._bit_of.get(source)
        slot = self._slot_of.get(key)
        if bit is None or slot is None:
            return False
        return bool(int(self._holders[slot, bit >> 6]) >> (bit & 63) & 1)

    def keys_of(self, source: Source) -> set[int]:
        """Every key ``source`` holds (a scan: for tests and debugging)."""
        bit = self._bit_of.get(source)
        if bit is None:
            return set()
        rows = np.flatnonzero(self._holders[: self._high, bit >> 6] & _U64(1 << (bit & 63)))
        return set(self._key[rows].tolist())

    def recency_of(self, key: int) -> int:
        """The recency tick of block ``key`` (-1 when absent; for tests and debugging)."""
        slot = self._slot_of.get(key)
        return -1 if slot is None else int(self._recency[slot])

    def parent_of(self, key: int) -> int | None:
        """Parent block key of ``key`` (None when unknown or a root)."""
        slot = self._slot_of.get(key)
        if slot is None:
            return None
        parent = int(self._parent[slot])
        return None if parent < 0 else int(self._key[parent])

    # ---- eviction ------------------------------------------------------------------------

    def live_recency(self) -> npt.NDArray[np.uint64]:
        """Recency ticks of every live node (to pick an eviction cutoff)."""
        hi = self._high
        recency: npt.NDArray[np.uint64] = self._recency[:hi][self._parent[:hi] != FREE]
        return recency

    def evict_older_than(self, cutoff: int) -> Eviction:
        """Evict every node whose whole subtree has recency <= ``cutoff``.

        That is exactly what repeatedly evicting a least-recently-used *leaf* (recency <=
        ``cutoff``) converges to, done in a few vectorised passes: a young node protects its
        ancestors, and only unprotected old nodes go, so no kept node loses a descendant's
        link.
        """
        hi = self._high
        parent = self._parent[:hi]
        live = parent != FREE
        old = live & (self._recency[:hi] <= cutoff)
        protected = np.zeros(hi, np.bool_)
        young_parents = parent[live & ~old]
        protected[young_parents[young_parents >= 0]] = True
        # protection climbs through old ancestors only (a young one protects its own parent)
        frontier = np.flatnonzero(protected & old)
        while frontier.size:
            up = parent[frontier]
            up = up[up >= 0]
            up = up[~protected[up]]
            protected[up] = True
            frontier = up[old[up]]
        victims = np.flatnonzero(old & ~protected)
        return self._evict_slots(victims)

    def evict_keys(self, keys: Sequence[int]) -> Eviction:
        """Evict the nodes of ``keys`` for every holder (another tree's eviction, repeated).

        The set is meant to be closed under descendants, as :meth:`evict_older_than` picks
        it; a kept child of an evicted node becomes a root (its prefix is gone, so it can no
        longer match: only under-estimates). Unknown keys are ignored.
        """
        get = self._slot_of.get
        found = [s for s in (get(k) for k in keys) if s is not None]
        if not found:
            return _NO_EVICTION
        return self._evict_slots(np.unique(np.array(found, np.int64)))

    def _evict_slots(self, victims: npt.NDArray[np.int64]) -> Eviction:
        if not victims.size:
            return _NO_EVICTION
        hi = self._high
        parent = self._parent[:hi]
        rows = self._holders[victims]
        keys = self._key[victims].copy()
        dropped: list[tuple[Source, npt.NDArray[np.uint64]]] = []
        for bit, source in self.bits():
            held = (rows[:, bit >> 6] & _U64(1 << (bit & 63))) != 0
            count = int(np.count_nonzero(held))
            if count:
                self._held[bit] -= count
                dropped.append((source, keys[held]))
        slot_of = self._slot_of
        for key in keys.tolist():
            del slot_of[key]
        parents = parent[victims].astype(np.int64)
        victim_mask = np.zeros(hi, np.bool_)
        victim_mask[victims] = True
        kept_children = np.flatnonzero(
            ~victim_mask & (parent >= 0) & victim_mask[np.maximum(parent, 0)]
        )
        if kept_children.size:
            self._parent[kept_children] = NO_PARENT
        outside = parents[parents >= 0]
        outside = outside[~victim_mask[outside]]
        self._parent[victims] = FREE
        self._key[victims] = 0
        self._recency[victims] = 0
        self._children[victims] = 0
        self._holders[victims] = 0
        self._push_free(victims.astype(np.int64))
        self.evicted += len(victims)
        if outside.size:
            np.subtract.at(self._children, outside, 1)
            self._reclaim(self._dead(np.unique(outside)))
        return Eviction(keys, tuple(dropped))

    def touch(self, keys: Sequence[int], now: int) -> int:
        """Give the nodes of ``keys`` recency ``now`` (matched elsewhere); returns how many
        exist. A touched node protects its ancestors from eviction too."""
        get = self._slot_of.get
        found = [s for s in (get(k) for k in keys) if s is not None]
        if found:
            self._recency[np.array(found, np.int64)] = now
        return len(found)

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
    def from_columns(cls, columns: TreeColumns) -> RadixHashTree:
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
