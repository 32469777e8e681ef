"""Index configuration: one frozen, validated object, read at the edge (``cli.py``, with
:mod:`cortex.edge.settings`: each field is ``CORTEX_INDEX_<FIELD>`` and ``--<field>``; its
docstring is the flag's help)."""

from __future__ import annotations

from dataclasses import dataclass

from cortex.index.errors import ConfigError

__all__ = ["IndexConfig"]

_GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class IndexConfig:
    """Settings of one index process. Validated on creation (:class:`ConfigError`).

    Network: ``port`` 0 binds an ephemeral port (read ``IndexServer.port``);
    ``metrics_port`` None disables the Prometheus endpoint, 0 picks an ephemeral one.
    Sizes are in bytes, keys, records or blocks as named; times in seconds.
    """

    host: str = "127.0.0.1"
    """gRPC bind address: loopback unless configured (docs/operations.md, trust model)."""
    port: int = 50051
    """gRPC port (0 = ephemeral)."""
    metrics_host: str = "127.0.0.1"
    """Prometheus bind address."""
    metrics_port: int | None = 9464
    """Prometheus /metrics port (0 = ephemeral, -1 or off = disabled)."""
    # who may call what (files holding shared secrets; "" = not required)
    peer_token_file: str = ""
    """Sync and Replicate (ingest, gateways) must present this token."""
    query_token_file: str = ""
    """Match, Workers, Stats and Changes must present this token or the peer token."""
    # memory
    memory_budget_bytes: int = 2 * _GIB
    """Estimated tree bytes at which least-recently-matched leaves are evicted (0 = none)."""
    low_watermark: float = 0.95
    """Eviction stops at this fraction of the budget (amortises the leaf scan)."""
    # queries
    max_query_blocks: int = 1 << 16
    """Most block keys in one Match."""
    max_query_tokens: int = 1 << 22
    """Most token ids in one Match."""
    # change feed
    changes_max_keys: int = 1 << 20
    """Removed keys the change ring keeps; a subscriber further behind gets a reset."""
    changes_max_records: int = 1 << 16
    """Change records the change ring keeps."""
    changes_batch_keys: int = 4096
    """Most removed keys in one ChangeBatch."""
    changes_heartbeat_s: float = 1.0
    """An idle change feed sends an empty batch (current version) this often."""
    # ledger sync
    resync_retry_s: float = 5.0
    """A source still awaiting a snapshot is listed in SyncReply.resync again after this."""
    max_tombstones: int = 4096
    """Removed sources remembered (so their late duplicates stay duplicates)."""
    apply_slice_s: float = 0.005
    """A Sync batch yields to queries after this much apply time."""
    columnar_sync: bool = True
    """Apply a Sync batch's in-order stores and removals from its bytes in one call of the
    compiled ledger core (off: update by update, the pure-Python path; same result)."""
    ingest_grace_s: float = 5.0
    """An ingest heard from for no longer than this (no batch: ingests send an empty one
    every second when idle; no open stream) is lost: its sources turn SYNCING
    (``ingest_lost``) until snapshots re-establish them. 0 = never."""
    # ledger replicas (gateways)
    replica_heartbeat_s: float = 0.5
    """An idle replica stream sends an empty batch this often (replicas use it to tell a
    quiet index from a lost stream)."""
    replica_flush_s: float = 0.005
    """Changes applied within this long go to the replicas as one batch (the lag it adds is
    at most this; the messages it saves are most of the index's CPU under small batches)."""
    replica_queue_bytes: int = 64 << 20
    """Encoded batches queued for one replica; a replica further behind is cut off and
    resyncs with a snapshot."""
    replica_chunk_bytes: int = 1 << 20
    """Largest snapshot batch sent to a replica (bytes)."""
    # lifecycle
    shutdown_grace_s: float = 5.0
    """On SIGTERM: health NOT_SERVING, streams told to go, in-flight calls get this long."""

    def __post_init__(self) -> None:
        for name in ("port", "metrics_port"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 65535:
                raise ConfigError(f"{name} must be in [0, 65535], got {value}")
        if not self.host or not self.metrics_host:
            raise ConfigError("host and metrics_host must be non-empty")
        if self.memory_budget_bytes < 0:
            raise ConfigError(f"memory_budget_bytes must be >= 0, got {self.memory_budget_bytes}")
        if not 0.0 < self.low_watermark <= 1.0:
            raise ConfigError(f"low_watermark must be in (0, 1], got {self.low_watermark}")
        positive_ints = (
            "max_query_blocks",
            "max_query_tokens",
            "changes_max_keys",
            "changes_max_records",
            "changes_batch_keys",
            "replica_queue_bytes",
            "replica_chunk_bytes",
        )
        for name in positive_ints:
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_tombstones < 0:
            raise ConfigError(f"max_tombstones must be >= 0, got {self.max_tombstones}")
        positive_times = ("changes_heartbeat_s", "apply_slice_s", "replica_heartbeat_s",
                          "replica_flush_s")
        for name in positive_times:
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("resync_retry_s", "shutdown_grace_s", "ingest_grace_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
