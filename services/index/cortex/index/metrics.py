"""Every Prometheus metric of the index (``cortex_index_`` prefix), in one place.

Each :class:`IndexMetrics` owns its registry, so several in-process servers (tests, benches)
never collide. Sizes are read from the core at scrape time (no cost on the hot path).
"""

from __future__ import annotations

from collections import Counter as TallyCounter
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from cortex.index.prefix_index import IndexStats, PrefixIndex
from cortex.ledger import cores
from cortex.ledger.model import LedgerState, domain_label

__all__ = ["CONTENT_TYPE", "IndexMetrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (
    25e-6, 50e-6, 100e-6, 200e-6, 500e-6, 1e-3, 2e-3, 5e-3, 10e-3, 25e-3, 100e-3,
)


def _domain_metrics(stats: IndexStats) -> Iterator[Metric]:
    """Sizes and evictions of each hash domain's tree."""
    blocks = GaugeMetricFamily(
        "cortex_index_blocks", "Tree nodes (distinct blocks) per hash domain", labels=["domain"]
    )
    holdings = GaugeMetricFamily(
        "cortex_index_holdings", "(block, source) pairs per hash domain", labels=["domain"]
    )
    domain_bytes = GaugeMetricFamily(
        "cortex_index_domain_bytes", "Estimated tree bytes per hash domain", labels=["domain"]
    )
    evictions = CounterMetricFamily(
        "cortex_index_evicted_blocks",
        "Blocks evicted for the memory budget, per hash domain",
        labels=["domain"],
    )
    for d in stats.domains:
        label = [domain_label(d.domain)]
        blocks.add_metric(label, d.blocks)
        holdings.add_metric(label, d.holdings)
        domain_bytes.add_metric(label, d.bytes_estimate)
        evictions.add_metric(label, d.evictions)
    yield from (blocks, holdings, domain_bytes, evictions)


class _CoreCollector(Collector):
    """Sizes and states read from the core when Prometheus scrapes."""

    def __init__(self, core: Callable[[], PrefixIndex], refused: Callable[[], int]) -> None:
        self._core = core
        self._refused = refused

    def collect(self) -> Iterator[Metric]:
        core = self._core()
        stats = core.stats()
        yield from _domain_metrics(stats)
        tree_core = GaugeMetricFamily(
            "cortex_index_ledger_core", "1 for the radix hash tree core in use (native: "
            "compiled; python: the fallback, ~20x slower)", labels=["core"])
        tree_core.add_metric([cores.active().value], 1)
        yield tree_core
        yield GaugeMetricFamily(
            "cortex_index_bytes_estimate", "Estimated bytes of all trees",
            value=stats.bytes_estimate,
        )
        yield GaugeMetricFamily(
            "cortex_index_memory_budget_bytes", "Memory budget (0 = unbounded)",
            value=stats.bytes_budget,
        )
        yield CounterMetricFamily(
            "cortex_index_evictions", "Blocks evicted for the memory budget", value=stats.evictions
        )
        yield CounterMetricFamily(
            "cortex_index_eviction_passes", "Eviction passes run", value=core.eviction_passes
        )
        yield CounterMetricFamily(
            "cortex_index_eviction_seconds", "Time spent evicting (s)",
            value=core.eviction_seconds,
        )
        yield GaugeMetricFamily(
            "cortex_index_version", "Current ledger version", value=stats.version
        )
        sources = GaugeMetricFamily(
            "cortex_index_sources", "Known sources by ledger state", labels=["state"]
        )
        tally = TallyCounter(rec.effective_state for rec in core.ledger)
        for state in LedgerState:
            if state is not LedgerState.UNSPECIFIED:
                sources.add_metric([state.name.lower()], tally.get(state, 0))
        yield sources
        owners = core.owners
        ingests = GaugeMetricFamily(
            "cortex_index_ingests", "Ingests (Sync ingest_id) owning sources, live or lost",
            labels=["state"],
        )
        lost = sum(1 for _, is_lost, owned in owners if is_lost and owned)
        live = sum(1 for _, is_lost, owned in owners if not is_lost and owned)
        ingests.add_metric(["live"], live)
        ingests.add_metric(["lost"], lost)
        yield ingests
        yield CounterMetricFamily(
            "cortex_index_ingest_losses", "Ingests silent for longer than the grace",
            value=owners.lost_ingests,
        )
        yield CounterMetricFamily(
            "cortex_index_ingest_lost_sources",
            "Sources turned SYNCING because their ingest was lost", value=owners.lost_sources,
        )
        yield CounterMetricFamily(
            "cortex_index_unauthenticated_calls",
            "Calls refused for a missing or wrong token", value=self._refused(),
        )
        yield GaugeMetricFamily(
            "cortex_index_change_log_weight", "Removed keys + cleared sources in the change ring",
            value=core.changes.weight,
        )


class IndexMetrics:
    """The index's metrics and their registry (``render()`` gives the exposition text)."""

    def __init__(self, core: Callable[[], PrefixIndex],
                 refused: Callable[[], int] = lambda: 0) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.match_requests = Counter(
            "cortex_index_match_requests", "Match calls by outcome", ["outcome"], registry=r
        )
        self.match_seconds = Histogram(
            "cortex_index_match_seconds", "Match handling time in the index (s)",
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.match_query_blocks = Histogram(
            "cortex_index_match_query_blocks", "Full blocks per Match query",
            buckets=(1, 4, 16, 64, 256, 1024, 4096, 16384), registry=r,
        )
        self.updates = Counter(
            "cortex_index_updates", "Ledger updates by op and verdict", ["op", "verdict"],
            registry=r,
        )
        self.update_batches = Counter(
            "cortex_index_update_batches", "Sync batches received", registry=r
        )
        self.quiet_batches = Counter(
            "cortex_index_quiet_batches", "Sync batches applied without a reply (quiet)",
            registry=r,
        )
        self.rejected_updates = Counter(
            "cortex_index_rejected_updates", "Malformed ledger updates", registry=r
        )
        self.resync_requests = Counter(
            "cortex_index_resync_requests", "Sources listed in SyncReply.resync", registry=r
        )
        self.apply_seconds = Histogram(
            "cortex_index_apply_batch_seconds", "Time to apply one Sync batch (s)",
            buckets=(1e-4, 5e-4, 1e-3, 5e-3, 10e-3, 50e-3, 0.1, 0.5, 1.0), registry=r,
        )
        self.frames_calls = Counter(
            "cortex_index_frames_calls", "Calls made over Cortex frames instead of gRPC, by "
            "method (ingest Sync, gateway Replicate)", ["method"], registry=r,
        )
        self.sync_streams = Gauge(
            "cortex_index_sync_streams", "Open Sync streams (ingest connections)", registry=r
        )
        self.change_subscribers = Gauge(
            "cortex_index_change_subscribers", "Open Changes streams", registry=r
        )
        self.change_batches = Counter(
            "cortex_index_change_batches", "ChangeBatch messages sent", registry=r
        )
        self.change_resets = Counter(
            "cortex_index_change_resets", "ChangeBatch resets sent", registry=r
        )
        self.replica_subscribers = Gauge(
            "cortex_index_replica_subscribers", "Open Replicate streams (gateway replicas)",
            registry=r,
        )
        self.replica_snapshot_bytes = Counter(
            "cortex_index_replica_snapshot_bytes", "Snapshot bytes sent to replicas", registry=r
        )
        self.replica_overflows = Counter(
            "cortex_index_replica_overflows",
            "Replicas cut off for falling replica_queue_bytes behind", registry=r,
        )
        self.serving = Gauge(
            "cortex_index_serving", "1 while the index serves, 0 while it drains", registry=r
        )
        r.register(_CoreCollector(core, refused))
        ProcessCollector(namespace="cortex_index", registry=r)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)

    def __repr__(self) -> str:
        return f"IndexMetrics(collectors={len(list(self.registry.collect()))})"
