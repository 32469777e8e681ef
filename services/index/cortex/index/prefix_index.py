"""The index core: per-domain radix trees, the per-source ledger, the version, the change log
and the memory budget. Pure and synchronous: the gRPC shell only moves messages in and out.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from cortex.hashing import Engine, HashDomain
from cortex.index.changes import Change, ChangeLog
from cortex.index.owners import SourceOwners
from cortex.index.sequencing import Ledger, Verdict
from cortex.ledger import cores
from cortex.ledger.cores import node_bytes
from cortex.ledger.errors import InvalidArgument
from cortex.ledger.match import Match
from cortex.ledger.model import (
    INGEST_LOST,
    ClearBlocks,
    LedgerState,
    LedgerUpdate,
    RemoveBlocks,
    RemoveSource,
    SetState,
    Snapshot,
    Source,
    StoreBlocks,
)
from cortex.ledger.tree import RadixHashTree
from cortex.ledger.view import Journaled, LedgerView, WireOps

if TYPE_CHECKING:
    from cortex.ledger.native import PlannedUpdates, SyncTarget

__all__ = [
    "ApplyResult",
    "DomainStats",
    "IndexStats",
    "PrefixIndex",
    "WorkerView",
    "initial_version",
]


def initial_version(now_s: float | None = None) -> int:
    """The version a fresh process starts at: wall-clock microseconds.

    Versions then stay monotonic across index restarts (as long as fewer than a million
    changes per second are applied), so a ``since_version`` from a previous process is below
    the new process's floor and the change feed answers it with a reset.
    """
    return max(1, int((time.time() if now_s is None else now_s) * 1_000_000))


@dataclass(frozen=True, slots=True)
class ApplyResult:
    """Outcome of one update: its verdict, and whether to ask ingest for a snapshot."""

    verdict: Verdict
    request_resync: bool = False
    error: str | None = None


@dataclass(frozen=True, slots=True)
class WorkerView:
    """One source as the Workers query reports it."""

    source: Source
    domain: HashDomain
    state: LedgerState
    reason: str
    blocks: int
    epoch: int
    seq: int
    updated_unix_s: float


@dataclass(frozen=True, slots=True)
class DomainStats:
    domain: HashDomain
    blocks: int  # nodes
    holdings: int  # (node, source) pairs
    sources: int
    bytes_estimate: int
    evictions: int


@dataclass(frozen=True, slots=True)
class IndexStats:
    blocks: int
    holdings: int
    bytes_estimate: int
    bytes_budget: int
    evictions: int
    version: int
    domains: list[DomainStats]


class PrefixIndex:
    """Everything the index knows, behind four verbs: ``apply``, ``match``, ``workers``,
    ``stats`` (plus ``changes`` for the feed and ``journal`` for replicas).

    What routers see is a :class:`LedgerView` (``view``): the sequencing records of
    :class:`Ledger` decide, and every record change is published to the view (a source's
    place and effective state), so a replica fed the view's journal answers Match alike.

    ``memory_budget_bytes`` (0 = unbounded) is enforced after every store: when the estimate
    exceeds it, least-recently-matched leaves are evicted (globally across domains) until the
    estimate is at ``low_watermark * budget``. Evictions are logged as removals, so gateway
    caches drop them too. ``max_query_blocks`` / ``max_query_tokens`` bound one Match.
    """

    def __init__(
        self,
        *,
        memory_budget_bytes: int = 0,
        low_watermark: float = 0.95,
        max_query_blocks: int = 1 << 16,
        max_query_tokens: int = 1 << 22,
        changes_max_keys: int = 1 << 20,
        changes_max_records: int = 1 << 16,
        resync_retry_s: float = 5.0,
        max_tombstones: int = 4096,
        ingest_grace_s: float = 0.0,
        start_version: int | None = None,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        if memory_budget_bytes < 0:
            raise ValueError("memory_budget_bytes must be >= 0")
        if not 0.0 < low_watermark <= 1.0:
            raise ValueError("low_watermark must be in (0, 1]")
        self.memory_budget_bytes = memory_budget_bytes
        self.low_watermark = low_watermark
        self.max_query_blocks = max_query_blocks
        self.max_query_tokens = max_query_tokens
        self._wall = wall_clock
        self.version = initial_version(wall_clock()) if start_version is None else start_version
        self.ledger = Ledger(resync_retry_s=resync_retry_s, max_tombstones=max_tombstones)
        self.owners = SourceOwners(ingest_grace_s)
        self.changes = ChangeLog(self.version, max_keys=changes_max_keys,
                                 max_records=changes_max_records)
        self.view = LedgerView()
        self._tick = 0  # recency clock: one tick per store or match
        self.evictions = 0
        self.eviction_passes = 0
        self.eviction_seconds = 0.0

    def __repr__(self) -> str:
        return (
            f"PrefixIndex(version={self.version}, domains={len(self.trees)}, "
            f"blocks={sum(t.nodes for t in self.trees.values())}, "
            f"bytes={self.bytes_estimate}, budget={self.memory_budget_bytes}, "
            f"evictions={self.evictions}, {self.ledger!r})"
        )

    @property
    def trees(self) -> dict[HashDomain, RadixHashTree]:
        return self.view.trees

    @property
    def bytes_estimate(self) -> int:
        return self.view.bytes_estimate

    # ---- the replica journal ---------------------------------------------------------------

    def start_journal(self) -> None:
        """Record every change of the view from now on (replicas are subscribed)."""
        if self.view.journal is None:
            self.view.journal = []

    def stop_journal(self) -> None:
        self.view.journal = None

    def take_journal(self) -> list[Journaled]:
        """The changes recorded since the last call (empty when not journaling)."""
        journal = self.view.journal
        if not journal:
            return []
        self.view.journal = []
        return journal

    def touch(self, domain: HashDomain, keys: Sequence[int]) -> int:
        """A replica matched ``keys`` (deepest blocks): they count as recently matched for
        the memory budget. Returns how many exist."""
        tree = self.view.trees.get(domain)
        if tree is None:
            return 0
        self._tick += 1
        return tree.touch(keys, self._tick)

    # ---- domains ---------------------------------------------------------------------------

    def resolve_domain(
        self, model: str, block_size: int = 0, engine: Engine | None = None
    ) -> HashDomain | None:
        """The model's domain, narrowed by ``block_size`` (0 = any) and ``engine`` (None = any).

        None when no domain fits; :class:`InvalidArgument` when several do.
        """
        return self.view.resolve_domain(model, block_size, engine)

    def _publish(self, source: Source) -> None:
        """Make the view show the source's record: its domain and effective state, or
        nothing once it is removed (or forgotten)."""
        rec = self.ledger.get(source)
        if rec is None or rec.removed:
            self.view.detach(source)
        else:
            self.view.attach(source, rec.domain, rec.effective_state, rec.reason)

    # ---- updates ---------------------------------------------------------------------------

    def _bump(self) -> int:
        self.version += 1
        return self.version

    def _log_cleared(self, domain: HashDomain, source: Source) -> None:
        self.changes.append(Change(self.version, domain, source))

    def apply(self, update: LedgerUpdate, ingest_id: str | None = None) -> ApplyResult:
        """Sequence and apply one ledger update (see :mod:`cortex.index.sequencing` for the rules).

        Never raises for a bad op: a malformed update leaves its source awaiting a snapshot
        and comes back as ``RESYNC`` with ``error`` set. ``ingest_id`` (the sender; None: not
        tracked) becomes the source's owner when the update applies (see :mod:`owners`).
        """
        now = self._wall()
        source = update.source
        place = self.view.places.get(source)
        old_domain = place.domain if place is not None else None
        admission = self.ledger.admit(update, now)
        verdict = admission.verdict
        if verdict is Verdict.DUPLICATE or verdict is Verdict.STALE:
            return ApplyResult(verdict)
        if verdict is Verdict.RESYNC:
            rec = self.ledger.get(source)
            assert rec is not None
            changed = admission.left_ready
            if admission.discard and self.view.blocks_of(source):
                self.view.clear(source)
                changed = True
            self._publish(source)
            if changed:
                self._bump()
                self._log_cleared(old_domain or rec.domain, source)
            return ApplyResult(verdict, admission.request_resync)
        try:
            self._apply_op(update, old_domain, admission.left_ready, now)
        except InvalidArgument as exc:
            failed = self.ledger.failed(source, update.domain, str(exc), now)
            self._publish(source)
            self._bump()
            self._log_cleared(update.domain, source)
            return ApplyResult(Verdict.RESYNC, failed.request_resync, str(exc))
        self._publish(source)
        if ingest_id is not None:
            rec = self.ledger.get(source)
            if rec is None or rec.removed:
                self.owners.release(source)
            else:
                self.owners.claim(source, ingest_id)
        return ApplyResult(Verdict.APPLY)

    def apply_planned(self, planned: PlannedUpdates, start: int,
                      sources: Sequence[Source | None], domains: Sequence[HashDomain | None],
                      ingest_id: str | None = None) -> tuple[int, int, int]:
        """Apply the planned updates from ``start`` that are in-order stores and removals of
        in-sync sources in one call of the compiled core: what :meth:`apply` does to each
        (sequencing, tree, version, change log, journal, owner, memory budget), without a
        Python object per update. ``sources`` / ``domains`` are the plan's ``Source`` /
        ``Domain`` messages decoded (None: invalid). Returns ``(stop, stores, removes)``:
        the first update left to :meth:`apply` (``planned.count`` when none), and the
        updates applied; the caller applies update ``stop`` (unless a store filled the
        memory budget: then ``stop`` follows it and nothing is left to the caller) and
        calls again."""
        targets = self._sync_targets(sources, domains)
        if not any(targets):
            return start, 0, 0
        budget = self.memory_budget_bytes
        headroom = budget - self.bytes_estimate if budget else 1 << 62
        journal = self.view.journal
        run = planned.apply(start, targets, self._tick, headroom, journal is not None)
        applied = run.stores + run.removes
        if not applied:
            return start, 0, 0
        first = self.version + 1 - start  # the version update i took
        self.version += applied
        self._tick = run.tick
        ledger, owners = self.ledger, self.owners
        for at, si, keys in run.removed:
            rec = ledger.get(sources[si])  # type: ignore[arg-type]  # targets were valid
            assert rec is not None
            self.changes.append(Change(first + at, rec.domain, rec.source, keys))
        if journal is not None:
            for di, data in run.journal:
                domain = domains[di]
                assert domain is not None
                journal.append((domain.model, WireOps(data)))
        now = self._wall()
        for si, seq in run.seqs:
            source = sources[si]
            assert source is not None
            rec = ledger.get(source)
            assert rec is not None
            rec.seq = seq
            rec.updated_unix_s = now
            if ingest_id is not None:
                owners.claim(source, ingest_id)
        if run.stores:
            self._enforce_budget()
        return run.stop, run.stores, run.removes

    def _sync_targets(self, sources: Sequence[Source | None],
                      domains: Sequence[HashDomain | None]) -> list[SyncTarget | None]:
        """Per planned source, what its updates apply to when it is in sync and placed in
        its record's domain (None: :meth:`apply` decides)."""
        index_of: dict[HashDomain, int] = {}
        for i, domain in enumerate(domains):
            if domain is not None:
                index_of.setdefault(domain, i)
        record, places, trees = self.ledger.get, self.view.places, self.view.trees
        target = cores.sync_target
        out: list[SyncTarget | None] = []
        for source in sources:
            rec = None if source is None else record(source)
            if rec is None or rec.removed or rec.awaiting_snapshot or rec.epoch >= 1 << 63 \
                    or rec.seq >= 1 << 63:
                out.append(None)
                continue
            place = places.get(rec.source)
            at = index_of.get(rec.domain)
            if place is None or at is None or place.domain != rec.domain:
                out.append(None)
                continue
            out.append(target(trees[rec.domain], rec.source, at, rec.epoch, rec.seq))
        return out

    # ---- ingest liveness -------------------------------------------------------------------

    def ingest_heard(self, ingest_id: str, now_s: float) -> list[Source]:
        """A Sync batch from ``ingest_id`` arrived (or one of its streams ended) at ``now_s``
        (monotonic s). Returns the sources it owns that were demoted while it was lost: ask
        it for snapshots of those still owed after its batch (:meth:`snapshots_owed`)."""
        return sorted(self.owners.heard(ingest_id, now_s))

    def snapshots_owed(self, sources: Iterable[Source]) -> list[Source]:
        """The ``sources`` still awaiting a snapshot, each marked as asked for now."""
        wall = self._wall()
        return [s for s in sources if self.ledger.resync_requested(s, wall)]

    def expire_ingests(self, now_s: float) -> list[tuple[str, list[Source]]]:
        """Demote the sources of every ingest silent for longer than the grace at ``now_s``
        (monotonic s): each awaits a snapshot (``SYNCING``, reason ``ingest_lost``), its
        blocks are dropped (no credit, no memory held for a ledger nobody updates) and, if it
        was READY or held blocks, it is announced on the change feed. Returns the newly lost
        ingests with the sources demoted."""
        out: list[tuple[str, list[Source]]] = []
        wall = self._wall()
        for ingest_id, sources in self.owners.expire(now_s):
            demoted: list[Source] = []
            for source in sources:
                rec = self.ledger.get(source)
                if rec is None or rec.removed:
                    continue
                was_ready = self.ledger.owner_lost(source, INGEST_LOST, wall)
                held = self.view.blocks_of(source)
                if held:
                    self.view.clear(source)
                self._publish(source)
                self._bump()
                if was_ready or held:
                    self._log_cleared(rec.domain, source)
                demoted.append(source)
            out.append((ingest_id, demoted))
        return out

    def reject(
        self, source: Source, domain: HashDomain | None, reason: str
    ) -> ApplyResult:
        """An update too malformed to sequence: its source (if known) needs a snapshot."""
        now = self._wall()
        prior = self.ledger.get(source)
        was_ready = prior is not None and prior.effective_state is LedgerState.READY
        admission = self.ledger.failed(source, domain, reason, now)
        self._publish(source)
        rec = self.ledger.get(source)
        if rec is not None and not rec.removed and was_ready:
            self._bump()
            self._log_cleared(rec.domain, source)
        return ApplyResult(Verdict.RESYNC, admission.request_resync, reason)

    def _apply_op(
        self,
        update: LedgerUpdate,
        old_domain: HashDomain | None,
        left_ready: bool,
        now: float,
    ) -> None:
        source, domain, op = update.source, update.domain, update.op
        view = self.view
        if isinstance(op, RemoveSource) or (
            isinstance(op, SetState) and op.state is LedgerState.REMOVED
        ):
            view.detach(source)
            self.ledger.removed(source, op.reason, now)
            self._bump()
            if old_domain is not None:
                self._log_cleared(old_domain, source)
            return
        if isinstance(op, Snapshot):
            # into the snapshot's domain (blocks of another are dropped), empty, until applied
            was_held = view.blocks_of(source)
            view.attach(source, domain, LedgerState.SYNCING, op.reason)
            view.clear(source, replaced=True)
            self._bump()
            if was_held or left_ready:
                self._log_cleared(old_domain or domain, source)
            self._tick += 1
            view.store_pairs(source, op.parent_keys, op.keys, self._tick)
            self.ledger.snapshot_applied(source, domain, op.state, op.reason, now)
            self._enforce_budget()
        elif isinstance(op, StoreBlocks):
            self._tick += 1
            view.store(source, op.parent_key, op.keys, self._tick)
            self._bump()
            self._enforce_budget()
        elif isinstance(op, RemoveBlocks):
            dropped = view.remove(source, op.keys)
            self._bump()
            if dropped.size:
                self.changes.append(Change(self.version, domain, source, dropped))
        elif isinstance(op, ClearBlocks):
            view.clear(source)
            self._bump()
            self._log_cleared(domain, source)
        else:
            assert isinstance(op, SetState)
            if op.state is LedgerState.UNSPECIFIED:
                raise InvalidArgument("SetState.state is unspecified")
            self.ledger.set_state(source, op.state, op.reason, now)
            self._bump()
            if left_ready or op.state is not LedgerState.READY:
                self._log_cleared(domain, source)

    # ---- memory budget --------------------------------------------------------------------

    def _enforce_budget(self) -> int:
        """Evict least-recently-matched subtrees until the estimate is at the low watermark.

        A pass picks the recency cutoff that covers the excess (one partition over every
        live node of every tree, so the LRU order is global across domains) and evicts each
        node whose whole subtree is that old: leaves first, inner nodes with their last
        child. Returns the blocks evicted.
        """
        budget = self.memory_budget_bytes
        if not budget or self.bytes_estimate <= budget:
            return 0
        started = time.perf_counter()
        target = int(budget * self.low_watermark)
        version = self._bump()
        self.eviction_passes += 1
        evicted = 0
        widen = 1
        for _ in range(16):
            excess = self.bytes_estimate - target
            if excess <= 0 or not self.trees:
                break
            per_node = min(node_bytes(t.words) for t in self.trees.values())
            recency = np.concatenate([t.live_recency() for t in self.trees.values()])
            if not recency.size:
                break
            k = min(recency.size, math.ceil(excess / per_node) * widen) - 1
            cutoff = int(np.partition(recency, k)[k])
            round_evicted = 0
            for domain in list(self.trees):
                eviction = self.view.evict_older_than(domain, cutoff)
                round_evicted += eviction.nodes
                for source, keys in eviction.dropped:
                    self.changes.append(Change(version, domain, source, keys))
            evicted += round_evicted
            if not round_evicted:
                if k == recency.size - 1:
                    break
                widen *= 2  # young descendants protected the oldest: look further
        self.evictions += evicted
        self.eviction_seconds += time.perf_counter() - started
        return evicted

    # ---- queries ---------------------------------------------------------------------------

    def match(
        self,
        model: str,
        *,
        block_keys: Sequence[int] | None = None,
        token_ids: Sequence[int] | None = None,
        block_size: int = 0,
        engine: Engine | None = None,
        candidate_workers: Collection[str] = (),
        max_blocks: int = 0,
        lora_name: str = "",
        cache_salt: str = "",
    ) -> Match:
        """Per source of the model's domain, the consecutive leading query blocks it holds.

        ``block_keys`` (Cortex keys) win over ``token_ids`` (the index keys full blocks of
        the resolved domain, with ``lora_name`` / ``cache_salt`` root extras). ``max_blocks``
        caps matching (0 = none). Raises :class:`InvalidArgument` for an empty model, an
        ambiguous domain, or a query over ``max_query_blocks`` / ``max_query_tokens``.
        """
        if not model:
            raise InvalidArgument("model is required")
        if max_blocks < 0:
            raise InvalidArgument("max_blocks must be >= 0")
        domain = self.resolve_domain(model, block_size, engine)
        if block_keys:
            if len(block_keys) > self.max_query_blocks:
                raise InvalidArgument(
                    f"{len(block_keys)} block keys exceed the limit of {self.max_query_blocks}"
                )
            query_blocks = len(block_keys)
            keys: Sequence[int] = block_keys[:max_blocks] if max_blocks else block_keys
        elif token_ids:
            if len(token_ids) > self.max_query_tokens:
                raise InvalidArgument(
                    f"{len(token_ids)} token ids exceed the limit of {self.max_query_tokens}"
                )
            size = domain.block_size if domain is not None else block_size
            query_blocks = len(token_ids) // size if size else 0
            if domain is None:
                return Match((), self.version, query_blocks)
            if max_blocks:
                token_ids = token_ids[: max_blocks * size]
            try:
                keys = domain.keys(token_ids, lora_name or None, cache_salt or None)
            except ValueError as exc:
                raise InvalidArgument(str(exc)) from exc
        else:
            query_blocks, keys = 0, []
        if domain is None:
            return Match((), self.version, query_blocks)
        self._tick += 1
        wanted = set(candidate_workers) if candidate_workers else ()
        matches = self.view.match(domain, keys, self._tick, wanted)
        return Match.of(matches, self.version, query_blocks, domain,
                        shared_tier=self.view.has_shared_tier(domain))

    def workers(self, model: str = "") -> list[WorkerView]:
        """Every known source (tombstones included) of ``model`` (empty = all models)."""
        out: list[WorkerView] = []
        for rec in self.ledger:
            if model and rec.domain.model != model:
                continue
            out.append(
                WorkerView(
                    source=rec.source,
                    domain=rec.domain,
                    state=rec.effective_state,
                    reason=rec.reason,
                    blocks=self.view.blocks_of(rec.source),
                    epoch=rec.epoch,
                    seq=max(rec.seq, 0),
                    updated_unix_s=rec.updated_unix_s,
                )
            )
        out.sort(key=lambda w: (w.domain.model, w.source))
        return out

    def stats(self) -> IndexStats:
        domains = [
            DomainStats(
                domain=domain,
                blocks=tree.nodes,
                holdings=tree.holdings,
                sources=len(tree.sources),
                bytes_estimate=tree.bytes_estimate,
                evictions=tree.evicted,
            )
            for domain, tree in self.trees.items()
        ]
        return IndexStats(
            blocks=sum(d.blocks for d in domains),
            holdings=sum(d.holdings for d in domains),
            bytes_estimate=sum(d.bytes_estimate for d in domains),
            bytes_budget=self.memory_budget_bytes,
            evictions=self.evictions,
            version=self.version,
            domains=domains,
        )
