"""Radix hash tree of one hash domain: which source holds which block — the contract, and
what its two cores share.

Cortex keys are chained (a key determines its whole prefix), so matching needs only per-key
holder lookups; parent links give the structure: which nodes are leaves (eviction) and when a
holderless node can go. A parent key the tree has never seen gets a holderless *placeholder*
node (typically the chain root, which carries LoRA / cache-salt extras), so links stay exact
when that block is stored later. A node is reclaimed as soon as it has neither holders nor
children; a recycled slot never inherits holders. Eviction only removes leaves, so it can only
make a source look like it holds *less*.

Two cores implement the contract (:mod:`cortex.ledger.cores` picks one per process):

* :class:`~cortex.ledger.native.NativeTree` — the compiled core (``cortex.ledger._core``, C),
  the default wherever it is built;
* :class:`~cortex.ledger.pytree.PythonTree` — numpy columns and a dict, the executable
  specification: a differential test drives both with random operation streams.

:func:`cortex.ledger.cores.new_tree` and :func:`~cortex.ledger.cores.tree_from_columns` build
a tree of the active core. Trees are pure and single-threaded; ``now`` arguments are ticks of
the caller's clock.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import numpy.typing as npt

from cortex.ledger.errors import InvalidArgument
from cortex.ledger.match import SourceMatch
from cortex.ledger.model import LedgerState, Source

__all__ = [
    "FREE",
    "NO_PARENT",
    "SWEEP_SLOTS",
    "Eviction",
    "Keys",
    "RadixHashTree",
    "TreeColumns",
    "no_eviction",
    "validate_columns",
]

NO_PARENT = -1
"""Parent slot of a node whose parent block is not in the tree."""
FREE = -2
"""Parent slot of a free slot."""

_U64 = np.uint64

SWEEP_SLOTS = 16384
"""Slots one :meth:`RadixHashTree.sweep` step scans, and the holdings up to which a source
is dropped at once instead: a step is a few ms in the compiled core (more in the pure-Python
one), where clearing a million-block source at once took 50-340 ms."""

Keys = Sequence[int] | npt.NDArray[np.uint64]
"""A batch of block keys: ints (a list, a decoded update's ``array('Q')``) or a uint64 array
(a replica batch's keys). The compiled core reads buffers in place."""


@dataclass(frozen=True, slots=True)
class Eviction:
    """Nodes evicted from a tree: every one's key, and per holder the keys it lost."""

    keys: npt.NDArray[np.uint64]
    dropped: tuple[tuple[Source, npt.NDArray[np.uint64]], ...]

    @property
    def nodes(self) -> int:
        return len(self.keys)


_NO_EVICTION = Eviction(np.zeros(0, _U64), ())


def no_eviction() -> Eviction:
    return _NO_EVICTION


@dataclass(frozen=True, slots=True)
class TreeColumns:
    """A whole tree as columns (see :meth:`RadixHashTree.columns`): per slot its key
    (``uint64``), parent slot (``int32``: ``NO_PARENT``, ``FREE``) and holder bitset
    (``uint64[slots, words]``); ``sources[bit]`` is the source of each holder bit. The same
    layout from either core: a snapshot of one loads into the other."""

    keys: npt.NDArray[np.uint64]
    parents: npt.NDArray[np.int32]
    holders: npt.NDArray[np.uint64]
    sources: list[Source | None]


def validate_columns(columns: TreeColumns) -> npt.NDArray[np.int64]:
    """Holdings per source bit of ``columns``, once they are checked consistent.

    Raises :class:`InvalidArgument` on lengths that differ, parents outside the slots or on
    free slots, a key twice, a source with two bits or holder bits without a source.
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
    if len(np.unique(keys[live])) != int(np.count_nonzero(live)):
        raise InvalidArgument("tree columns: a block key appears twice")
    sources = columns.sources
    named = {s for s in sources if s is not None}
    if len(named) != sum(s is not None for s in sources):
        raise InvalidArgument("tree columns: a source has two bits")
    bits = np.unpackbits(holders[live].view(np.uint8), axis=1, bitorder="little")
    held: npt.NDArray[np.int64] = bits.sum(axis=0, dtype=np.int64)
    if any(held[b] and sources[b] is None for b in range(len(sources))):
        raise InvalidArgument("tree columns: holder bits without a source")
    return held


def check_columns(columns: TreeColumns, children: npt.NDArray[np.int32],
                  free: npt.NDArray[np.int64], held: npt.NDArray[np.int64],
                  retired: Collection[int] = ()) -> None:
    """Raise ``AssertionError`` when a tree's columns disagree with each other (tests;
    O(slots)): child counts, free stack, dead nodes kept, holding counters (``retired``
    bits, being drained, may hold blocks without a source)."""
    parent, holders = columns.parents, columns.holders
    hi = len(parent)
    live = np.flatnonzero(parent != FREE)
    assert len(set(free.tolist())) == len(free), "free stack bad"
    assert set(free.tolist()).isdisjoint(live.tolist()), "free stack bad"
    assert len(free) + len(live) == hi, "slots leaked"
    parents = parent[live]
    expected = np.bincount(parents[parents >= 0], minlength=hi)[:hi]
    assert np.array_equal(expected[live], children[live]), "child counts wrong"
    assert np.all(parent[parents[parents >= 0]] != FREE), "parent is free"
    held_any = holders[live].any(axis=1)
    assert np.all(held_any | (children[live] > 0)), "dead node not reclaimed"
    bits = np.unpackbits(holders[live].view(np.uint8), axis=1, bitorder="little")
    counts = bits.sum(axis=0, dtype=np.int64)
    assert np.array_equal(counts, held), "holding counters wrong"
    for bit, source in enumerate(columns.sources):
        if source is None and bit not in retired:
            assert counts[bit] == 0, "a free bit holds blocks"


class RadixHashTree(ABC):
    """Blocks of one hash domain, their parent links, holders and recency.

    Contract:

    * ``store`` / ``store_pairs`` make a source hold blocks; ``remove`` / ``clear`` /
      ``remove_source`` / ``retire`` drop holdings; a node without holders and children is
      reclaimed at once (placeholders included), except after ``retire``: its bit leaves the
      roster at once and ``sweep`` takes its holdings off, a bounded step at a time.
    * ``match(keys)`` gives, per registered source, the count of consecutive leading ``keys``
      it holds.
    * ``evict_older_than(cutoff)`` / ``evict_keys(keys)`` forget whole old subtrees for every
      holder (the memory budget; a replica repeats its index's evictions by key).
    * ``columns()`` / ``from_columns()`` copy the whole tree (a replica's snapshot).
    * Counts are in blocks; ``bytes_estimate`` is in bytes (``nodes * node_bytes(words)``,
      :func:`cortex.ledger.cores.node_bytes`).
    * Key batches are int sequences or ``uint64`` arrays; key results are ``uint64`` arrays
      whose order is unspecified.

    This base owns what both cores share: the source ↔ holder-bit roster and the shapes of
    results.
    """

    core: ClassVar[str]
    """The core's name (``native`` / ``python``: logs, /admin, metrics)."""
    sync_clear_max: int = SWEEP_SLOTS
    """:meth:`retire` clears up to this many holdings at once (tests lower it)."""

    def __init__(self, initial_capacity: int = 1024) -> None:
        del initial_capacity  # the cores size their columns
        self._bit_of: dict[Source, int] = {}
        self._source_at: list[Source | None] = [None] * 64
        self._free_bits: list[int] = list(range(63, -1, -1))  # pop() yields the lowest
        self._retired: dict[int, int] = {}  # retired bit -> next slot sweep() scans

    def __repr__(self) -> str:
        return (
            f"RadixHashTree(core={self.core}, nodes={self.nodes}, holdings={self.holdings}, "
            f"sources={len(self._bit_of)}, capacity={self.capacity}, evicted={self.evicted})"
        )

    # ---- sizes ---------------------------------------------------------------------------

    @staticmethod
    @abstractmethod
    def node_bytes(words: int) -> int:
        """Estimated bytes per node of this core with ``words``-wide holder bitsets."""

    @property
    @abstractmethod
    def nodes(self) -> int:
        """Live nodes (blocks, placeholders included)."""

    @property
    @abstractmethod
    def holdings(self) -> int:
        """(node, source) pairs."""

    @property
    @abstractmethod
    def words(self) -> int:
        """Width of the holder bitsets in 64-bit words."""

    @property
    @abstractmethod
    def capacity(self) -> int:
        """Slots the columns have room for."""

    @property
    @abstractmethod
    def evicted(self) -> int:
        """Nodes evicted for the memory budget since creation."""

    @property
    def bytes_estimate(self) -> int:
        """Estimated bytes held by live nodes (see :meth:`node_bytes`)."""
        return self.nodes * self.node_bytes(self.words)

    @abstractmethod
    def blocks_of(self, source: Source) -> int:
        """Blocks ``source`` holds (0 for an unknown source)."""

    @abstractmethod
    def __contains__(self, key: object) -> bool: ...

    def __len__(self) -> int:
        return self.nodes

    # ---- sources -------------------------------------------------------------------------

    @property
    def sources(self) -> list[Source]:
        """Registered sources, in bit order."""
        return [s for s in self._source_at if s is not None]

    def add_source(self, source: Source) -> int:
        """Register ``source`` (idempotent); returns its bit. Widens bitsets when full."""
        bit = self._bit_of.get(source)
        if bit is not None:
            return bit
        if not self._free_bits:
            base = 64 * self.words
            self._widen()
            self._source_at.extend([None] * 64)
            self._free_bits.extend(range(base + 63, base - 1, -1))
            self._free_bits.sort(reverse=True)
        bit = self._free_bits.pop()
        self._bit_of[source] = bit
        self._source_at[bit] = source
        return bit

    @abstractmethod
    def _widen(self) -> None:
        """Make the holder bitsets one word wider."""

    def has_source(self, source: Source) -> bool:
        return source in self._bit_of

    def bit_of(self, source: Source) -> int:
        """The holder bit of a registered source (``KeyError`` otherwise)."""
        return self._bit_of[source]

    def bits(self) -> Iterator[tuple[int, Source]]:
        """``(bit, source)`` of every registered source."""
        for bit, source in enumerate(self._source_at):
            if source is not None:
                yield bit, source

    def remove_source(self, source: Source) -> int:
        """Drop ``source`` and its bit (:meth:`retire`); returns its holdings."""
        return self.retire(source)

    def retire(self, source: Source, *, rejoin: bool = False) -> int:
        """``source`` holds nothing from now on as far as every query can tell; returns the
        holdings it had. With ``rejoin`` it stays registered (a clear), else it leaves.

        Up to :attr:`sync_clear_max` holdings are cleared at once; more (a million-block pool
        takes ~50 ms and more to clear) stay under the source's old bit, which leaves the
        roster at once and is taken off by :meth:`sweep`, a bounded step per call, then
        reused; the source rejoins under a fresh bit."""
        bit = self._bit_of.get(source)
        if bit is None:
            return 0
        held = self._held_at(bit)
        if held <= self.sync_clear_max:
            self.clear(source)
            if not rejoin:
                self._release(source)
            return held
        self._release(source, keep_bit=True)
        self._retired[bit] = 0
        if rejoin:
            self.add_source(source)
        return held

    def _release(self, source: Source, keep_bit: bool = False) -> None:
        bit = self._bit_of.pop(source)
        self._source_at[bit] = None
        if not keep_bit:
            self._free_bit(bit)

    def _free_bit(self, bit: int) -> None:
        self._free_bits.append(bit)
        self._free_bits.sort(reverse=True)  # pop() yields the lowest

    @property
    def retiring(self) -> bool:
        """Whether retired bits remain to :meth:`sweep`."""
        return bool(self._retired)

    @property
    def retired(self) -> int:
        """Holdings of retired bits not yet taken off (blocks)."""
        return sum(self._held_at(bit) for bit in self._retired)

    def sweep(self, slots: int = 0) -> bool:
        """Take a retired bit off the next ``slots`` slots (0: :data:`SWEEP_SLOTS`),
        reclaiming what that leaves dead; returns whether retired holdings remain. Bounded
        work: call it once per loop turn until it returns False."""
        for bit, lo in self._retired.items():
            hi = lo + (slots or SWEEP_SLOTS)
            self._clear_range(bit, lo, hi)
            if hi >= self.capacity or not self._held_at(bit):
                del self._retired[bit]
                self._free_bit(bit)
            else:
                self._retired[bit] = hi
            break
        return bool(self._retired)

    def settle(self) -> None:
        """Finish every sweep now (a whole-tree copy needs it; O(slots))."""
        while self.sweep(max(self.capacity, 1)):
            pass

    @abstractmethod
    def _held_at(self, bit: int) -> int:
        """Holdings of source bit ``bit``."""

    @abstractmethod
    def _clear_range(self, bit: int, lo: int, hi: int) -> int:
        """Take ``bit`` off the slots ``[lo, hi)``, reclaiming what it leaves dead; returns
        the holdings dropped."""

    def _adopt_sources(self, sources: list[Source | None]) -> None:
        """Take the roster of a copied tree (``sources[bit]``, see :class:`TreeColumns`)."""
        self._source_at = list(sources)
        self._bit_of = {s: b for b, s in enumerate(sources) if s is not None}
        self._free_bits = sorted((b for b, s in enumerate(sources) if s is None), reverse=True)

    # ---- updates -------------------------------------------------------------------------

    @abstractmethod
    def store(self, source: Source, parent_key: int, keys: Keys, now: int) -> int:
        """``source`` holds the chain ``keys`` following ``parent_key``; returns new holdings.

        Raises :class:`InvalidArgument` when the chain is not a path (``parent_key`` among
        ``keys``); nothing is changed then.
        """

    @abstractmethod
    def store_pairs(
        self, source: Source, parent_keys: Keys, keys: Keys, now: int
    ) -> int:
        """``source`` holds every ``keys[i]``, whose parent block is ``parent_keys[i]``.

        Pairs must be listed parents-first: a parent that is itself a key of the batch must
        appear at an earlier index. Returns the number of new holdings (blocks). Raises
        :class:`InvalidArgument` (before changing anything) when the lists differ in length
        or are not parents-first.
        """

    @abstractmethod
    def remove(self, source: Source, keys: Keys) -> npt.NDArray[np.uint64]:
        """``source`` no longer holds ``keys``; returns the keys it actually held (dropped)."""

    @abstractmethod
    def clear(self, source: Source) -> int:
        """``source`` holds nothing any more (it stays registered); returns dropped
        holdings. Cost: one scan of the holder column."""

    @abstractmethod
    def touch(self, keys: Keys, now: int) -> int:
        """Give the nodes of ``keys`` recency ``now`` (matched elsewhere); returns how many
        exist. A touched node protects its ancestors from eviction too."""

    # ---- queries -------------------------------------------------------------------------

    @abstractmethod
    def match(self, keys: Keys, now: int) -> list[int]:
        """Per source bit, the count of consecutive leading ``keys`` held (blocks).

        The list is indexed by source bit (see :meth:`bits`); found nodes get recency ``now``.
        """

    def match_roster(self, keys: Keys, now: int, roster: list[tuple[int, Source, LedgerState]]
                     ) -> list[SourceMatch]:
        """:meth:`match` as a view answers it: ``SourceMatch(source, count, state)`` for each
        roster entry ``(bit, source, state)``, in roster order."""
        counts = self.match(keys, now)
        new = tuple.__new__  # a third of SourceMatch(...)'s cost, per source of every match
        return [new(SourceMatch, (source, counts[bit], state)) for bit, source, state in roster]

    @abstractmethod
    def _leading_rows(self, keys: Keys) -> npt.NDArray[np.uint64]:
        """Holder rows (``uint64[n, words]``) of the leading ``keys`` the tree has (up to the
        first absent one)."""

    def held_columns(self, keys: Keys, bits: Sequence[int]) -> npt.NDArray[np.bool_]:
        """``out[i, j]``: whether source bit ``bits[j]`` holds ``keys[i]``, for the leading
        keys the tree has (rows stop at the first absent key: nobody holds it)."""
        rows = self._leading_rows(keys)
        out = np.zeros((len(rows), len(bits)), np.bool_)
        if len(rows):
            for j, bit in enumerate(bits):
                out[:, j] = (rows[:, bit >> 6] >> _U64(bit & 63)) & _U64(1) != 0
        return out

    @abstractmethod
    def holds(self, source: Source, key: int) -> bool:
        """Whether ``source`` holds block ``key``."""

    @abstractmethod
    def keys_of(self, source: Source) -> set[int]:
        """Every key ``source`` holds (a scan: for tests and debugging)."""

    @abstractmethod
    def recency_of(self, key: int) -> int:
        """The recency tick of block ``key`` (-1 when absent; for tests and debugging)."""

    @abstractmethod
    def parent_of(self, key: int) -> int | None:
        """Parent block key of ``key`` (None when unknown or a root)."""

    # ---- eviction ------------------------------------------------------------------------

    @abstractmethod
    def live_recency(self) -> npt.NDArray[np.uint64]:
        """Recency ticks of every live node (to pick an eviction cutoff)."""

    @abstractmethod
    def evict_older_than(self, cutoff: int) -> Eviction:
        """Evict every node whose whole subtree has recency <= ``cutoff``: exactly what
        repeatedly evicting a least-recently-used *leaf* (recency <= ``cutoff``) converges
        to (a young node protects its ancestors)."""

    @abstractmethod
    def evict_keys(self, keys: Keys) -> Eviction:
        """Evict the nodes of ``keys`` for every holder (another tree's eviction, repeated).

        The set is meant to be closed under descendants, as :meth:`evict_older_than` picks
        it; a kept child of an evicted node becomes a root (its prefix is gone, so it can no
        longer match: only under-estimates). Unknown keys are ignored.
        """

    def _eviction(self, keys: npt.NDArray[np.uint64], rows: npt.NDArray[np.uint64]
                  ) -> tuple[Eviction, list[tuple[int, int]]]:
        """The :class:`Eviction` of nodes ``keys`` with holder ``rows``, and the holdings each
        source bit lost (``(bit, count)``)."""
        if not len(keys):
            return _NO_EVICTION, []
        dropped: list[tuple[Source, npt.NDArray[np.uint64]]] = []
        lost: list[tuple[int, int]] = []
        for bit, source in [*self.bits(), *((b, None) for b in self._retired)]:
            held = (rows[:, bit >> 6] & _U64(1 << (bit & 63))) != 0
            count = int(np.count_nonzero(held))
            if count:
                lost.append((bit, count))
                if source is not None:  # a retired bit's loss concerns nobody
                    dropped.append((source, keys[held]))
        return Eviction(keys, tuple(dropped)), lost

    # ---- copies --------------------------------------------------------------------------

    @abstractmethod
    def columns(self) -> TreeColumns:
        """A copy of every slot handed out so far (free ones included), and the source of
        each holder bit: what :meth:`from_columns` rebuilds the same tree from (retired
        bits are drained first: :meth:`settle`)."""

    @classmethod
    def from_columns(cls, columns: TreeColumns) -> RadixHashTree:
        """The tree :meth:`columns` copied (recency starts at 0 everywhere), in this class's
        core (a snapshot of either core loads into either).

        Raises :class:`InvalidArgument` when the columns are inconsistent (see
        :func:`validate_columns`); nothing is kept then.
        """
        held = validate_columns(columns)
        tree = cls(max(len(columns.keys), 16))
        tree._load(columns, held)
        tree._adopt_sources(columns.sources)
        return tree

    @abstractmethod
    def _load(self, columns: TreeColumns, held: npt.NDArray[np.int64]) -> None:
        """Fill this empty tree from validated ``columns`` (``held``: holdings per bit)."""

    @abstractmethod
    def check_invariants(self) -> None:
        """Raise ``AssertionError`` when the tree's structures disagree (tests; O(nodes))."""
