"""The sim's engine model without its HTTP server: a prefix cache driven prompt by prompt
and the KV-event publisher its events go out on.

For the ingest tests and ``cortex bench ingest``, which need an engine's event stream under
their own control (every store, eviction and flush explicit, faults on demand) and the
Cortex keys the index must end up holding. The cache is :class:`~cortex.sim.cache.PrefixCache`
and the wire :class:`~cortex.sim.publisher.EventPublisher`, as a running sim uses them, so
these tests and the acceptance tests exercise one engine model.

- :class:`EngineCache` (pure): :meth:`~EngineCache.store` a prompt (its full blocks are
  cached; LRU leaves are evicted to make room), :meth:`~EngineCache.evict`,
  :meth:`~EngineCache.clear`; each returns the cache events it caused, for
  :meth:`SyntheticPublisher.publish` or :meth:`SyntheticPublisher.encode`.
  :meth:`~EngineCache.expected_keys` is the set of Cortex keys of its blocks.
- :class:`SyntheticPublisher`: an :class:`~cortex.sim.publisher.EventPublisher` with its own
  ZMQ context, subscriber tracking and fault knobs (drop or duplicate the next batches,
  restart at ``seq`` 0, forget the replay buffer, raw hostile frames).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import zmq.asyncio

from cortex.hashing import Engine, HashDomain, block_keys
from cortex.sim.cache import BlockHasher, CachedBlock, CacheEvent, PrefixCache
from cortex.sim.config import FaultConfig
from cortex.sim.faults import FaultState
from cortex.sim.hashers import EngineHasher, FastHasher
from cortex.sim.publisher import EventEncoder, EventPublisher

__all__ = ["EngineCache", "Hashes", "PublisherConfig", "SyntheticPublisher"]

Hashes = Literal["fast", "engine"]
"""``fast``: :class:`FastHasher` ids (cheap, opaque); ``engine``: the engine's real hashes."""


class EngineCache:
    """An engine's paged prefix cache of ``capacity_blocks`` blocks of ``block_size`` tokens.

    SGLang removals come one event per evicted chain, vLLM's one per block, as a running
    sim sends them. A LoRA adapter's prompts live in their own namespace (``lora``).
    """

    def __init__(self, engine: Engine, block_size: int, capacity_blocks: int, *,
                 hashes: Hashes = "fast") -> None:
        if hashes not in ("fast", "engine"):
            raise ValueError("hashes must be 'fast' or 'engine'")
        self.engine = Engine(engine)
        self.hashes = hashes
        hasher: BlockHasher = (FastHasher(self.engine, block_size) if hashes == "fast"
                               else EngineHasher(self.engine, block_size))
        # match_margin 0: a store caches every full block, nothing is left to compute.
        self.cache = PrefixCache(capacity_blocks, block_size, hasher,
                                 coalesce_removals=self.engine is Engine.SGLANG,
                                 match_margin=0)

    @property
    def block_size(self) -> int:
        return self.cache.block_size

    def __len__(self) -> int:
        return self.cache.cached_blocks

    def store(self, tokens: Sequence[int], *, lora: str | None = None) -> list[CacheEvent]:
        """Cache the full blocks of a prompt; the events of what was evicted and stored.

        Raises ``ValueError`` for a prompt with more new blocks than the whole cache holds.
        """
        full = len(tokens) // self.block_size * self.block_size
        if full:
            prompt = tokens[:full]
            lease = self.cache.admit(prompt, full, lora)
            if lease is None:
                raise ValueError(f"a prompt of {full} tokens does not fit in {self!r}")
            self.cache.commit(lease, prompt)
            self.cache.release(lease)
        return self.cache.drain_events()

    def evict(self, count: int) -> list[CacheEvent]:
        """Evict up to ``count`` LRU leaf blocks now."""
        self.cache.evict(count)
        return self.cache.drain_events()

    def clear(self) -> list[CacheEvent]:
        """Flush the whole cache (``/flush_cache``, ``/reset_prefix_cache``)."""
        self.cache.reset()
        return self.cache.drain_events()

    def expected_keys(self, model: str) -> set[int]:
        """Cortex keys of every cached block, as the index must hold them."""
        domain = HashDomain(model, self.block_size, self.engine)
        keys: dict[CachedBlock, int] = {}
        for block in self.cache.blocks():
            path: list[CachedBlock] = []
            current: CachedBlock | None = block
            while current is not None and current not in keys:
                path.append(current)
                current = current.parent
            key = keys[current] if current is not None else None
            for step in reversed(path):
                parent = domain.root_key(step.lora) if key is None else key
                key = keys[step] = block_keys(step.tokens, self.block_size, parent)[0]
        return set(keys.values())

    def __repr__(self) -> str:
        return (f"EngineCache({self.engine.value}, hashes={self.hashes}, "
                f"block_size={self.block_size}, "
                f"blocks={len(self)}/{self.cache.capacity})")


@dataclass(frozen=True, slots=True)
class PublisherConfig:
    """One publisher = one engine DP rank. Ports 0 pick free ones; ``replay_port=None``
    disables replay. ``version`` selects the payload and replay reply format."""

    engine: Engine = Engine.VLLM
    version: str = "0.33.0"
    topic: str = ""
    host: str = "127.0.0.1"
    pub_port: int = 0
    replay_port: int | None = 0
    buffer_steps: int = 10_000
    dp_rank: int = 0


class SyntheticPublisher(EventPublisher):
    """``async with SyntheticPublisher(config) as pub``: bound sockets and a replay server."""

    def __init__(self, config: PublisherConfig | None = None) -> None:
        self.config = cfg = config or PublisherConfig()
        self.encoder = EventEncoder(cfg.engine, cfg.version, cfg.dp_rank)
        self.faults = FaultState(FaultConfig())
        super().__init__(zmq.asyncio.Context(), self.encoder, self.faults, host=cfg.host,
                         pub_port=cfg.pub_port, replay_port=cfg.replay_port, topic=cfg.topic,
                         buffer_steps=cfg.buffer_steps, track_subscribers=True)

    @property
    def endpoint(self) -> str:
        return f"tcp://{self.config.host}:{self.pub_port}"

    @property
    def replay_endpoint(self) -> str | None:
        return None if self.replay_port is None else f"tcp://{self.config.host}:{self.replay_port}"

    async def aclose(self) -> None:
        await super().aclose()
        if not self._ctx.closed:
            self._ctx.term()

    def encode(self, events: Sequence[CacheEvent], ts: float | None = None) -> bytes:
        """One batch payload in the configured engine version's format."""
        return self.encoder.encode(events, ts)

    def publish(self, events: Sequence[CacheEvent]) -> int:
        """Send one batch, an empty one too (a restarted engine's first step may carry
        nothing); returns its seq."""
        self.sent_events += len(events)
        return self.publish_payload(self.encode(events))

    def drop_next(self, count: int = 1) -> None:
        """The next ``count`` batches are buffered for replay but never sent (a gap)."""
        self.faults.update({"drop_batches": self.faults.config.drop_batches + count})

    def duplicate_next(self, count: int = 1) -> None:
        """The next ``count`` batches are sent twice."""
        self.faults.update({"duplicate_batches": self.faults.config.duplicate_batches + count})
