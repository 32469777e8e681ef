"""The replica stream, both ends, without I/O: what an index sends so that another process
holds the same :class:`LedgerView`, and :class:`LedgerReplica`, which applies it.

A stream (``Index.Replicate``) is a snapshot — the sources and the tree columns of the
replicated models, cut into batches of at most ``max_bytes`` — then ordered journal batches
(:mod:`cortex.ledger.view`), each numbered ``seq`` = 1, 2, 3, … on that stream. A replica
accepts a stream only from its first batch (seq 1, a snapshot), in order, from one
``index_id``: anything else raises :class:`OutOfSync` and the owner reconnects, which starts
over with a snapshot. A replica that lost its stream keeps its last view (the owner decides
how long it may still be used) and reports ``STALE``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt
from google.protobuf.message import DecodeError

from cortex.hashing import HashDomain
from cortex.ledger import cores
from cortex.ledger.codec import (
    domain_from_pb,
    domain_to_pb,
    keys_to_le,
    op_from_pb,
    ops_to_pb,
    pb,
    source_from_pb,
    source_to_pb,
    state_from_pb,
)
from cortex.ledger.cores import tree_from_columns
from cortex.ledger.errors import InvalidArgument
from cortex.ledger.match import Match
from cortex.ledger.model import LedgerState, Source
from cortex.ledger.tree import TreeColumns
from cortex.ledger.view import Keys, LedgerView, Place, ViewOp, WireOps

if TYPE_CHECKING:
    from cortex.ledger.native import PlannedOps, Target

__all__ = [
    "LedgerReplica",
    "OutOfSync",
    "ReplicaChanges",
    "ReplicaState",
    "journal_batch",
    "journal_bytes",
    "snapshot_batches",
    "touch_request",
]

_CHUNK_OVERHEAD = 64  # bytes of a TreeChunk besides its columns (domain, sizes, tags)

MAX_TOUCHED = 4096
"""Matched blocks remembered per domain between two touch reports."""


class OutOfSync(Exception):
    """The stream cannot be applied (gap, another index, malformed): reconnect."""


class ReplicaState(StrEnum):
    EMPTY = "empty"  # never synced
    LOADING = "loading"  # a snapshot is arriving
    SYNCED = "synced"  # applying the live stream
    STALE = "stale"  # the stream was lost; the view is the last one seen


# ---- the index's side -------------------------------------------------------------------


def _wanted(domain: HashDomain, models: Collection[str]) -> bool:
    return not models or domain.model in models


def snapshot_batches(view: LedgerView, models: Collection[str], index_id: str, version: int,
                     max_bytes: int = 1 << 20) -> Iterator[pb.ReplicaBatch]:
    """The snapshot of ``view``'s domains of ``models`` (empty: all), as batches without
    ``seq`` (the sender numbers them). The view is copied before the first batch is made, so
    changes applied while the batches are sent belong after them."""
    columns = {d: t.columns() for d, t in view.trees.items() if _wanted(d, models)}
    places = [(s, p, view.trees[p.domain]) for s, p in view.places.items() if p.domain in columns]
    def fresh() -> pb.ReplicaBatch:
        return pb.ReplicaBatch(index_id=index_id, version=version, snapshot=True)

    batch = fresh()
    for source, place, tree in places:
        msg = batch.sources.add(bit=tree.bit_of(source), reason=place.reason)
        source_to_pb(source, msg.source)
        domain_to_pb(place.domain, msg.domain)
        msg.state = int(place.state)  # type: ignore[assignment]
    room, empty = max_bytes - batch.ByteSize(), not places
    for domain, col in columns.items():
        slots, words = len(col.keys), col.holders.shape[1]
        per_slot = 12 + 8 * words
        first = 0
        while True:
            n = min(slots - first, max(room // per_slot, 1 if empty else 0))
            if n == 0 and first < slots:
                yield batch
                batch, room, empty = fresh(), max_bytes, True
                continue
            chunk = batch.trees.add(slots=slots, words=words, first_slot=first)
            domain_to_pb(domain, chunk.domain)
            chunk.keys_le = col.keys[first:first + n].astype("<u8").tobytes()
            chunk.parents_le = col.parents[first:first + n].astype("<i4").tobytes()
            chunk.holders_le = col.holders[first:first + n].astype("<u8").tobytes()
            room -= n * per_slot + _CHUNK_OVERHEAD
            empty = False
            first += n
            if first >= slots:
                break
    batch.synced = True
    yield batch


def journal_batch(ops: Sequence[ViewOp | WireOps], index_id: str, version: int,
                  applied_unix_s: float) -> pb.ReplicaBatch:
    """One live batch of journal records (without ``seq``)."""
    batch = pb.ReplicaBatch(index_id=index_id, version=version, applied_unix_s=applied_unix_s)
    ops_to_pb(ops, batch)
    return batch


def journal_bytes(ops: Sequence[ViewOp | WireOps], index_id: str, version: int,
                  applied_unix_s: float) -> bytes:
    """:func:`journal_batch` encoded, records already encoded copied as they are (protobuf
    appends the ``ops`` of concatenated messages in order)."""
    parts = [pb.ReplicaBatch(index_id=index_id, version=version,
                             applied_unix_s=applied_unix_s).SerializeToString()]
    pending: list[ViewOp] = []
    for op in ops:
        if isinstance(op, WireOps):
            if pending:
                parts.append(journal_batch(pending, "", 0, 0.0).SerializeToString())
                pending = []
            parts.append(op.data)
        else:
            pending.append(op)
    if pending:
        parts.append(journal_batch(pending, "", 0, 0.0).SerializeToString())
    return b"".join(parts)


# ---- the replica's side -----------------------------------------------------------------


@dataclass(slots=True)
class ReplicaChanges:
    """What applied batches took away: blocks per source, and sources that lost everything
    or their READY state (whoever derived predictions from them drops those)."""

    removed: list[tuple[Source, npt.NDArray[np.uint64]]] = field(default_factory=list)
    cleared: set[Source] = field(default_factory=set)
    reset: bool = False  # a snapshot replaced the whole view


@dataclass(slots=True)
class _Loading:
    sources: list[tuple[Source, Place, int]] = field(default_factory=list)
    columns: dict[HashDomain, TreeColumns] = field(default_factory=dict)
    filled: dict[HashDomain, int] = field(default_factory=dict)


class LedgerReplica:
    """A :class:`LedgerView` kept equal to an index's by its replica stream.

    Call :meth:`begin` when a stream opens, :meth:`apply` with each batch in order,
    :meth:`lost` when it breaks. :meth:`match` answers like the index's Match. ``clock``
    (monotonic seconds) stamps the last batch for the owner's staleness rules.

    With the compiled core active, a live batch's stores and removals are applied from its
    bytes in one call (:class:`~cortex.ledger.native.PlannedOps`), other ops one by one as
    the pure-Python path does; ``wire_replay=False`` takes that path for every op (the
    benchmarks' baseline; the answers are the same).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic, *,
                 wire_replay: bool = True) -> None:
        self.view = LedgerView()
        self.state = ReplicaState.EMPTY
        self.index_id = ""
        self.version = 0
        self.snapshots = 0
        self.last_batch_s: float | None = None
        self.applied_unix_s = 0.0
        self._clock = clock
        self._wire_replay = wire_replay
        self._expect = 1
        self._loading: _Loading | None = None
        self._tick = 0
        self._touched: dict[HashDomain, set[int]] = {}

    def __repr__(self) -> str:
        return (f"LedgerReplica(state={self.state.value}, index_id={self.index_id!r}, "
                f"version={self.version}, {self.view!r})")

    @property
    def synced(self) -> bool:
        return self.state is ReplicaState.SYNCED

    # ---- the stream ----------------------------------------------------------------------

    def begin(self) -> None:
        """A new stream opened: it must start with a snapshot."""
        self._expect = 1
        self._loading = None
        if self.state is ReplicaState.SYNCED:
            self.state = ReplicaState.STALE

    def lost(self) -> None:
        """The stream broke: the view is kept, but no longer follows the index."""
        self._loading = None
        if self.state in (ReplicaState.SYNCED, ReplicaState.LOADING):
            self.state = ReplicaState.STALE if self.snapshots else ReplicaState.EMPTY

    def apply(self, batch: pb.ReplicaBatch) -> ReplicaChanges:
        """Apply the next batch of the stream. Raises :class:`OutOfSync` when it is not the
        one expected (the view is then left as it was before the batch)."""
        if batch.seq != self._expect:
            raise OutOfSync(f"batch seq {batch.seq}, expected {self._expect}")
        if self._expect == 1:
            if not batch.snapshot:
                raise OutOfSync("a stream must start with a snapshot")
            self._loading = _Loading()
            self.index_id = batch.index_id
            if self.state is not ReplicaState.STALE:
                self.state = ReplicaState.LOADING
        elif batch.index_id != self.index_id:
            raise OutOfSync(f"index_id changed to {batch.index_id!r} within a stream")
        self._expect += 1
        self.last_batch_s = self._clock()
        try:
            if batch.snapshot:
                changes = self._load(batch)
            elif self._loading is not None or self.state is not ReplicaState.SYNCED:
                raise OutOfSync("live batch before the snapshot completed")
            else:
                changes = self._replay(batch)
        except InvalidArgument as exc:
            raise OutOfSync(f"malformed replica batch: {exc}") from None
        self.version = batch.version
        return changes

    def _load(self, batch: pb.ReplicaBatch) -> ReplicaChanges:
        loading = self._loading
        if loading is None:
            raise OutOfSync("snapshot batch after the snapshot completed")
        for msg in batch.sources:
            place = Place(domain_from_pb(msg.domain), state_from_pb(msg.state, "sources.state"),
                          msg.reason)
            loading.sources.append((source_from_pb(msg.source, "sources.source"), place,
                                    msg.bit))
        for chunk in batch.trees:
            _fill(loading, chunk)
        if not batch.synced:
            return ReplicaChanges()
        self.view = _assemble(loading)
        self._loading = None
        self._touched.clear()
        self.state = ReplicaState.SYNCED
        self.snapshots += 1
        return ReplicaChanges(reset=True)

    def _replay(self, batch: pb.ReplicaBatch) -> ReplicaChanges:
        planned = None
        if (self._wire_replay and batch.ops and cores.active() is cores.Core.NATIVE
                and self.view.journal is None):
            planned = cores.plan_ops(batch.SerializeToString())
        if planned is not None:
            changes = self._replay_planned(batch, planned)
        else:
            ops = [op_from_pb(op) for op in batch.ops]  # all validated before any applies
            changes = ReplicaChanges()
            view = self.view
            for op in ops:
                self._tick += 1
                effect = view.replay(op, self._tick)
                changes.removed.extend(effect.removed)
                changes.cleared.update(effect.cleared)
        if batch.applied_unix_s:
            self.applied_unix_s = batch.applied_unix_s
        return changes

    def _replay_planned(self, batch: pb.ReplicaBatch, planned: PlannedOps) -> ReplicaChanges:
        """:meth:`_replay` with the planned ops applied by the compiled core: the same
        validation before anything applies, the same order, ticks and changes."""
        sources = [_source_of(raw) for raw in planned.sources]
        decoded = {i: op_from_pb(batch.ops[i]) for i in planned.python_ops}
        changes = ReplicaChanges()
        view, tick, count, start = self.view, self._tick, planned.count, 0
        try:
            while start < count:
                targets = [self._target(source) for source in sources]
                stop, removed = planned.replay(start, targets, tick)
                changes.removed.extend((sources[at], keys) for at, keys in removed)
                if stop >= count:
                    break
                op = decoded.get(stop)
                if op is None:  # a planned op the core left to Python (an unplaced source)
                    op = op_from_pb(batch.ops[stop])
                effect = view.replay(op, tick + stop + 1)
                changes.removed.extend(effect.removed)
                changes.cleared.update(effect.cleared)
                start = stop + 1
        finally:
            self._tick = tick + count
        return changes

    def _target(self, source: Source) -> Target | None:
        """The compiled tree and bit ``source``'s ops apply to (None: the per-op path)."""
        place = self.view.places.get(source)
        tree = None if place is None else self.view.trees.get(place.domain)
        return None if tree is None else cores.replica_target(tree, source)

    # ---- queries -------------------------------------------------------------------------

    def match(self, domain: HashDomain, keys: Keys) -> Match:
        """Per attached source of ``domain``: leading ``keys`` held, and its state, at this
        replica's version. The deepest block any source matched is remembered for
        :meth:`take_touched`."""
        self._tick += 1
        view = self.view
        matches = Match.of(view.match(domain, keys, self._tick), self.version, len(keys),
                           domain, shared_tier=view.has_shared_tier(domain))
        deepest = matches.deepest
        if deepest:
            touched = self._touched.setdefault(domain, set())
            if len(touched) < MAX_TOUCHED:
                touched.add(int(keys[deepest - 1]))
        return matches

    def take_touched(self) -> dict[HashDomain, list[int]]:
        """The blocks matched since the last call, per domain (for the index's recency)."""
        out = {d: sorted(keys) for d, keys in self._touched.items() if keys}
        self._touched.clear()
        return out

    def states(self) -> dict[Source, LedgerState]:
        return {s: p.state for s, p in self.view.places.items()}


def touch_request(touched: dict[HashDomain, list[int]]) -> pb.ReplicaRequest:
    """A later request of the stream: the blocks a replica matched."""
    msg = pb.ReplicaRequest()
    for domain, keys in touched.items():
        t = msg.touched.add(keys_le=keys_to_le(keys))
        domain_to_pb(domain, t.domain)
    return msg


def _source_of(raw: bytes) -> Source:
    """The validated source of a planned op's ``Source`` message bytes."""
    try:
        msg = pb.Source.FromString(raw)
    except DecodeError:
        raise InvalidArgument("source is not a Source message") from None
    return source_from_pb(msg)


def _fill(loading: _Loading, chunk: pb.TreeChunk) -> None:
    domain = domain_from_pb(chunk.domain)
    slots, words, first = chunk.slots, chunk.words, chunk.first_slot
    known = loading.columns.get(domain)
    if known is None:
        if words < 1 or words > 1024:
            raise InvalidArgument("tree chunk words out of range")
        col = loading.columns[domain] = TreeColumns(
            keys=np.zeros(slots, np.uint64),
            parents=np.full(slots, -2, np.int32),
            holders=np.zeros((slots, words), np.uint64),
            sources=[None] * (64 * words),
        )
        loading.filled[domain] = 0
    else:
        col = known
    if len(col.keys) != slots or col.holders.shape[1] != words:
        raise InvalidArgument("tree chunks of one domain disagree on its size")
    keys = np.frombuffer(chunk.keys_le, "<u8")
    n = len(keys)
    if (first != loading.filled[domain] or first + n > slots
            or len(chunk.parents_le) != 4 * n or len(chunk.holders_le) != 8 * words * n):
        raise InvalidArgument("tree chunk out of order or of the wrong size")
    col.keys[first:first + n] = keys
    col.parents[first:first + n] = np.frombuffer(chunk.parents_le, "<i4")
    col.holders[first:first + n] = np.frombuffer(chunk.holders_le, "<u8").reshape(n, words)
    loading.filled[domain] = first + n


def _assemble(loading: _Loading) -> LedgerView:
    for domain, col in loading.columns.items():
        if loading.filled[domain] != len(col.keys):
            raise InvalidArgument(f"snapshot of {domain.model} is incomplete")
    for source, place, bit in loading.sources:
        tree = loading.columns.get(place.domain)
        if tree is None:
            raise InvalidArgument(f"source {source} is in a domain without a tree")
        if not 0 <= bit < len(tree.sources) or tree.sources[bit] is not None:
            raise InvalidArgument(f"source {source} has a bad or duplicate bit {bit}")
        tree.sources[bit] = source
    trees = {domain: tree_from_columns(col) for domain, col in loading.columns.items()}
    return LedgerView.from_parts(trees, {source: place for source, place, _ in loading.sources})
