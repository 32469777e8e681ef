"""Every Prometheus metric of the ingest service (prefix ``cortex_ingest_``), in one place.

Per-source counters live as plain ints in each tracker's :class:`SourceStats` and are turned
into metric families at scrape time by :class:`IngestCollector`: the event hot path pays
nothing for metrics, and a worker that leaves takes its series with it. Each service instance
has its own ``CollectorRegistry`` (several can run in one test process).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from cortex.ingest.forwarder import IndexForwarder
from cortex.ingest.ops import SourceId
from cortex.ingest.source import SourceRunner
from cortex.ledger.model import LedgerState

__all__ = ["CONTENT_TYPE", "METRIC_NAMES", "IngestMetrics", "IngestStats"]

CONTENT_TYPE = CONTENT_TYPE_LATEST

P = "cortex_ingest_"

# name -> help; the collector below emits exactly these (plus the lag histogram).
METRIC_NAMES: dict[str, str] = {
    # per source (labels: worker, dp_rank, ...)
    f"{P}messages": "Messages received, by path (live / replay).",
    f"{P}batches": "Event batches applied to the ledger.",
    f"{P}events": "Events applied, by type.",
    f"{P}blocks": "Blocks in applied events, by op (stored / removed).",
    f"{P}duplicates": "Duplicate batches dropped.",
    f"{P}gaps": "Seq gaps detected in the live stream.",
    f"{P}seq_resets": "Publisher restarts detected (seq went back).",
    f"{P}replays": "Replays finished, by kind and outcome (ok / incomplete).",
    f"{P}clears": "Ledger clears, by reason.",
    f"{P}unknown_parent_blocks": "Stored blocks not placed: their parent is unknown.",
    f"{P}unknown_removed_blocks": "Removed blocks that were not in the ledger.",
    f"{P}ignored_blocks": "Stored/removed blocks not placed in any tier's ledger, by reason.",
    f"{P}decode_errors": "Payloads that failed to decode.",
    f"{P}bad_frames": "Malformed ZMQ messages (not [topic, seq, payload] / replay replies).",
    f"{P}unknown_events": "Events with a tag the codec does not know (skipped).",
    f"{P}alignment_checks": "Stored events whose engine hashes were recomputed.",
    f"{P}alignment_mismatches": "Alignment mismatches, by likely cause.",
    f"{P}state_transitions": "Ledger state transitions, by from / to.",
    f"{P}source_state": "Ledger state of each source (1 for the current state).",
    f"{P}ledger_blocks": "Blocks in each source's ledger (device memory).",
    f"{P}tier_blocks": "Blocks in each source's ledger per tier (device, host, disk, shared).",
    f"{P}source_lag_seconds": "Now minus the timestamp of the source's last applied batch.",
    f"{P}pending_batches": "Live batches held (while a replay runs, or waiting for a turn).",
    f"{P}held_bytes": "Payload bytes of the live batches the source holds.",
    f"{P}backlog_seconds": "Age of the oldest batch received and not applied yet (0: none).",
    f"{P}dropped_batches": "Held batches given up at a bound (ledger reset), by reason.",
    f"{P}source_disconnects": "Event-socket disconnects (also: a message over the size limit).",
    f"{P}last_applied_timestamp_seconds": "Unix time the source's last batch was applied.",
    f"{P}last_batch_timestamp_seconds": "The engine's own timestamp of the source's last "
                                        "applied batch (compare with the publisher's stamps).",
    f"{P}source_connected": "1 while the source's event socket is connected.",
    f"{P}source_block_bound": "Most blocks the source may be credited with (its worker's "
                              "reported capacity with the margin and tiers; 0: no bound).",
    f"{P}source_over_capacity": "1 while the source is misbehaving: it stored past its "
                                "bound (the excess refused; until the bound is read again).",
    # per index replica (label: index)
    f"{P}index_up": "1 while the Sync stream to the index replica is open.",
    f"{P}index_idle": "1 while the Sync stream is open with nothing left to send or "
                      "acknowledge (every applied batch is in the index replica; a quiet "
                      "batch is acknowledged by the next reply, a heartbeat's at the latest).",
    f"{P}index_queue_depth": "Updates waiting to be sent to the index replica.",
    f"{P}index_batches": "UpdateBatches sent to the index replica.",
    f"{P}index_updates": "LedgerUpdates sent to the index replica.",
    f"{P}index_bytes": "Bytes of UpdateBatches sent to the index replica.",
    f"{P}index_acked_batches": "Batches the replica acknowledged on the current stream.",
    f"{P}index_connects": "Sync streams opened to the index replica.",
    f"{P}index_failures": "Failed connects or broken streams.",
    f"{P}index_overflows": "Times the send queue was full (the source is re-sent as a snapshot).",
    f"{P}index_snapshots": "Source snapshots sent.",
    f"{P}index_resync_requests": "Sources the replica asked to resync.",
    f"{P}index_heartbeats": "Empty batches sent on an idle Sync stream (liveness).",
    f"{P}index_queue_bytes": "Bytes of updates waiting to be sent to the index replica.",
    f"{P}index_queue_wait_seconds": "How long the oldest queued update has waited (0: none).",
    f"{P}index_epoch_floor_failures": "Streams opened without learning the replica's epochs.",
    # process
    f"{P}held_bytes_limit": "Limit on the payload bytes all sources hold together.",
    # registry
    f"{P}registry_degraded": "1 while the registry (Redis) is unreachable.",
    f"{P}registry_workers": "Workers in the last known registry.",
    f"{P}registry_invalid_entries": "Unreadable registry entries (skipped).",
    f"{P}owned_workers": "Workers this ingest shard follows.",
    # histogram
    f"{P}lag_seconds": "Now minus the batch timestamp, at apply time.",
}


def _help(name: str) -> str:
    return METRIC_NAMES[name]


def _counter(name: str, labels: list[str]) -> CounterMetricFamily:
    return CounterMetricFamily(name, _help(name), labels=labels)


def _gauge(name: str, labels: list[str]) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, _help(name), labels=labels)


@dataclass(frozen=True, slots=True)
class IngestStats:
    """What the service hands its collector at each scrape (the collector never reaches
    into the service)."""

    runners: Mapping[SourceId, SourceRunner]
    forwarders: Sequence[IndexForwarder]
    registry_degraded: bool
    registry_workers: int
    registry_invalid: int
    owned_workers: int
    held_bytes_limit: int  # bytes


class IngestCollector(Collector):
    """Reads the service's stats (trackers, runners, forwarders, watcher) at scrape time."""

    def __init__(self, stats: Callable[[], IngestStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        yield from _sources(stats.runners)
        yield from _source_states(stats.runners)
        yield from _forwarders(stats.forwarders)
        yield from _service(stats)


def _sources(runners: Mapping[SourceId, SourceRunner]) -> Iterator[Metric]:
    """Per source: its tracker's counters."""
    src = ["worker", "dp_rank"]
    messages = _counter(f"{P}messages", [*src, "path"])
    batches = _counter(f"{P}batches", src)
    events = _counter(f"{P}events", [*src, "type"])
    blocks = _counter(f"{P}blocks", [*src, "op"])
    duplicates = _counter(f"{P}duplicates", src)
    gaps = _counter(f"{P}gaps", src)
    resets = _counter(f"{P}seq_resets", src)
    replays = _counter(f"{P}replays", [*src, "kind", "outcome"])
    clears = _counter(f"{P}clears", [*src, "reason"])
    unknown_parent = _counter(f"{P}unknown_parent_blocks", src)
    unknown_removed = _counter(f"{P}unknown_removed_blocks", src)
    ignored = _counter(f"{P}ignored_blocks", [*src, "reason"])
    decode_errors = _counter(f"{P}decode_errors", src)
    bad_frames = _counter(f"{P}bad_frames", src)
    unknown_events = _counter(f"{P}unknown_events", src)
    checks = _counter(f"{P}alignment_checks", src)
    mismatches = _counter(f"{P}alignment_mismatches", [*src, "cause"])
    transitions = _counter(f"{P}state_transitions", [*src, "from", "to"])
    for source, runner in runners.items():
        t = runner.tracker
        s = t.stats
        lv = [source.worker_id, str(source.dp_rank)]
        messages.add_metric([*lv, "live"], s.messages)
        messages.add_metric([*lv, "replay"], s.replayed)
        batches.add_metric(lv, s.batches)
        for kind, value in s.events.items():
            events.add_metric([*lv, kind], value)
        for op, value in s.blocks.items():
            blocks.add_metric([*lv, op], value)
        duplicates.add_metric(lv, s.duplicates)
        gaps.add_metric(lv, s.gaps)
        resets.add_metric(lv, s.seq_resets)
        for (kind, outcome), value in s.replays.items():
            replays.add_metric([*lv, kind, outcome], value)
        for reason, value in s.clears.items():
            clears.add_metric([*lv, reason], value)
        unknown_parent.add_metric(lv, s.unknown_parent_blocks)
        unknown_removed.add_metric(lv, s.unknown_removed_blocks)
        for reason, value in s.ignored_blocks.items():
            ignored.add_metric([*lv, reason], value)
        decode_errors.add_metric(lv, s.decode_errors)
        bad_frames.add_metric(lv, runner.bad_frames)
        unknown_events.add_metric(lv, s.unknown_events)
        checks.add_metric(lv, s.alignment_checks)
        for cause, value in s.alignment_mismatches.items():
            mismatches.add_metric([*lv, cause], value)
        for (old, new), value in s.transitions.items():
            transitions.add_metric([*lv, old, new], value)
    yield from (
        messages, batches, events, blocks, duplicates, gaps, resets, replays, clears,
        unknown_parent, unknown_removed, ignored, decode_errors, bad_frames, unknown_events,
        checks, mismatches, transitions,
    )


def _source_states(runners: Mapping[SourceId, SourceRunner]) -> Iterator[Metric]:
    """Per source: its state, what it holds and how far behind it is, its connection."""
    src = ["worker", "dp_rank"]
    batches = _counter(f"{P}batches", src)
    blocks = _counter(f"{P}blocks", [*src, "op"])
    state = _gauge(f"{P}source_state", [*src, "state"])
    ledger_blocks = _gauge(f"{P}ledger_blocks", src)
    tier_blocks = _gauge(f"{P}tier_blocks", [*src, "tier"])
    lag = _gauge(f"{P}source_lag_seconds", src)
    pending = _gauge(f"{P}pending_batches", src)
    held = _gauge(f"{P}held_bytes", src)
    backlog = _gauge(f"{P}backlog_seconds", src)
    dropped = _counter(f"{P}dropped_batches", [*src, "reason"])
    disconnects = _counter(f"{P}source_disconnects", src)
    applied_at = _gauge(f"{P}last_applied_timestamp_seconds", src)
    stamped = _gauge(f"{P}last_batch_timestamp_seconds", src)
    connected = _gauge(f"{P}source_connected", src)
    block_bound = _gauge(f"{P}source_block_bound", src)
    over_capacity = _gauge(f"{P}source_over_capacity", src)
    now = time.time()
    for source, runner in runners.items():
        t = runner.tracker
        s = t.stats
        lv = [source.worker_id, str(source.dp_rank)]
        for candidate in LedgerState:
            if candidate is not LedgerState.UNSPECIFIED:
                state.add_metric([*lv, candidate.name], 1.0 if t.state is candidate else 0.0)
        ledger_blocks.add_metric(lv, len(t.ledger))
        for tier, tier_ledger in t.keymap.ledgers.items():
            tier_blocks.add_metric([*lv, tier.label], len(tier_ledger))
        if s.last_lag_s is not None:
            lag.add_metric(lv, s.last_lag_s)
        pending.add_metric(lv, t.pending)
        held.add_metric(lv, t.held_bytes)
        oldest = t.oldest_held_at
        backlog.add_metric(lv, 0.0 if oldest is None else max(0.0, now - oldest))
        for reason, value in s.dropped_batches.items():
            dropped.add_metric([*lv, reason], value)
        disconnects.add_metric(lv, runner.disconnects)
        if s.last_applied_unix_s is not None:
            applied_at.add_metric(lv, s.last_applied_unix_s)
        if s.last_batch_ts is not None:
            stamped.add_metric(lv, s.last_batch_ts)
        connected.add_metric(lv, 1.0 if runner.connected else 0.0)
        block_bound.add_metric(lv, t.max_blocks)
        over_capacity.add_metric(lv, 1.0 if t.misbehaving else 0.0)
    yield from (
        batches, blocks, state, ledger_blocks, tier_blocks, lag, pending, held, backlog,
        dropped, disconnects, applied_at, stamped, connected, block_bound, over_capacity,
    )

def _forwarders(forwarders: Sequence[IndexForwarder]) -> Iterator[Metric]:
    """Per index replica: what its forwarder sent, acknowledged and queued."""
    idx = ["index"]
    up = _gauge(f"{P}index_up", idx)
    idle = _gauge(f"{P}index_idle", idx)
    depth = _gauge(f"{P}index_queue_depth", idx)
    sent_batches = _counter(f"{P}index_batches", idx)
    sent_updates = _counter(f"{P}index_updates", idx)
    sent_bytes = _counter(f"{P}index_bytes", idx)
    acked = _gauge(f"{P}index_acked_batches", idx)
    connects = _counter(f"{P}index_connects", idx)
    failures = _counter(f"{P}index_failures", idx)
    overflows = _counter(f"{P}index_overflows", idx)
    snapshots = _counter(f"{P}index_snapshots", idx)
    resyncs = _counter(f"{P}index_resync_requests", idx)
    heartbeats = _counter(f"{P}index_heartbeats", idx)
    queue_bytes = _gauge(f"{P}index_queue_bytes", idx)
    queue_wait = _gauge(f"{P}index_queue_wait_seconds", idx)
    floor_failures = _counter(f"{P}index_epoch_floor_failures", idx)
    for f in forwarders:
        label = [str(f.target)]
        up.add_metric(label, 1.0 if f.state.value == "streaming" else 0.0)
        idle.add_metric(label, 1.0 if f.idle else 0.0)
        depth.add_metric(label, f.queue_depth)
        sent_batches.add_metric(label, f.sent_batches)
        sent_updates.add_metric(label, f.sent_updates)
        sent_bytes.add_metric(label, f.sent_bytes)
        acked.add_metric(label, f.acked_batches)
        connects.add_metric(label, f.connects)
        failures.add_metric(label, f.failures)
        overflows.add_metric(label, f.overflows)
        snapshots.add_metric(label, f.snapshots)
        resyncs.add_metric(label, f.resync_requests)
        heartbeats.add_metric(label, f.heartbeats)
        queue_bytes.add_metric(label, f.queue_bytes)
        queue_wait.add_metric(label, f.queue_wait_s)
        floor_failures.add_metric(label, f.epoch_floor_failures)
    yield from (up, idle, depth, sent_batches, sent_updates, sent_bytes, acked, connects,
                failures, overflows, snapshots, resyncs, heartbeats, queue_bytes,
                queue_wait, floor_failures)


def _service(stats: IngestStats) -> Iterator[Metric]:
    """The registry view, the workers this process owns, the held-bytes bound."""
    degraded = _gauge(f"{P}registry_degraded", [])
    degraded.add_metric([], 1.0 if stats.registry_degraded else 0.0)
    known = _gauge(f"{P}registry_workers", [])
    known.add_metric([], stats.registry_workers)
    invalid = _gauge(f"{P}registry_invalid_entries", [])
    invalid.add_metric([], stats.registry_invalid)
    owned = _gauge(f"{P}owned_workers", [])
    owned.add_metric([], stats.owned_workers)
    held_limit = _gauge(f"{P}held_bytes_limit", [])
    held_limit.add_metric([], stats.held_bytes_limit)
    yield from (degraded, known, invalid, owned, held_limit)


class IngestMetrics:
    """The service's metric registry: the collector plus the lag histogram."""

    def __init__(self, stats: Callable[[], IngestStats]) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(IngestCollector(stats))
        ProcessCollector(registry=self.registry)  # the standard process_* series
        self.lag = Histogram(
            f"{P}lag_seconds",
            _help(f"{P}lag_seconds"),
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
            registry=self.registry,
        )

    def observe_lag(self, seconds: float) -> None:
        self.lag.observe(max(0.0, seconds))

    def render(self) -> bytes:
        data: bytes = generate_latest(self.registry)
        return data
