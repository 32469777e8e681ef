"""What routers see of the ledger: per hash domain a radix tree, per source its domain and
state, and the longest-prefix query over them.

The index's core keeps one :class:`LedgerView` (it adds sequencing, the memory budget and the
change log around it); every gateway keeps a replica of it. Both change a view only through
the mutators below, and when ``journal`` is a list every mutator appends the
:data:`ViewOp` that repeats it (with the model it concerns, so replicas of some models get
only theirs), so applying an index's journal to a copy of its view
(:meth:`LedgerView.replay`) gives the same answers to every query — by construction, and
checked by a differential property test.

Pure and single-threaded; ``now`` arguments are ticks of the owner's recency clock.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from cortex.hashing import Engine, HashDomain
from cortex.ledger.cores import new_tree
from cortex.ledger.errors import InvalidArgument
from cortex.ledger.match import SourceMatch
from cortex.ledger.model import LedgerState, Source, Tier
from cortex.ledger.tiers import OFFLOAD_TIERS, continuation
from cortex.ledger.tree import Eviction, Keys, RadixHashTree, no_eviction

__all__ = [
    "Attach",
    "Clear",
    "Detach",
    "Evict",
    "Journaled",
    "Keys",
    "LedgerView",
    "Place",
    "Remove",
    "Store",
    "StorePairs",
    "ViewOp",
    "WireOps",
]


_new = tuple.__new__

@dataclass(frozen=True, slots=True)
class Place:
    """Where a source's blocks live (its domain's tree) and the state routers see."""

    domain: HashDomain
    state: LedgerState
    reason: str = ""


# ---- journal records: one per mutator ------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Attach:
    """``source`` joins ``domain``'s tree (leaving another domain's, blocks dropped) or only
    changes state."""

    source: Source
    domain: HashDomain
    state: LedgerState
    reason: str


@dataclass(frozen=True, slots=True)
class Detach:
    """``source`` leaves its tree (removed, or its ledger is no longer anyone's)."""

    source: Source


@dataclass(frozen=True, slots=True)
class Store:
    source: Source
    parent_key: int
    keys: Keys


@dataclass(frozen=True, slots=True)
class StorePairs:
    source: Source
    parent_keys: Keys
    keys: Keys


@dataclass(frozen=True, slots=True)
class Remove:
    source: Source
    keys: Keys


@dataclass(frozen=True, slots=True)
class Clear:
    source: Source


@dataclass(frozen=True, slots=True)
class Evict:
    """Nodes evicted from ``domain``'s tree for every holder (the memory budget)."""

    domain: HashDomain
    keys: npt.NDArray[np.uint64]


ViewOp = Attach | Detach | Store | StorePairs | Remove | Clear | Evict


@dataclass(frozen=True, slots=True)
class WireOps:
    """Journal records already encoded: ``ReplicaBatch.ops`` entries (protobuf wire bytes)
    of stores and removals the index applied from an ingest batch's bytes in one call
    (:meth:`cortex.index.prefix_index.PrefixIndex.apply_planned`). A replica batch carries
    them as they are; :func:`cortex.ledger.codec.ops_from_wire` reads them back."""

    data: bytes

_Roster = tuple[list[tuple[int, Source, "Place"]], bool, list[tuple[int, Source, LedgerState]],
                bool]

Journaled = tuple[str, ViewOp | WireOps]
"""A journal entry: the model the change(s) concern, and the change(s)."""


class LedgerView:
    """Trees per hash domain and the place of every attached source.

    Contract: a source is in exactly one tree while it has a :class:`Place` (its blocks are
    there), and in none after :meth:`detach`. :meth:`match` reports every attached source of
    the domain with its state; only ``READY`` ones should get credit (the caller's rule).
    Block counts are in blocks; ``bytes_estimate`` is in bytes.
    """

    def __init__(self, *, journal: list[Journaled] | None = None) -> None:
        self.trees: dict[HashDomain, RadixHashTree] = {}
        self.places: dict[Source, Place] = {}
        self.journal = journal
        self._by_model: dict[str, list[HashDomain]] = {}
        self._rosters: dict[HashDomain, _Roster] = {}

    @classmethod
    def from_parts(cls, trees: dict[HashDomain, RadixHashTree], places: dict[Source, Place]
                   ) -> LedgerView:
        """A view of existing trees (a snapshot's); every place's source must be registered
        in its domain's tree (:class:`InvalidArgument` otherwise)."""
        for source, place in places.items():
            tree = trees.get(place.domain)
            if tree is None or not tree.has_source(source):
                raise InvalidArgument(f"source {source} is not in its domain's tree")
        view = cls()
        view.trees = dict(trees)
        view.places = dict(places)
        for domain in trees:
            view._by_model.setdefault(domain.model, []).append(domain)
        return view

    def __repr__(self) -> str:
        return (
            f"LedgerView(domains={len(self.trees)}, sources={len(self.places)}, "
            f"blocks={self.blocks}, bytes={self.bytes_estimate})"
        )

    # ---- sizes and lookups -----------------------------------------------------------------

    @property
    def blocks(self) -> int:
        """Live nodes over every tree."""
        return sum(t.nodes for t in self.trees.values())

    @property
    def bytes_estimate(self) -> int:
        return sum(t.bytes_estimate for t in self.trees.values())

    def blocks_of(self, source: Source) -> int:
        place = self.places.get(source)
        return 0 if place is None else self.trees[place.domain].blocks_of(source)

    def resolve_domain(
        self, model: str, block_size: int = 0, engine: Engine | None = None
    ) -> HashDomain | None:
        """The model's domain, narrowed by ``block_size`` (0 = any) and ``engine`` (None =
        any). None when no domain fits; :class:`InvalidArgument` when several do."""
        domains = self._by_model.get(model)
        if not domains:
            return None
        if len(domains) == 1 and not block_size and engine is None:
            return domains[0]
        fits = [
            d for d in domains
            if (not block_size or d.block_size == block_size)
            and (engine is None or d.engine == engine)
        ]
        if len(fits) > 1:
            names = ", ".join(f"block_size={d.block_size} engine={d.engine.value}" for d in fits)
            raise InvalidArgument(
                f"model {model!r} has {len(fits)} hash domains ({names}): "
                "set block_size and/or engine"
            )
        return fits[0] if fits else None

    def match(
        self,
        domain: HashDomain,
        keys: Keys,
        now: int,
        candidate_workers: Collection[str] = (),
    ) -> list[SourceMatch]:
        """Per attached source of ``domain`` (those of ``candidate_workers`` when given), the
        count of consecutive leading ``keys`` it holds, and its state.

        Device and shared sources count their own prefix. A host or disk source counts the
        blocks it adds after its worker rank's device prefix (:mod:`cortex.ledger.tiers`);
        one that is not READY counts 0 and adds nothing."""
        tree = self.trees.get(domain)
        if tree is None:
            return []
        roster, offload, states, _ = self._roster(domain, tree)
        if not offload:  # the common case: the tree builds the answer
            if candidate_workers:
                states = [r for r in states if r[1].worker_id in candidate_workers]
            return tree.match_roster(keys, now, states)
        counts = tree.match(keys, now)
        if candidate_workers:
            roster = [r for r in roster if r[1].worker_id in candidate_workers]
        out = [_new(SourceMatch, (s, counts[bit], p.state)) for bit, s, p in roster]
        _extend_by_tiers(tree, keys, roster, counts, out)
        return out

    def has_shared_tier(self, domain: HashDomain) -> bool:
        """Whether a source of the shared tier is attached in ``domain`` (when none is, a
        match's shared prefix is 0 without looking: :meth:`Match.of`'s ``shared_tier``)."""
        cached = self._rosters.get(domain)  # a match just cached it: one lookup
        if cached is None:
            tree = self.trees.get(domain)
            if tree is None:
                return False
            cached = self._roster(domain, tree)
        return cached[3]

    def _roster(self, domain: HashDomain, tree: RadixHashTree) -> _Roster:
        """``(bit, source, place)`` of the domain's attached sources, whether any is an
        offload tier, ``(bit, source, state)`` of each, and whether any is of the shared
        tier (cached until a source of the domain attaches, changes state or leaves: a
        match's per-source work is only building its answer)."""
        cached = self._rosters.get(domain)
        if cached is None:
            places = self.places
            roster = [(bit, s, places[s]) for bit, s in tree.bits() if s in places]
            cached = (roster, any(s.tier in OFFLOAD_TIERS for _, s, _ in roster),
                      [(bit, s, p.state) for bit, s, p in roster],
                      any(s.tier is Tier.SHARED for _, s, _ in roster))
            self._rosters[domain] = cached
        return cached

    # ---- mutators (journaled) ------------------------------------------------------------

    def _log(self, domain: HashDomain, op: ViewOp) -> None:
        if self.journal is not None:
            self.journal.append((domain.model, op))

    def attach(self, source: Source, domain: HashDomain, state: LedgerState,
               reason: str = "") -> RadixHashTree:
        """Place ``source`` in ``domain``'s tree with ``state`` (a source placed in another
        domain moves, its blocks dropped). Idempotent; returns the tree."""
        place = self.places.get(source)
        if place is not None and place.state is state and place.reason == reason and (
                place.domain is domain or place.domain == domain):
            return self.trees[domain]  # the common case (every update publishes its source)
        if place is not None and place.domain != domain:
            self.detach(source)
            place = None
        tree = self.trees.get(domain)
        if tree is None:
            tree = self.trees[domain] = new_tree()
            self._by_model.setdefault(domain.model, []).append(domain)
        new = Place(domain, state, reason)
        if place != new:
            if place is None:
                tree.add_source(source)
            self.places[source] = new
            self._rosters.pop(domain, None)
            self._log(domain, Attach(source, domain, state, reason))
        return tree

    def detach(self, source: Source) -> int:
        """``source`` leaves its tree; returns the holdings dropped (0 when not placed)."""
        place = self.places.pop(source, None)
        if place is None:
            return 0
        domain = place.domain
        tree = self.trees[domain]
        dropped = tree.remove_source(source)
        self._rosters.pop(domain, None)
        if not tree.sources:
            del self.trees[domain]
            models = self._by_model[domain.model]
            models.remove(domain)
            if not models:
                del self._by_model[domain.model]
        self._log(domain, Detach(source))
        return dropped

    def _domain(self, source: Source) -> HashDomain:
        place = self.places.get(source)
        if place is None:
            raise InvalidArgument(f"source {source} is not attached")
        return place.domain

    def store(self, source: Source, parent_key: int, keys: Keys, now: int) -> int:
        """``source`` holds the chain ``keys`` after ``parent_key``; returns new holdings.
        :class:`InvalidArgument` when the source is not attached or the chain is bad."""
        domain = self._domain(source)
        fresh = self.trees[domain].store(source, parent_key, keys, now)
        self._log(domain, Store(source, parent_key, keys))
        return fresh

    def store_pairs(self, source: Source, parent_keys: Keys, keys: Keys, now: int) -> int:
        """``source`` holds every ``keys[i]`` (parent ``parent_keys[i]``, parents first)."""
        domain = self._domain(source)
        fresh = self.trees[domain].store_pairs(source, parent_keys, keys, now)
        self._log(domain, StorePairs(source, parent_keys, keys))
        return fresh

    def remove(self, source: Source, keys: Keys) -> npt.NDArray[np.uint64]:
        """``source`` no longer holds ``keys``; returns the keys it held (dropped)."""
        domain = self._domain(source)
        dropped = self.trees[domain].remove(source, keys)
        if dropped.size:
            self._log(domain, Remove(source, dropped))
        return dropped

    def clear(self, source: Source, *, replaced: bool = False) -> int:
        """``source`` holds nothing (it stays attached); returns the holdings dropped (0,
        and no journal record, when it is not attached or holds nothing). A large ledger
        is taken off later by :meth:`sweep` (:meth:`RadixHashTree.retire`): no query
        credits it from now on.

        ``replaced``: a snapshot replaces the ledger, so the clear is journaled even when
        it held nothing here. The snapshot may stand for removals nobody journaled (its
        blocks were dropped while its ingest was lost, or while it awaited the snapshot):
        a replica reports the source cleared, so what its owner derived from the old
        ledger (a gateway's predicted blocks) goes too."""
        place = self.places.get(source)
        if place is None:
            return 0
        dropped = self.trees[place.domain].retire(source, rejoin=True)
        if dropped:
            self._rosters.pop(place.domain, None)  # its bit may have changed
        if dropped or replaced:
            self._log(place.domain, Clear(source))
        return dropped

    @property
    def retiring(self) -> bool:
        """Whether :meth:`sweep` has work."""
        return any(t.retiring for t in self.trees.values())

    @property
    def retired(self) -> int:
        """Holdings of cleared or detached sources still to be taken off (blocks)."""
        return sum(t.retired for t in self.trees.values())

    def sweep(self, slots: int = 0) -> bool:
        """One bounded step of taking cleared and detached ledgers off their trees
        (:meth:`RadixHashTree.sweep`); returns whether more steps are needed. The owner
        calls it once per loop turn while it returns True: removing a million-block source
        never holds the loop for more than a step. Not journaled: a replica sweeps its own
        copy, and no answer depends on how far either got."""
        busy = [t for t in self.trees.values() if t.retiring]
        return bool(busy) and (busy[0].sweep(slots) or len(busy) > 1)

    def evict_older_than(self, domain: HashDomain, cutoff: int) -> Eviction:
        """The memory budget: evict ``domain``'s subtrees whose recency is <= ``cutoff``."""
        eviction = self.trees[domain].evict_older_than(cutoff)
        if eviction.nodes:
            self._log(domain, Evict(domain, eviction.keys))
        return eviction

    def evict_keys(self, domain: HashDomain, keys: Keys) -> Eviction:
        """Repeat another view's eviction of the nodes ``keys`` in ``domain``."""
        tree = self.trees.get(domain)
        if tree is None:
            return no_eviction()
        eviction = tree.evict_keys(keys)
        if eviction.nodes:
            self._log(domain, Evict(domain, eviction.keys))
        return eviction

    # ---- replicas ------------------------------------------------------------------------

    def replay(self, op: ViewOp, now: int) -> ReplayEffect:
        """Apply one journal record of another view; returns what it took away (the
        replica's owner invalidates what it derived from those blocks)."""
        if isinstance(op, Attach):
            prior = self.places.get(op.source)
            self.attach(op.source, op.domain, op.state, op.reason)
            lost = prior is not None and prior.state is LedgerState.READY and (
                op.state is not LedgerState.READY or prior.domain != op.domain)
            return ReplayEffect(cleared=(op.source,) if lost else ())
        if isinstance(op, Detach):
            known = op.source in self.places
            self.detach(op.source)
            return ReplayEffect(cleared=(op.source,)) if known else _NONE
        if isinstance(op, Store):
            self.store(op.source, op.parent_key, op.keys, now)
            return _NONE
        if isinstance(op, StorePairs):
            self.store_pairs(op.source, op.parent_keys, op.keys, now)
            return _NONE
        if isinstance(op, Remove):
            dropped = self.remove(op.source, op.keys)
            return ReplayEffect(removed=((op.source, dropped),)) if dropped.size else _NONE
        if isinstance(op, Clear):
            self.clear(op.source)
            return ReplayEffect(cleared=(op.source,))
        return ReplayEffect(removed=tuple(self.evict_keys(op.domain, op.keys).dropped))


def _extend_by_tiers(tree: RadixHashTree, keys: Keys,
                     roster: list[tuple[int, Source, Place]], counts: list[int],
                     out: list[SourceMatch]) -> None:
    """Replace each offload source's own count in ``out`` (parallel to ``roster``) by the
    blocks it adds after its rank's device prefix."""
    device: dict[tuple[str, int], int] = {}
    groups: dict[tuple[str, int], list[int]] = {}
    for i, (bit, source, place) in enumerate(roster):
        rank = (source.worker_id, source.dp_rank)
        if source.tier is Tier.DEVICE:
            device[rank] = counts[bit]
        elif source.tier in OFFLOAD_TIERS:
            if place.state is LedgerState.READY:
                groups.setdefault(rank, []).append(i)
            else:
                out[i] = SourceMatch(source, 0, place.state)
    members = [i for group in groups.values() for i in group]
    if not members:
        return
    held = tree.held_columns(keys, [roster[i][0] for i in members])
    column = {i: j for j, i in enumerate(members)}
    for rank, group in groups.items():
        cols = held[:, [column[i] for i in group]]
        added = continuation(device.get(rank, 0), cols, [roster[i][1].tier for i in group])
        for i, blocks in zip(group, added, strict=True):
            out[i] = SourceMatch(roster[i][1], blocks, roster[i][2].state)


@dataclass(frozen=True, slots=True)
class ReplayEffect:
    """What one replayed record took away: blocks per source, and sources that lost
    everything or their READY state."""

    removed: tuple[tuple[Source, npt.NDArray[np.uint64]], ...] = ()
    cleared: tuple[Source, ...] = ()


_NONE = ReplayEffect()
