"""The replay vocabulary of a :class:`~cortex.ingest.tracker.SourceTracker`: the commands it
gives its socket shell, why a replay runs and how it ended (pure)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

__all__ = ["AbortReplay", "Command", "Replay", "ReplayKind", "ReplayOutcome", "StartReplay"]


@dataclass(frozen=True, slots=True)
class StartReplay:
    """Ask the replay endpoint for every buffered batch with ``seq >= start_seq``."""

    start_seq: int


@dataclass(frozen=True, slots=True)
class AbortReplay:
    """Forget the running replay: replies still in flight must not reach the tracker."""


Command = StartReplay | AbortReplay


class ReplayKind(StrEnum):
    """Why a replay was asked for (a metric label)."""

    INITIAL = "initial"  # first connection: recover what the engine's buffer holds
    GAP = "gap"  # a seq gap in the live stream
    RECONNECT = "reconnect"  # the PUB connection broke and came back
    RESTART = "restart"  # a new publisher: read it from seq 0


class ReplayOutcome(StrEnum):
    OK = "ok"  # every missing batch arrived
    INCOMPLETE = "incomplete"  # batches were lost for good: the ledger was reset


@dataclass(slots=True)
class Replay:
    """A running replay: from ``start``, ``until`` the last seq needed, and why."""

    start: int
    until: int | None  # last seq that must arrive to close the gap; None: whatever is left
    kind: ReplayKind
    hole: bool = False  # a reset happened because the replay skipped batches
