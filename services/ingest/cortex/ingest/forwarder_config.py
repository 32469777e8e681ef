"""Where one index replica listens (:class:`IndexTarget`) and the limits of the forwarder that
feeds it (:class:`ForwarderConfig`); both validated on creation."""

from __future__ import annotations

from dataclasses import dataclass

from cortex.ingest.errors import ConfigError

__all__ = ["ForwarderConfig", "IndexTarget"]


@dataclass(frozen=True, slots=True)
class IndexTarget:
    """Where an index replica listens for gRPC."""

    host: str
    port: int

    def __post_init__(self) -> None:
        if not self.host:
            raise ConfigError("index host must be non-empty")
        if not 1 <= self.port <= 65535:
            raise ConfigError(f"index port {self.port} out of range 1..65535")

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    @classmethod
    def parse(cls, text: str) -> IndexTarget:
        """``HOST:PORT`` (``[v6]:PORT`` for IPv6)."""
        host, sep, port = text.strip().rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ConfigError(f"index address {text!r} must be HOST:PORT")
        return cls(host.strip("[]"), int(port))


@dataclass(frozen=True, slots=True)
class ForwarderConfig:
    """Limits of one forwarder. Counts are updates, sizes bytes, times seconds."""

    queue_max_updates: int = 100_000
    """Updates queued per index replica before snapshots take over."""
    queue_max_bytes: int = 64 << 20
    """Bytes of updates queued per index replica."""
    source_queue_max_bytes: int = 8 << 20
    """Bytes of updates queued per source and replica."""
    source_turn_bytes: int = 4 << 10
    """Bytes of updates one source contributes to a batch before the next source's turn
    (small against a batch, so that every batch is shared by the sources with updates)."""
    max_inflight_batches: int = 2
    """Batches sent and not yet acknowledged. The next batch is collected only when one is
    acknowledged, so an update waits behind at most this many batches, not behind whatever
    HTTP/2 flow control would let pile up at a busy replica."""
    batch_max_updates: int = 512
    batch_max_bytes: int = 1 << 20
    snapshot_chunk_keys: int = 65_536
    backoff_min_s: float = 0.1
    backoff_max_s: float = 5.0
    connect_timeout_s: float = 5.0
    heartbeat_s: float = 1.0
    """An idle stream sends an empty batch this often (keep it well under the index's
    ``ingest_grace_s``)."""
    reply_timeout_s: float = 15.0
    """A stream that got no reply for this long is dropped and reconnected."""
    quiet_replies: bool = False
    """Ask the replica for a reply only with a batch that fills the in-flight window, or a
    heartbeat (``UpdateBatch.quiet`` on the others): about half the replies at ordinary
    rates, but the last batch of a burst is acknowledged only by the next batch's reply or
    the next heartbeat's, so :attr:`IndexForwarder.idle` (``index_idle``) lags by up to
    ``heartbeat_s``."""
    frames: bool = True
    """Stream to the index over Cortex frames (its gRPC port, without HTTP/2: a fraction of
    the CPU per batch at both ends); an index that does not answer them is streamed to over
    gRPC from then on."""

    def __post_init__(self) -> None:
        if min(self.queue_max_updates, self.batch_max_updates, self.snapshot_chunk_keys,
               self.max_inflight_batches) < 1:
            raise ConfigError("queue, batch, snapshot chunk and in-flight sizes must be >= 1")
        if min(self.batch_max_bytes, self.queue_max_bytes, self.source_queue_max_bytes,
               self.source_turn_bytes) < 1024:
            raise ConfigError("batch, queue and turn sizes must be >= 1024 bytes")
        if self.source_queue_max_bytes > self.queue_max_bytes:
            raise ConfigError("source_queue_max_bytes must be <= queue_max_bytes")
        if not 0 < self.backoff_min_s <= self.backoff_max_s:
            raise ConfigError("backoff must satisfy 0 < min <= max")
        if self.connect_timeout_s <= 0:
            raise ConfigError("connect_timeout_s must be > 0")
        if not 0 < self.heartbeat_s < self.reply_timeout_s:
            raise ConfigError("heartbeat_s and reply_timeout_s must satisfy 0 < heartbeat < reply")
