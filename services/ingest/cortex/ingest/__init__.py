"""The Cortex ingest: workers' KV-event streams (ZMQ) turned into ledger updates for the index.

Public API (imported lazily, so reading the package does not start pulling in zmq)::

    from cortex.ingest import IngestConfig, IngestService, IndexTarget

``UpdateEncoder`` / ``encode_batch_bytes`` are the ingest's stream to the index (its Sync
batches), ``SourceTracker`` / ``TrackerConfig`` one source's path from payloads to ops, for
the benchmarks that measure them. See ``docs/ingest.md``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cortex.ingest.config import IngestConfig
    from cortex.ingest.forwarder import IndexTarget
    from cortex.ingest.service import IngestService
    from cortex.ingest.tracker import SourceTracker
    from cortex.ingest.tracker_config import TrackerConfig
    from cortex.ingest.wire import UpdateEncoder, encode_batch_bytes

__all__ = ["IndexTarget", "IngestConfig", "IngestService", "SourceTracker", "TrackerConfig",
           "UpdateEncoder", "encode_batch_bytes"]

_WHERE = {
    "IndexTarget": "cortex.ingest.forwarder",
    "IngestConfig": "cortex.ingest.config",
    "IngestService": "cortex.ingest.service",
    "SourceTracker": "cortex.ingest.tracker",
    "TrackerConfig": "cortex.ingest.tracker_config",
    "UpdateEncoder": "cortex.ingest.wire",
    "encode_batch_bytes": "cortex.ingest.wire",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'cortex.ingest' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
