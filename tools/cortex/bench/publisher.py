"""A synthetic KV-event publisher: an engine's prefix cache and its ZMQ transport, minus the
GPU. Used by the ingest tests and by ``cortex bench ingest``.

- :class:`EngineCache` (pure) caches token sequences in full blocks with LRU eviction of leaf
  blocks and emits the ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` events an
  engine would (vLLM: one ``BlockRemoved`` per hash; SGLang: one per eviction round). It knows
  the Cortex keys its blocks must have in the index, for end-to-end checks.
- :class:`SyntheticPublisher` (asyncio) publishes encoded batches as the engines do (spec
  kv-events.md §1): an XPUB socket sending ``[topic, seq, payload]`` and a replay ROUTER with
  a ``buffer_steps`` ring, answering ``[b"", start_seq]`` in the engine version's format. It
  injects faults: dropped or duplicated batches, restarts with ``seq`` 0, raw hostile frames.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import TracebackType

import xxhash
import zmq
import zmq.asyncio

from cortex.hashing import (
    Engine,
    HashDomain,
    block_keys,
    pack_tokens,
    sglang_event_int,
    sglang_page_hashes,
    vllm_block_hashes,
    vllm_event_int,
    vllm_extra_keys,
)
from cortex.ingest.codec import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    Event,
    EventBatch,
    encode_batch,
)
from cortex.ingest.frames import (
    parse_replay_request,
    pub_frames,
    replay_end_frames,
    replay_has_topic,
    replay_reply_frames,
)

__all__ = ["EngineCache", "PublisherConfig", "SyntheticPublisher"]

_MASK64 = (1 << 64) - 1


@dataclass(slots=True)
class _Block:
    parent: BlockHash | None
    tokens: tuple[int, ...]
    root: tuple[str | None, str | None]  # (lora_name, cache_salt) of the chain
    digest: bytes  # the engine digest the next block chains from ("engine" hashes)
    children: int = 0


class EngineCache:
    """A paged prefix cache of ``capacity_blocks`` blocks of ``block_size`` tokens.

    ``hashes="fast"`` uses cheap xxh3 stand-ins for the engine hashes (they are opaque to
    Cortex); ``"engine"`` computes the engine's real hashes (vLLM sha256 / SGLang), which the
    ingest's alignment check can reproduce.
    """

    def __init__(
        self,
        engine: Engine,
        block_size: int,
        capacity_blocks: int,
        *,
        hashes: str = "fast",
        medium: str | None = "GPU",
    ) -> None:
        if block_size < 1 or capacity_blocks < 1:
            raise ValueError("block_size and capacity_blocks must be >= 1")
        if hashes not in ("fast", "engine"):
            raise ValueError("hashes must be 'fast' or 'engine'")
        self.engine = Engine(engine)
        self.block_size = block_size
        self.capacity_blocks = capacity_blocks
        self.hashes = hashes
        self.medium = medium
        self._blocks: dict[BlockHash, _Block] = {}
        self._lru: OrderedDict[BlockHash, None] = OrderedDict()  # oldest first
        self.stored_blocks = 0
        self.removed_blocks = 0

    def __repr__(self) -> str:
        return (
            f"EngineCache({self.engine.value}, block_size={self.block_size}, "
            f"blocks={len(self._blocks)}/{self.capacity_blocks})"
        )

    def __len__(self) -> int:
        return len(self._blocks)

    # ---- engine hashes ----

    def _chain(
        self,
        parent: _Block | None,
        tokens: Sequence[int],
        lora_name: str | None,
        cache_salt: str | None,
    ) -> list[tuple[BlockHash, bytes]]:
        size = self.block_size
        if self.hashes == "fast":
            out: list[tuple[BlockHash, bytes]] = []
            prior = parent.digest if parent is not None else (
                f"{lora_name}\0{cache_salt}".encode() if lora_name or cache_salt else b""
            )
            packed = pack_tokens(tokens)
            step = size * 4
            for start in range(0, len(packed), step):
                digest = xxhash.xxh3_128_digest(prior + packed[start:start + step])
                value = int.from_bytes(digest[:8], "big")
                out.append((value - (1 << 64) if value >> 63 and self.engine is Engine.SGLANG
                            else value, digest))
                prior = digest
            return out
        if self.engine is Engine.SGLANG:
            digests = sglang_page_hashes(
                tokens, size, parent=parent.digest if parent else None, cache_salt=cache_salt
            )
            return [(sglang_event_int(d), d) for d in digests]
        extra = vllm_extra_keys(len(tokens) // size, lora_name=lora_name, cache_salt=cache_salt)
        digests = vllm_block_hashes(
            tokens, size, parent=parent.digest if parent else None, extra_keys=extra
        )
        return [(vllm_event_int(d), d) for d in digests]

    # ---- operations ----

    def store(
        self,
        tokens: Sequence[int],
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
    ) -> list[Event]:
        """Cache the full blocks of a prompt; events for what is new or evicted."""
        size = self.block_size
        full = len(tokens) // size * size
        blocks = self._blocks
        events: list[Event] = []
        # walk the cached prefix
        parent: _Block | None = None
        parent_hash: BlockHash | None = None
        chain = self._chain(None, tokens[:full], lora_name, cache_salt) if full else []
        index = 0
        while index < len(chain) and chain[index][0] in blocks:
            parent_hash = chain[index][0]
            parent = blocks[parent_hash]
            index += 1
        touched = [h for h, _ in chain[:index]]
        new = chain[index:]
        if new:
            evicted = self._make_room(len(new), protect=set(touched))
            events.extend(evicted)
            first_parent = parent_hash
            root = (lora_name, cache_salt) if parent is None else parent.root
            for offset, (engine_hash, digest) in enumerate(new):
                start = (index + offset) * size
                blocks[engine_hash] = _Block(
                    parent_hash, tuple(tokens[start:start + size]), root, digest
                )
                if parent_hash is not None:
                    blocks[parent_hash].children += 1
                parent_hash = engine_hash
                touched.append(engine_hash)
            self.stored_blocks += len(new)
            events.append(
                BlockStored(
                    tuple(h for h, _ in new),
                    first_parent,
                    tuple(tokens[index * size:full]),
                    size,
                    lora_id=1 if lora_name else None,
                    medium=self.medium,
                    lora_name=lora_name,
                    cache_salt=cache_salt if self.engine is Engine.SGLANG else None,
                    extra_keys=(
                        tuple(vllm_extra_keys(len(new), lora_name=lora_name, cache_salt=cache_salt,
                                              first_block=index))
                        if self.engine is Engine.VLLM and (lora_name or cache_salt) else None
                    ),
                )
            )
        lru = self._lru
        for engine_hash in reversed(touched):  # leaves most recent, parents after them
            lru[engine_hash] = None
            lru.move_to_end(engine_hash)
        return events

    def _make_room(self, needed: int, protect: set[BlockHash]) -> list[Event]:
        over = len(self._blocks) + needed - self.capacity_blocks
        if over <= 0:
            return []
        victims: list[BlockHash] = []
        blocks = self._blocks
        while over > 0:
            victim = next(
                (h for h in self._lru if blocks[h].children == 0 and h not in protect), None
            )
            if victim is None:
                break
            self._drop(victim)
            victims.append(victim)
            over -= 1
        self.removed_blocks += len(victims)
        if self.engine is Engine.SGLANG:
            return [BlockRemoved(tuple(victims), self.medium)] if victims else []
        return [BlockRemoved((h,), self.medium) for h in victims]

    def _drop(self, engine_hash: BlockHash) -> None:
        block = self._blocks.pop(engine_hash)
        del self._lru[engine_hash]
        if block.parent is not None and block.parent in self._blocks:
            self._blocks[block.parent].children -= 1

    def evict(self, count: int) -> list[Event]:
        """Evict up to ``count`` LRU leaves now."""
        return self._make_room(count + len(self._blocks) - self.capacity_blocks, set())

    def clear(self) -> list[Event]:
        """Flush the whole cache (``/flush_cache``, ``/reset_prefix_cache``)."""
        self._blocks.clear()
        self._lru.clear()
        return [AllBlocksCleared()]

    def expected_keys(self, model: str) -> set[int]:
        """Cortex keys of every cached block, as the index must hold them."""
        domain = HashDomain(model, self.block_size, self.engine)
        keys: dict[BlockHash, int] = {}

        def key_of(engine_hash: BlockHash) -> int:
            found = keys.get(engine_hash)
            if found is not None:
                return found
            path: list[BlockHash] = []
            current: BlockHash | None = engine_hash
            while current is not None and current not in keys:
                path.append(current)
                current = self._blocks[current].parent
            parent_key = keys[current] if current is not None else None
            for h in reversed(path):
                block = self._blocks[h]
                if parent_key is None:
                    parent_key = domain.root_key(*block.root)
                parent_key = block_keys(block.tokens, self.block_size, parent_key)[0]
                keys[h] = parent_key
            return keys[engine_hash]

        return {key_of(h) for h in self._blocks}


@dataclass(frozen=True, slots=True)
class PublisherConfig:
    """One publisher = one engine DP rank. Ports 0 pick free ones; ``replay_port=None``
    disables replay. ``version`` selects the payload and replay reply format."""

    engine: Engine = Engine.VLLM
    version: str = "0.33.0"
    topic: bytes = b""
    host: str = "127.0.0.1"
    pub_port: int = 0
    replay_port: int | None = 0
    buffer_steps: int = 10_000
    dp_rank: int = 0
    sndhwm: int = 100_000


@dataclass(slots=True)
class PublisherStats:
    sent: int = 0
    dropped: int = 0
    duplicated: int = 0
    restarts: int = 0
    replay_requests: int = 0
    replayed: int = 0
    subscriptions: int = 0
    seqs: list[int] = field(default_factory=list)


class SyntheticPublisher:
    """``async with SyntheticPublisher(config) as pub``: bound sockets and a replay server."""

    def __init__(self, config: PublisherConfig | None = None) -> None:
        self.config = config or PublisherConfig()
        self.stats = PublisherStats()
        self.seq = 0  # next seq to publish
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=self.config.buffer_steps)
        self._drop = 0
        self._duplicate = 0
        self._replay_topic = replay_has_topic(self.config.engine, self.config.version)
        self._ctx = zmq.asyncio.Context()
        self._pub: zmq.asyncio.Socket | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._sync_pub: zmq.Socket[bytes] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._subscribed = asyncio.Event()
        self.pub_port = 0
        self.replay_port: int | None = None

    def __repr__(self) -> str:
        return (
            f"SyntheticPublisher({self.config.engine.value} {self.config.version}, "
            f"pub={self.pub_port}, replay={self.replay_port}, seq={self.seq}, "
            f"sent={self.stats.sent})"
        )

    @property
    def endpoint(self) -> str:
        return f"tcp://{self.config.host}:{self.pub_port}"

    @property
    def replay_endpoint(self) -> str | None:
        return None if self.replay_port is None else f"tcp://{self.config.host}:{self.replay_port}"

    async def __aenter__(self) -> SyntheticPublisher:
        try:
            self._bind()
        except BaseException:
            self._close()
            raise
        self._tasks.append(asyncio.create_task(self._subscriptions(), name="pub-subs"))
        if self._router is not None:
            self._tasks.append(asyncio.create_task(self._serve_replay(), name="pub-replay"))
        return self

    def _bind(self) -> None:
        cfg = self.config
        pub = self._pub = self._ctx.socket(zmq.XPUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.SNDHWM, cfg.sndhwm)
        pub.setsockopt(zmq.XPUB_VERBOSE, 1)
        if cfg.pub_port:
            pub.bind(f"tcp://{cfg.host}:{cfg.pub_port}")
            self.pub_port = cfg.pub_port
        else:
            self.pub_port = pub.bind_to_random_port(f"tcp://{cfg.host}")
        self._sync_pub = zmq.Socket.shadow(pub.underlying)
        if cfg.replay_port is not None:
            router = self._router = self._ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            if cfg.replay_port:
                router.bind(f"tcp://{cfg.host}:{cfg.replay_port}")
                self.replay_port = cfg.replay_port
            else:
                self.replay_port = router.bind_to_random_port(f"tcp://{cfg.host}")

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._close()

    def _close(self) -> None:
        for sock in (self._pub, self._router):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._router = self._sync_pub = None
        if not self._ctx.closed:
            self._ctx.term()

    # ---- publishing ----

    def encode(self, events: Sequence[Event], ts: float | None = None) -> bytes:
        batch = EventBatch(
            ts=time.time() if ts is None else ts,
            events=tuple(events),
            dp_rank=self.config.dp_rank,
        )
        return encode_batch(batch, self.config.engine, self.config.version)

    def publish(self, events: Sequence[Event], ts: float | None = None) -> int:
        """Encode and publish one batch (never blocks: PUB drops at its high-water mark).
        Returns its seq."""
        return self.publish_payload(self.encode(events, ts))

    def publish_payload(self, payload: bytes) -> int:
        seq = self.seq
        self.seq += 1
        self._buffer.append((seq, payload))
        if self._drop:
            self._drop -= 1
            self.stats.dropped += 1
            return seq
        assert self._sync_pub is not None
        frames = pub_frames(self.config.topic, seq, payload)
        self._sync_pub.send_multipart(frames, copy=False)
        self.stats.sent += 1
        if self._duplicate:
            self._duplicate -= 1
            self.stats.duplicated += 1
            self._sync_pub.send_multipart(frames, copy=False)
        return seq

    def send_raw(self, frames: Sequence[bytes]) -> None:
        """Put arbitrary frames on the PUB socket (hostile input)."""
        assert self._sync_pub is not None
        self._sync_pub.send_multipart(list(frames))

    def drop_next(self, count: int = 1) -> None:
        """The next ``count`` batches are buffered for replay but never sent (a gap)."""
        self._drop += count

    def duplicate_next(self, count: int = 1) -> None:
        self._duplicate += count

    def restart(self) -> None:
        """A new engine process: seq restarts at 0 and the replay buffer is empty."""
        self.seq = 0
        self._buffer.clear()
        self.stats.restarts += 1

    def forget_buffer(self) -> None:
        """Lose the replay buffer (as if ``buffer_steps`` had overrun)."""
        self._buffer.clear()

    async def wait_subscribed(self, count: int = 1, timeout: float = 10.0) -> None:
        """Until ``count`` subscribers joined (no slow-joiner losses for them after this)."""
        async with asyncio.timeout(timeout):
            while self.stats.subscriptions < count:
                self._subscribed.clear()
                await self._subscribed.wait()

    async def _subscriptions(self) -> None:
        assert self._pub is not None
        while True:
            frames = await self._pub.recv_multipart()
            if frames and frames[0][:1] == b"\x01":
                self.stats.subscriptions += 1
            elif frames and frames[0][:1] == b"\x00":
                self.stats.subscriptions -= 1
            self._subscribed.set()

    async def _serve_replay(self) -> None:
        router = self._router
        assert router is not None
        while True:
            frames = await router.recv_multipart()
            if len(frames) < 2:
                continue
            identity, request = frames[0], frames[1:]
            try:
                start = parse_replay_request(request)
            except ValueError:
                continue
            self.stats.replay_requests += 1
            topic = self.config.topic if self._replay_topic else None
            for seq, payload in list(self._buffer):
                if seq >= start:
                    with contextlib.suppress(zmq.Again):
                        await router.send_multipart(
                            [identity, *replay_reply_frames(seq, payload, topic)]
                        )
                    self.stats.replayed += 1
            await router.send_multipart([identity, *replay_end_frames(self._replay_topic)])
