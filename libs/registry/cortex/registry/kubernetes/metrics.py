"""Every metric of the pod discovery, in its own ``CollectorRegistry``."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

__all__ = ["DiscoveryMetrics"]


class DiscoveryMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.pods = Gauge("cortex_discovery_pods", "Pods matched by the selector, by state",
                          ["state"], registry=r)  # worker, not_ready, invalid
        self.events = Counter("cortex_discovery_watch_events_total",
                              "Watch events received, by type", ["type"], registry=r)
        self.lists = Counter("cortex_discovery_lists_total",
                             "Full pod lists, by reason (start, gone, error)", ["reason"],
                             registry=r)
        self.api_errors = Counter("cortex_discovery_api_errors_total",
                                  "Failed list or watch calls to the Kubernetes API", registry=r)
        self.writes = Counter("cortex_discovery_registry_writes_total",
                              "Registry writes, by operation (register, renew, remove)", ["op"],
                              registry=r)
        self.registry_errors = Counter("cortex_discovery_registry_errors_total",
                                       "Reconciliations that could not reach the registry",
                                       registry=r)
        self.engine_queries = Counter(
            "cortex_discovery_engine_queries_total",
            "Engines asked about themselves (--learn-from-engines), by result (learned|failed)",
            ["result"], registry=r)
        self.held = Gauge("cortex_discovery_held_workers",
                          "Ready pods kept out by an operator's removal", registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
