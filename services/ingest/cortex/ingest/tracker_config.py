"""``TrackerConfig``: the settings of one source's tracker."""

from __future__ import annotations

from dataclasses import dataclass

from cortex.hashing import Engine
from cortex.ingest.alignment import AUTO

__all__ = ["TrackerConfig"]


@dataclass(frozen=True, slots=True)
class TrackerConfig:
    """Per-source settings (validated on creation).

    ``block_size``: tokens per block from the registry, ``None`` to learn it from the first
    ``BlockStored``. ``max_pending`` / ``max_pending_bytes``: live batches / payload bytes
    held at most (during a replay, or deferred). ``drain_bytes``: payload bytes of held
    batches applied right when a replay ends (``None``: all; the shell calls
    :meth:`SourceTracker.drain` for the rest). ``dup_window``: recent batches remembered to
    tell duplicates from restarts. ``align_every``: check one in N chain-start stores
    against the engine's own hash (0 = never). ``kv_lookahead``: the worker spec's
    speculative-decoding lookahead (tokens), ``None`` to learn it from the first store.
    ``columnar_decode``: decode the common payload shapes in the compiled core
    (:mod:`cortex.ingest.columnar`; off: every payload through ``decode_batch``, the path
    before, for benchmarks and differential tests).
    """

    engine: Engine
    model: str
    block_size: int | None = None
    replay: bool = False
    max_pending: int = 10_000
    max_pending_bytes: int = 64 << 20
    drain_bytes: int | None = None
    dup_window: int = 256
    align_every: int = 64
    hash_algo: str = AUTO
    hash_seed: str | None = None
    kv_lookahead: int | None = None
    columnar_decode: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "engine", Engine(self.engine))
        if not self.model:
            raise ValueError("model must be non-empty")
        if self.block_size is not None and self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if min(self.max_pending, self.max_pending_bytes, self.dup_window) < 1:
            raise ValueError("max_pending, max_pending_bytes and dup_window must be >= 1")
        if self.align_every < 0:
            raise ValueError("align_every must be >= 0")
        if self.drain_bytes is not None and self.drain_bytes < 1:
            raise ValueError("drain_bytes must be >= 1 or None")
