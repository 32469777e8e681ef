"""Per-source sequencing: which ledger updates the index may apply, and in which state a
source is.

Rules (the proto's ``LedgerUpdate`` contract), per source with last applied ``(epoch, seq)``:

* a ``Snapshot`` starts or replaces an epoch: applied when its epoch is higher, or equal with a
  higher seq;
* any other update applies only at ``seq == last + 1`` of the same epoch;
* ``seq <= last`` in the same epoch is a duplicate (ignored); a lower epoch is stale
  (rejected);
* a seq gap, a higher epoch without a snapshot, an unknown source, or a domain change without a
  snapshot leave the source *awaiting a snapshot*: it reports ``SYNCING``, its updates are
  dropped and ingest is asked (again after ``resync_retry_s``) for a snapshot;
* removal (``RemoveSource`` / ``SetState(REMOVED)``) of the current or a newer epoch applies
  even out of order: forgetting can only under-estimate. The removed source is kept as a
  tombstone so late duplicates stay duplicates; at most ``max_tombstones`` are kept.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import Enum

from cortex.hashing import HashDomain
from cortex.ledger.model import (
    LedgerState,
    LedgerUpdate,
    RemoveSource,
    SetState,
    Snapshot,
    Source,
)

__all__ = ["Admission", "Ledger", "SourceRecord", "Verdict", "is_removal"]

NOTHING_APPLIED = -1
"""``SourceRecord.seq`` before any update of the epoch was applied."""


class Verdict(Enum):
    """What to do with one update."""

    APPLY = "apply"
    DUPLICATE = "duplicate"
    STALE = "stale"
    RESYNC = "resync"  # cannot apply in order: dropped, the source needs a snapshot


@dataclass(frozen=True, slots=True)
class Admission:
    """The verdict on one update and its side effects the caller must carry out.

    ``discard`` -- drop the source's blocks (its old epoch or domain is dead);
    ``left_ready`` -- the source stopped being READY (announce it on the change feed);
    ``request_resync`` -- list the source in this batch's ``SyncReply.resync``.
    """

    verdict: Verdict
    discard: bool = False
    left_ready: bool = False
    request_resync: bool = False


@dataclass(slots=True)
class SourceRecord:
    """What the index knows about one source's ledger."""

    source: Source
    domain: HashDomain
    epoch: int = 0
    seq: int = NOTHING_APPLIED
    state: LedgerState = LedgerState.SYNCING  # as reported by ingest
    reason: str = ""
    awaiting_snapshot: bool = True
    removed: bool = False
    updated_unix_s: float = 0.0
    resync_requested_s: float | None = field(default=None, repr=False)

    @property
    def effective_state(self) -> LedgerState:
        """The state routers see: REMOVED, SYNCING while awaiting a snapshot, else reported."""
        if self.removed:
            return LedgerState.REMOVED
        if self.awaiting_snapshot:
            return LedgerState.SYNCING
        return self.state


def is_removal(update: LedgerUpdate) -> bool:
    op = update.op
    return isinstance(op, RemoveSource) or (
        isinstance(op, SetState) and op.state is LedgerState.REMOVED
    )


class Ledger:
    """Records of every known source and the sequencing state machine (pure, no I/O).

    ``admit`` decides and updates the record's sequencing fields; the caller then applies the
    op to the tree and calls ``applied`` / ``removed`` / ``failed`` to finish the transition.
    ``now_s`` arguments are wall-clock seconds (Unix time).
    """

    def __init__(self, *, resync_retry_s: float = 5.0, max_tombstones: int = 4096) -> None:
        if resync_retry_s < 0 or max_tombstones < 0:
            raise ValueError("resync_retry_s and max_tombstones must be >= 0")
        self.resync_retry_s = resync_retry_s
        self.max_tombstones = max_tombstones
        self._records: dict[Source, SourceRecord] = {}
        self._tombstones: OrderedDict[Source, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self) -> Iterator[SourceRecord]:
        return iter(self._records.values())

    def get(self, source: Source) -> SourceRecord | None:
        return self._records.get(source)

    def __repr__(self) -> str:
        awaiting = sum(1 for r in self._records.values() if r.awaiting_snapshot and not r.removed)
        return (
            f"Ledger(sources={len(self._records)}, tombstones={len(self._tombstones)}, "
            f"awaiting_snapshot={awaiting})"
        )

    # ---- decisions ------------------------------------------------------------------------

    def admit(self, update: LedgerUpdate, now_s: float) -> Admission:
        """Decide on ``update`` and advance the record's ``(epoch, seq)`` when it applies."""
        rec = self._records.get(update.source)
        removal = is_removal(update)
        snapshot = isinstance(update.op, Snapshot)
        if rec is None:
            rec = SourceRecord(update.source, update.domain, epoch=update.epoch,
                               updated_unix_s=now_s)
            self._records[update.source] = rec
            if snapshot or removal:
                return self._advance(rec, update)
            return self._await(rec, now_s, left_ready=False)
        if update.epoch < rec.epoch:
            return Admission(Verdict.STALE)
        duplicate = update.epoch == rec.epoch and update.seq <= rec.seq
        if snapshot or removal:
            if duplicate:
                return Admission(Verdict.DUPLICATE)
            was_ready = rec.effective_state is LedgerState.READY
            admission = self._advance(rec, update)
            return Admission(admission.verdict, left_ready=was_ready)
        if duplicate:
            return Admission(Verdict.DUPLICATE)
        if rec.removed:
            self._revive(rec, update)
            return self._await(rec, now_s, left_ready=False)
        if update.epoch > rec.epoch or update.domain != rec.domain:
            # the old epoch (or domain) is dead and nothing re-establishes the ledger
            was_ready = rec.effective_state is LedgerState.READY
            rec.epoch, rec.seq = update.epoch, NOTHING_APPLIED
            admission = self._await(rec, now_s, left_ready=was_ready, discard=True)
            rec.domain = update.domain
            return admission
        if rec.awaiting_snapshot:
            return self._await(rec, now_s, left_ready=False)
        if update.seq > rec.seq + 1:
            return self._await(rec, now_s, left_ready=rec.state is LedgerState.READY)
        rec.seq = update.seq
        rec.updated_unix_s = now_s
        return Admission(Verdict.APPLY)

    def _advance(self, rec: SourceRecord, update: LedgerUpdate) -> Admission:
        rec.epoch, rec.seq = update.epoch, update.seq
        return Admission(Verdict.APPLY)

    def _await(
        self, rec: SourceRecord, now_s: float, *, left_ready: bool, discard: bool = False
    ) -> Admission:
        first = not rec.awaiting_snapshot
        rec.awaiting_snapshot = True
        due = (
            first
            or rec.resync_requested_s is None
            or now_s - rec.resync_requested_s >= self.resync_retry_s
        )
        if due:
            rec.resync_requested_s = now_s
        rec.updated_unix_s = now_s
        return Admission(Verdict.RESYNC, discard=discard, left_ready=left_ready,
                         request_resync=due)

    def _revive(self, rec: SourceRecord, update: LedgerUpdate) -> None:
        self._tombstones.pop(rec.source, None)
        rec.removed = False
        rec.state = LedgerState.SYNCING
        rec.domain = update.domain
        if update.epoch > rec.epoch:
            rec.epoch, rec.seq = update.epoch, NOTHING_APPLIED
        rec.resync_requested_s = None

    # ---- transitions after the op ran -------------------------------------------------------

    def snapshot_applied(
        self, source: Source, domain: HashDomain, state: LedgerState, reason: str, now_s: float
    ) -> None:
        """A snapshot replaced the source's ledger: it is in sync again."""
        rec = self._records[source]
        self._tombstones.pop(source, None)
        rec.domain = domain
        rec.removed = False
        rec.awaiting_snapshot = False
        rec.resync_requested_s = None
        rec.state = state
        rec.reason = reason
        rec.updated_unix_s = now_s

    def set_state(self, source: Source, state: LedgerState, reason: str, now_s: float) -> None:
        rec = self._records[source]
        rec.state = state
        rec.reason = reason
        rec.updated_unix_s = now_s

    def removed(self, source: Source, reason: str, now_s: float) -> None:
        """The source was pruned: keep a tombstone with its ``(epoch, seq)``."""
        rec = self._records[source]
        rec.removed = True
        rec.awaiting_snapshot = True  # nothing but a snapshot brings it back
        rec.state = LedgerState.REMOVED
        rec.reason = reason
        rec.updated_unix_s = now_s
        self._tombstones[source] = None
        self._tombstones.move_to_end(source)
        while len(self._tombstones) > self.max_tombstones:
            old, _ = self._tombstones.popitem(last=False)
            self._records.pop(old, None)

    def owner_lost(self, source: Source, reason: str, now_s: float) -> bool:
        """Nobody keeps the source's ledger true any more (its ingest is gone): it awaits a
        snapshot (reported ``SYNCING`` with ``reason``), asked for as soon as an ingest
        sends anything for it. Returns whether it was ``READY``; False for an unknown or
        removed source (nothing changes then)."""
        rec = self._records.get(source)
        if rec is None or rec.removed:
            return False
        was_ready = rec.effective_state is LedgerState.READY
        rec.awaiting_snapshot = True
        rec.resync_requested_s = None  # the next contact asks at once
        rec.reason = reason
        rec.updated_unix_s = now_s
        return was_ready

    def resync_requested(self, source: Source, now_s: float) -> bool:
        """Mark a snapshot request for ``source`` sent now; False (nothing to ask) unless it
        awaits one."""
        rec = self._records.get(source)
        if rec is None or rec.removed or not rec.awaiting_snapshot:
            return False
        rec.resync_requested_s = now_s
        return True

    def failed(
        self, source: Source, domain: HashDomain | None, reason: str, now_s: float
    ) -> Admission:
        """An update could not be applied (malformed): the source needs a snapshot."""
        rec = self._records.get(source)
        if rec is None:
            if domain is None:
                return Admission(Verdict.RESYNC)
            rec = SourceRecord(source, domain, updated_unix_s=now_s, reason=reason)
            self._records[source] = rec
            return self._await(rec, now_s, left_ready=False)
        if rec.removed:
            return Admission(Verdict.RESYNC)
        was_ready = rec.effective_state is LedgerState.READY
        rec.reason = reason
        return self._await(rec, now_s, left_ready=was_ready)
