"""The radix hash tree's pure-Python core: numpy columns and a dict (the executable
specification of :class:`~cortex.ledger.tree.RadixHashTree`).

A node is a slot in compact numpy columns (:mod:`cortex.ledger.slots`: their layout, growth,
free stack and whole-tree copies); this module gives the slots their meaning. The compiled core
(:mod:`cortex.ledger.native`) must agree with it on every observable result; a differential
test drives both with random operation streams. Pure and single-threaded.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from cortex.ledger.errors import InvalidArgument
from cortex.ledger.model import Source
from cortex.ledger.slots import _U64, SlotColumns
from cortex.ledger.tree import FREE, NO_PARENT, Eviction, Keys, no_eviction

__all__ = ["PythonTree"]

_SMALL = 16
"""Pairs up to which a store runs element by element (see ``_store_small``)."""
_EMPTY_KEYS: npt.NDArray[np.uint64] = np.zeros(0, _U64)


def _ints(keys: Keys) -> Sequence[int]:
    """Keys as Python ints: this core looks them up in a dict (key arrays become lists once,
    here)."""
    if isinstance(keys, np.ndarray):
        out: list[int] = keys.tolist()
        return out
    return keys


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


class PythonTree(SlotColumns):
    """Blocks of one hash domain in numpy columns (see :class:`RadixHashTree`'s contract)."""

    core = "python"

    # ---- links ---------------------------------------------------------------------------

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

    def store(self, source: Source, parent_key: int, keys: Keys, now: int) -> int:
        keys = _ints(keys)
        if not keys:
            return 0
        parents = [parent_key, *keys[:-1]]
        return self.store_pairs(source, parents, keys, now)

    def store_pairs(
        self, source: Source, parent_keys: Keys, keys: Keys, now: int
    ) -> int:
        parent_keys, keys = _ints(parent_keys), _ints(keys)
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
            if self._parent[slots[i]] == NO_PARENT:  # a key listed twice links once
                self._link_orphan(slots[i], pslots[i])
        uniq = np.unique(slot_arr) if n > 1 else slot_arr
        word, mask = bit >> 6, _U64(1 << (bit & 63))
        col = self._holders[uniq, word]
        fresh = int(np.count_nonzero((col & mask) == 0))
        self._holders[uniq, word] = col | mask
        self._recency[uniq] = now
        self._held[bit] += fresh
        return fresh

    def _store_small(self, bit: int, parent_keys: Keys, keys: Keys,
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

    def remove(self, source: Source, keys: Keys) -> npt.NDArray[np.uint64]:
        keys = _ints(keys)
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
        bit = self._bit_of.get(source)
        return 0 if bit is None else self._clear_range(bit, 0, self._high)

    def _clear_range(self, bit: int, lo: int, hi: int) -> int:
        if not self._held[bit]:
            return 0
        word, mask = bit >> 6, _U64(1 << (bit & 63))
        rows = lo + np.flatnonzero(self._holders[lo:min(hi, self._high), word] & mask)
        self._holders[rows, word] &= ~mask
        self._held[bit] -= len(rows)
        self._reclaim(self._dead(rows))
        return len(rows)

    # ---- queries -------------------------------------------------------------------------

    def match(self, keys: Keys, now: int) -> list[int]:
        keys = _ints(keys)
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

    def _leading_rows(self, keys: Keys) -> npt.NDArray[np.uint64]:
        rows: npt.NDArray[np.uint64] = self._holders[self._leading_slots(keys)]
        return rows

    def _leading_slots(self, keys: Keys) -> npt.NDArray[np.int64]:
        """Slots of the leading ``keys`` the tree has (up to the first absent one)."""
        keys = _ints(keys)
        if not keys:
            return np.zeros(0, np.int64)
        get = self._slot_of.get
        slots = [get(k, -1) for k in keys]
        try:
            n = slots.index(-1)
        except ValueError:
            n = len(slots)
        return np.array(slots[:n] if n < len(slots) else slots, np.int64)

    def holds(self, source: Source, key: int) -> bool:
        bit = self._bit_of.get(source)
        slot = self._slot_of.get(key)
        if bit is None or slot is None:
            return False
        return bool(int(self._holders[slot, bit >> 6]) >> (bit & 63) & 1)

    def keys_of(self, source: Source) -> set[int]:
        bit = self._bit_of.get(source)
        if bit is None:
            return set()
        rows = np.flatnonzero(self._holders[: self._high, bit >> 6] & _U64(1 << (bit & 63)))
        return set(self._key[rows].tolist())

    def recency_of(self, key: int) -> int:
        slot = self._slot_of.get(key)
        return -1 if slot is None else int(self._recency[slot])

    def parent_of(self, key: int) -> int | None:
        slot = self._slot_of.get(key)
        if slot is None:
            return None
        parent = int(self._parent[slot])
        return None if parent < 0 else int(self._key[parent])

    # ---- eviction ------------------------------------------------------------------------

    def live_recency(self) -> npt.NDArray[np.uint64]:
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

    def evict_keys(self, keys: Keys) -> Eviction:
        keys = _ints(keys)
        get = self._slot_of.get
        found = [s for s in (get(k) for k in keys) if s is not None]
        if not found:
            return no_eviction()
        return self._evict_slots(np.unique(np.array(found, np.int64)))

    def _evict_slots(self, victims: npt.NDArray[np.int64]) -> Eviction:
        if not victims.size:
            return no_eviction()
        hi = self._high
        parent = self._parent[:hi]
        eviction, lost = self._eviction(self._key[victims].copy(), self._holders[victims])
        for bit, count in lost:
            self._held[bit] -= count
        keys = eviction.keys
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
        self._evicted += len(victims)
        if outside.size:
            np.subtract.at(self._children, outside, 1)
            self._reclaim(self._dead(np.unique(outside)))
        return eviction

    def touch(self, keys: Keys, now: int) -> int:
        keys = _ints(keys)
        get = self._slot_of.get
        found = [s for s in (get(k) for k in keys) if s is not None]
        if found:
            self._recency[np.array(found, np.int64)] = now
        return len(found)
