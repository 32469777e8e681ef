"""The radix hash tree's compiled core: :class:`NativeTree`, a thin shell over
``cortex.ledger._core.Tree`` (C).

The C tree keeps the same columns as the pure-Python core (:mod:`cortex.ledger.slots`) and,
for the dict, an open-addressing table of uint64 keys: per node 8 (key) + 4 (parent) +
4 (children) + 8 (recency) + 8 per holder word, plus 8 B per table entry at a load of 3/8..3/4.
Every call passes a whole batch (a list of ints or a uint64 array) and gets words back in a
bytearray, viewed as a numpy array without a copy; this module only maps sources to holder
bits and shapes the results as :class:`~cortex.ledger.tree.RadixHashTree` promises.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from cortex.ledger._core import Tree as _CoreTree
from cortex.ledger._core import (
    apply_update_run,
    plan_replica_ops,
    plan_update_batch,
    replay_replica_ops,
)
from cortex.ledger.errors import InvalidArgument
from cortex.ledger.match import SourceMatch
from cortex.ledger.model import LedgerState, Source
from cortex.ledger.tree import Eviction, Keys, RadixHashTree, TreeColumns, check_columns

__all__ = ["NativeTree", "PlannedOps", "PlannedUpdates", "SyncTarget", "Target", "UpdateRun"]

_U64 = np.uint64
_EMPTY_KEYS: npt.NDArray[np.uint64] = np.zeros(0, _U64)
# key 8 + parent 4 + children 4 + recency 8 + the table's 8 B entries at their mean load
# (between 3/8 and 3/4: ~2 entries per node)
_BYTES_PER_NODE = 8 + 4 + 4 + 8 + 16


# one planned op of a ReplicaBatch (``OpPlan`` in _core.c)
_OP_PLAN = np.dtype([("kind", "=i4"), ("source", "=i4"), ("parent", "=u8"), ("keys", "=i8"),
                     ("pkeys", "=i8"), ("n", "=i8")])
# one planned update of an UpdateBatch (``UpdatePlan`` in _sync.h)
_UPDATE_PLAN_BYTES = 4 * 4 + 5 * 8


def _words(buf: bytearray) -> npt.NDArray[np.uint64]:
    return np.frombuffer(buf, _U64)


class NativeTree(RadixHashTree):
    """Blocks of one hash domain in C columns (see :class:`RadixHashTree`'s contract)."""

    core = "native"

    def __init__(self, initial_capacity: int = 1024) -> None:
        super().__init__(initial_capacity)
        self._tree = _CoreTree(initial_capacity)

    # ---- sizes ---------------------------------------------------------------------------

    @staticmethod
    def node_bytes(words: int) -> int:
        return _BYTES_PER_NODE + 8 * words

    @property
    def nodes(self) -> int:
        return self._tree.nodes

    @property
    def holdings(self) -> int:
        return self._tree.holdings

    @property
    def words(self) -> int:
        return self._tree.words

    @property
    def capacity(self) -> int:
        return self._tree.capacity

    @property
    def evicted(self) -> int:
        return self._tree.evicted

    @property
    def allocated_bytes(self) -> int:
        """Bytes the C columns and key table have allocated (capacity included)."""
        return self._tree.allocated

    def blocks_of(self, source: Source) -> int:
        bit = self._bit_of.get(source)
        return 0 if bit is None else self._tree.held(bit)

    def _held_at(self, bit: int) -> int:
        return self._tree.held(bit)

    def __contains__(self, key: object) -> bool:
        try:
            k = operator.index(key)  # type: ignore[arg-type]  # any integer, as a dict does
        except TypeError:
            return False
        return 0 <= k < 1 << 64 and self._tree.slot_of(k) >= 0

    def _widen(self) -> None:
        self._tree.widen()

    # ---- updates -------------------------------------------------------------------------

    def store(self, source: Source, parent_key: int, keys: Keys, now: int) -> int:
        if not len(keys):
            return 0
        bit, fresh_bit = self._store_bit(source)
        try:
            return self._tree.store_chain(bit, parent_key, keys, now)
        except (ValueError, TypeError) as exc:
            self._refused(source, fresh_bit)
            raise InvalidArgument(str(exc)) from exc

    def store_pairs(
        self, source: Source, parent_keys: Keys, keys: Keys, now: int
    ) -> int:
        n = len(keys)
        if len(parent_keys) != n:
            raise InvalidArgument(f"{len(parent_keys)} parent keys for {n} keys")
        if n == 0:
            return 0
        bit, fresh_bit = self._store_bit(source)
        try:
            return self._tree.store_pairs(bit, parent_keys, keys, now)
        except (ValueError, TypeError) as exc:
            self._refused(source, fresh_bit)
            raise InvalidArgument(str(exc)) from exc

    def _store_bit(self, source: Source) -> tuple[int, bool]:
        """``source``'s bit, and whether this store registers it."""
        bit = self._bit_of.get(source)
        return (self.add_source(source), True) if bit is None else (bit, False)

    def _refused(self, source: Source, fresh_bit: bool) -> None:
        """Undo a refused store's registration: the C tree validates a batch before changing
        anything, the pure core before registering the source."""
        if fresh_bit:
            self.remove_source(source)

    def remove(self, source: Source, keys: Keys) -> npt.NDArray[np.uint64]:
        bit = self._bit_of.get(source)
        if bit is None or not len(keys):
            return _EMPTY_KEYS
        return _words(self._tree.remove(bit, keys))

    def clear(self, source: Source) -> int:
        bit = self._bit_of.get(source)
        return 0 if bit is None else self._tree.clear(bit)

    def _clear_range(self, bit: int, lo: int, hi: int) -> int:
        return self._tree.clear_range(bit, lo, hi)

    def touch(self, keys: Keys, now: int) -> int:
        return self._tree.touch(keys, now)

    # ---- queries -------------------------------------------------------------------------

    def match(self, keys: Keys, now: int) -> list[int]:
        return self._tree.match(keys, now)

    def match_roster(self, keys: Keys, now: int, roster: list[tuple[int, Source, LedgerState]]
                     ) -> list[SourceMatch]:
        answer: list[SourceMatch] = self._tree.match_roster(keys, now, roster, SourceMatch)
        return answer

    def _leading_rows(self, keys: Keys) -> npt.NDArray[np.uint64]:
        return _words(self._tree.leading_rows(keys)).reshape(-1, self.words)

    def holds(self, source: Source, key: int) -> bool:
        bit = self._bit_of.get(source)
        return bit is not None and self._tree.holds(bit, key)

    def keys_of(self, source: Source) -> set[int]:
        bit = self._bit_of.get(source)
        if bit is None:
            return set()
        keys: list[int] = _words(self._tree.keys_of(bit)).tolist()
        return set(keys)

    def recency_of(self, key: int) -> int:
        node = self._tree.node(key)
        return -1 if node is None else node[0]

    def parent_of(self, key: int) -> int | None:
        node = self._tree.node(key)
        return None if node is None else node[1]

    # ---- eviction ------------------------------------------------------------------------

    def live_recency(self) -> npt.NDArray[np.uint64]:
        return _words(self._tree.live_recency())

    def evict_older_than(self, cutoff: int) -> Eviction:
        return self._evicted_result(*self._tree.evict_older_than(cutoff))

    def evict_keys(self, keys: Keys) -> Eviction:
        return self._evicted_result(*self._tree.evict_keys(keys))

    def _evicted_result(self, keys: bytearray, rows: bytearray) -> Eviction:
        # the C tree already took the holdings off its counters
        eviction, _ = self._eviction(_words(keys), _words(rows).reshape(-1, self.words))
        return eviction

    # ---- copies --------------------------------------------------------------------------

    def columns(self) -> TreeColumns:
        self.settle()
        return self._columns(self._tree.dump())

    def _columns(self, dump: dict[str, bytearray]) -> TreeColumns:
        return TreeColumns(
            keys=_words(dump["key"]),
            parents=np.frombuffer(dump["parent"], np.int32),
            holders=_words(dump["holders"]).reshape(-1, self.words),
            sources=list(self._source_at),
        )

    def _load(self, columns: TreeColumns, held: npt.NDArray[np.int64]) -> None:
        words = columns.holders.shape[1]
        self._tree.load(
            np.ascontiguousarray(columns.keys, _U64).tobytes(),
            np.ascontiguousarray(columns.parents, np.int32).tobytes(),
            np.ascontiguousarray(columns.holders, _U64).tobytes(),
            words,
        )

    def check_invariants(self) -> None:
        dump = self._tree.dump()
        columns = self._columns(dump)
        live = np.flatnonzero(columns.parents != -2)
        assert len(live) == self.nodes, "table and live slots disagree"
        for slot, key in zip(live.tolist(), columns.keys[live].tolist(), strict=True):
            assert self._tree.slot_of(key) == slot, "key table disagrees"
        check_columns(columns, np.frombuffer(dump["children"], np.int32),
                      np.frombuffer(dump["free"], np.int32).astype(np.int64),
                      np.frombuffer(dump["held"], np.int64), self._retired)


Target = tuple[_CoreTree, int]
"""What a planned op applies to: a compiled tree and its source's holder bit."""


class PlannedOps:
    """A ReplicaBatch's ops read from its bytes by the compiled core, to be applied without a
    Python object per op (see :meth:`cortex.ledger.replica.LedgerReplica.apply`).

    :attr:`sources` are the distinct ``Source`` messages (bytes; ``b""`` when an op has none)
    of the ops the core applies; :attr:`python_ops` the indices of the others (attach,
    clear, detach, evict, and any op encoded unusually), which the caller applies through
    the protobuf runtime. ``ValueError`` when ``raw`` is not a protobuf message."""

    __slots__ = ("_plan", "_raw", "count", "python_ops", "sources")

    def __init__(self, raw: bytes) -> None:
        plan, self.sources = plan_replica_ops(raw)
        self._raw, self._plan = raw, plan
        kinds = np.frombuffer(plan, _OP_PLAN)["kind"]
        self.count = len(kinds)
        self.python_ops: list[int] = np.flatnonzero(kinds == 0).tolist()

    def __repr__(self) -> str:
        return (f"PlannedOps(ops={self.count}, python_ops={len(self.python_ops)}, "
                f"sources={len(self.sources)})")

    @staticmethod
    def target(tree: RadixHashTree, source: Source) -> Target | None:
        """What an op of ``source`` (placed in ``tree``) applies to; None when the tree is
        not a compiled one or does not know the source (the caller applies that op)."""
        if not isinstance(tree, NativeTree):
            return None
        bit = tree._bit_of.get(source)
        return None if bit is None else (tree._tree, bit)

    def replay(self, start: int, targets: list[Target | None], tick: int
               ) -> tuple[int, list[tuple[int, npt.NDArray[np.uint64]]]]:
        """Apply the ops from ``start`` (op i at recency ``tick + i + 1``) up to the first
        the caller must apply; returns its index (:attr:`count` when none is left) and, per
        remove op that dropped blocks, (index in :attr:`sources`, the keys dropped).
        :class:`InvalidArgument` when a tree refuses a store (the ops before it applied)."""
        try:
            stop, removed = replay_replica_ops(self._raw, self._plan, start, targets, tick)
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from exc
        return stop, [(at, _words(keys)) for at, keys in removed]


SyncTarget = tuple[_CoreTree, int, int, int, int, int]
"""What a planned update applies to: a compiled tree, its source's holder bit, the index of
the ``Domain`` bytes the source's record is in, its epoch, its last applied seq, and the
memory budget's bytes per node of that tree."""


@dataclass(frozen=True, slots=True)
class UpdateRun:
    """What :meth:`PlannedUpdates.apply` applied (see ``apply_update_run`` in ``_sync.h``)."""

    stop: int  # the first update not applied
    tick: int  # the recency clock after the run's stores
    stores: int
    removes: int
    seqs: list[tuple[int, int]]  # (source index, last applied seq) per source applied to
    removed: list[tuple[int, int, npt.NDArray[np.uint64]]]  # (update, source, keys dropped)
    journal: list[tuple[int, bytes]]  # (domain index, ReplicaBatch ``ops`` entries)


class PlannedUpdates:
    """An UpdateBatch's updates read from its bytes by the compiled core, for the index to
    apply the in-order stores and removals of in-sync sources without a Python object per
    update (see :meth:`cortex.index.prefix_index.PrefixIndex.apply_planned`).

    :attr:`sources` / :attr:`domains` are the distinct ``Source`` / ``Domain`` messages
    (bytes) the planned updates name; every other update (and any encoded unusually) is left
    to the caller, who applies it through the protobuf runtime. ``ValueError`` when ``raw``
    is not a protobuf message."""

    __slots__ = ("_plan", "_raw", "count", "domains", "sources")

    def __init__(self, raw: bytes) -> None:
        plan, self.sources, self.domains = plan_update_batch(raw)
        self._raw, self._plan = raw, plan
        self.count = len(plan) // _UPDATE_PLAN_BYTES

    def __repr__(self) -> str:
        return (f"PlannedUpdates(updates={self.count}, sources={len(self.sources)}, "
                f"domains={len(self.domains)})")

    @staticmethod
    def target(tree: RadixHashTree, source: Source, domain: int, epoch: int, seq: int
               ) -> SyncTarget | None:
        """What an in-order update of ``source`` (in-sync at ``(epoch, seq)``, placed in
        ``tree``) applies to; None when the tree is not a compiled one or has no bit for the
        source (the caller applies its updates)."""
        if not isinstance(tree, NativeTree):
            return None
        bit = tree._bit_of.get(source)
        if bit is None:
            return None
        return (tree._tree, bit, domain, epoch, seq, tree.node_bytes(tree.words))

    def apply(self, start: int, targets: list[SyncTarget | None], tick: int, headroom: int,
              journal: bool) -> UpdateRun:
        """Apply the in-order stores and removals from ``start`` (a store at recency
        ``tick + 1``, counting stores) up to the first update the caller must apply, or just
        after a store that takes ``headroom`` (bytes of memory budget) below 0; with
        ``journal``, the replica ops of what changed, encoded."""
        stop, tick, stores, removes, seqs, removed, segments = apply_update_run(
            self._raw, self._plan, start, targets, tick, headroom, self.sources, journal)
        return UpdateRun(stop, tick, stores, removes, seqs,
                         [(at, src, _words(keys)) for at, src, keys in removed], segments)
