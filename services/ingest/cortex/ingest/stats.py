"""``SourceStats``: the plain counters of one source, read by the metrics collector."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["SourceStats", "bump"]


@dataclass(slots=True)
class SourceStats:
    """Plain counters, read by the metrics collector at scrape time (no hot-path cost)."""

    messages: int = 0  # live messages received
    replayed: int = 0  # replay messages received
    batches: int = 0  # batches applied
    duplicates: int = 0
    decode_errors: int = 0
    unknown_events: int = 0  # event tags the codec does not know
    events: dict[str, int] = field(default_factory=dict)  # by event type
    blocks: dict[str, int] = field(default_factory=dict)  # "stored" / "removed"
    gaps: int = 0
    seq_resets: int = 0
    replays: dict[tuple[str, str], int] = field(default_factory=dict)  # (kind, outcome)
    clears: dict[str, int] = field(default_factory=dict)  # by reason
    dropped_batches: dict[str, int] = field(default_factory=dict)  # held, given up; by reason
    unknown_parent_blocks: int = 0
    unknown_removed_blocks: int = 0
    ignored_blocks: dict[str, int] = field(default_factory=dict)  # by reason
    alignment_checks: int = 0
    alignment_mismatches: dict[str, int] = field(default_factory=dict)  # by cause
    transitions: dict[tuple[str, str], int] = field(default_factory=dict)
    rank_mismatches: int = 0
    last_batch_ts: float | None = None
    last_lag_s: float | None = None
    last_applied_unix_s: float | None = None  # wall clock when the last batch was applied


def bump(counter: dict[str, int], key: str, amount: int = 1) -> None:
    counter[key] = counter.get(key, 0) + amount
