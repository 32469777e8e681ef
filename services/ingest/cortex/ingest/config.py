"""``IngestConfig``: every setting of one ingest process, validated on creation.

Built once at the edge (``cortex ingest run``: :mod:`cortex.edge.settings` reads a file,
``CORTEX_INGEST_<FIELD>`` variables and ``--<field>`` flags into it; each field's docstring is
its flag's help) and passed down; nothing below reads the environment.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cortex.hashing import VLLM_HASH_ALGOS
from cortex.ingest.alignment import AUTO
from cortex.ingest.errors import ConfigError
from cortex.ingest.forwarder import ForwarderConfig, IndexTarget
from cortex.ingest.shard import ShardSpec

__all__ = ["IngestConfig"]


@dataclass(frozen=True, slots=True)
class IngestConfig:
    """Settings of one ingest process. Times in seconds, counts in batches, sizes in bytes.

    ``redis_url`` is where the registry lives (``None`` when the caller hands the service a
    registry object, e.g. a ``MemoryRegistry`` in tests). ``index`` lists every index replica
    to feed. ``metrics_port`` ``None`` disables the HTTP endpoint, 0 picks a free port.
    ``hash_algo`` / ``hash_seed`` configure the vLLM alignment check (a worker's labels
    ``hash_algo`` / ``hash_seed`` override them).

    Held payloads: a source holds at most ``max_pending_batches`` / ``max_pending_bytes``
    (batches waiting for a replay, or for the source's next turn), all sources together at
    most ``max_held_bytes``; a source over its bound, or the largest holder when the total
    is over, gives its held batches up and resets its ledger. ``turn_bytes``: payload bytes a
    source decodes per turn before the others get theirs. ``max_message_bytes``: ZMQ
    ``MAXMSGSIZE`` of every SUB and DEALER (a larger message is refused by libzmq).
    """

    index: tuple[IndexTarget, ...] = ()
    """Every index replica to feed (HOST:PORT, a comma list)."""
    index_token_file: str = ""
    """File with the index's peer token (``cortex index --peer-token-file``), presented on
    every call; read when the service starts ("" = none)."""
    redis_url: str | None = None
    """Registry Redis URL (redis://, rediss:// or unix://)."""
    registry_namespace: str = "cortex:v1:"
    """Registry key prefix."""
    shard: ShardSpec = field(default_factory=ShardSpec)
    """Own the workers whose id hashes to shard i of K (i/K)."""
    ingest_id: str = ""
    """Name reported to the index ("" = ingest-<i>of<K>@<host>)."""
    metrics_host: str = "127.0.0.1"
    """Address of /metrics and /health (0.0.0.0 for every interface)."""
    metrics_port: int | None = 9465
    """HTTP port of /metrics and /health (0 = ephemeral, -1 or off = none)."""
    poll_interval_s: float = 1.0
    """Registry polling interval (<= 1 s)."""
    use_channel: bool = True
    """Subscribe to the registry's pub/sub channel."""
    redis_timeout_s: float = 2.0
    """Bound of one registry operation."""
    replay_timeout_s: float = 2.0
    """Abandon a replay silent for this long."""
    max_pending_batches: int = 10_000
    """Live batches held per source (replaying or waiting for its turn)."""
    max_pending_bytes: int = 64 << 20
    """Payload bytes held per source; over it the source gives its held batches up and
    resets its ledger."""
    max_held_bytes: int = 256 << 20
    """Payload bytes held by all sources; over it the largest holder gives up."""
    turn_bytes: int = 64 << 10
    """Payload bytes one source decodes before the next one's turn."""
    max_message_bytes: int = 32 << 20
    """ZMQ MAXMSGSIZE of every event and replay socket."""
    sub_hwm: int = 100_000
    """ZMQ receive high-water mark of every event socket (messages)."""
    read_burst: int = 512
    """Most messages one source reads before yielding."""
    align_every: int = 64
    """Check 1 in N chain-start stores against engine hashes (0 = off)."""
    columnar_decode: bool = True
    """Decode the common KV-event payload shapes in the compiled ledger core and place plain
    device stores and removals from its columns (off: every payload through the Python
    codec; same result, the benchmarks' baseline)."""
    hash_algo: str = AUTO
    """vLLM --prefix-caching-hash-algo for the alignment check (auto = learn)."""
    hash_seed: str | None = None
    """vLLM workers' PYTHONHASHSEED for the alignment check."""
    tombstone_ttl_s: float = 600.0
    """A removed worker stays out this long."""
    capacity_margin: float = 0.25
    """A source is credited with at most its worker's reported KV capacity (vLLM
    ``cache_config_info``, SGLang ``/server_info``) times 1 + this; beyond, its stores are
    refused and counted (``ignored_blocks{reason="over_capacity"}``)."""
    capacity_tier_blocks: int = 0
    """Blocks of offload tiers the engines do not report (e.g. a disk tier), added to that
    bound."""
    forwarder: ForwarderConfig = field(default_factory=ForwarderConfig)

    def __post_init__(self) -> None:
        if not isinstance(self.index, tuple):
            object.__setattr__(self, "index", tuple(self.index))
        if self.redis_url is not None and not self.redis_url.startswith(
            ("redis://", "rediss://", "unix://")
        ):
            raise ConfigError(
                f"redis_url {self.redis_url!r} must start with redis://, rediss:// or unix://"
            )
        if len(set(self.index)) != len(self.index):
            raise ConfigError("index replicas must be distinct")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"metrics_port {self.metrics_port} out of range 0..65535")
        positive = {
            "poll_interval_s": self.poll_interval_s,
            "redis_timeout_s": self.redis_timeout_s,
            "replay_timeout_s": self.replay_timeout_s,
            "tombstone_ttl_s": self.tombstone_ttl_s,
        }
        for name, value in positive.items():
            if not value > 0:
                raise ConfigError(f"{name} must be > 0, got {value}")
        if self.poll_interval_s > 1.0:
            raise ConfigError("poll_interval_s must be <= 1 s (architecture §2)")
        for name in ("max_pending_batches", "sub_hwm", "read_burst"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_pending_bytes", "max_held_bytes", "turn_bytes", "max_message_bytes"):
            if getattr(self, name) < 1024:
                raise ConfigError(f"{name} must be >= 1024 bytes, got {getattr(self, name)}")
        if self.max_pending_bytes > self.max_held_bytes:
            raise ConfigError("max_pending_bytes must be <= max_held_bytes")
        if self.align_every < 0:
            raise ConfigError("align_every must be >= 0 (0 = off)")
        if self.capacity_margin < 0 or self.capacity_tier_blocks < 0:
            raise ConfigError("capacity_margin and capacity_tier_blocks must be >= 0")
        if self.hash_algo != AUTO and self.hash_algo not in VLLM_HASH_ALGOS:
            raise ConfigError(
                f"hash_algo {self.hash_algo!r} must be 'auto' or one of {list(VLLM_HASH_ALGOS)}"
            )
        if not self.ingest_id:
            object.__setattr__(self, "ingest_id", f"ingest-{self.shard.index}of{self.shard.count}")
