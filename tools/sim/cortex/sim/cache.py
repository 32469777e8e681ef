"""The simulated engine's paged prefix cache: finite, LRU-evicted, pinned while in use.

Pure and synchronous. The KV pool has ``capacity`` blocks of ``block_size`` tokens. A
cached block is identified by the engine's chained block hash (digest) and hangs off its
parent block, so the cache is a tree whose paths are prompt prefixes. A request takes a
:class:`Lease`: its longest cached prefix is pinned and the blocks it still needs
(uncached prompt + its output) are reserved; :meth:`PrefixCache.commit` turns reserved
blocks into cached ones as their KV is computed; :meth:`PrefixCache.release` unpins.
Eviction takes least-recently-used *leaf* blocks that nobody pins, only when space is
needed. Every change to the set of cached blocks is recorded as a :data:`CacheEvent`.

LoRA: a request of an adapter lives in its own namespace (both engines key an adapter's
blocks apart from the base model's: vLLM puts the adapter name in every block's extra keys,
SGLang its radix key's ``extra_key``): its chain is hashed from a seed of the adapter's name,
so base and adapter prompts never share blocks, and its events name the adapter.

With a host tier (:class:`cortex.sim.host.HostPool`), an evicted block is offloaded there
(a ``tier="host"`` store recorded before the GPU removal, so a consumer can resolve it while
the GPU copy is still known), and admission continues the GPU prefix with the blocks the
host holds right after it: they count as cached (both engines report loaded-back blocks in
``cached_tokens``) and the lease's ``loaded_tokens`` says how many the prefill loads.
Speculative decoding (``lookahead`` L > 0): a block's hash also covers the next L tokens
(the hasher is given them), so a block is cached only once they exist and found only by a
sequence that has them; its stores carry them. ``match_margin``: prompt tokens at the end
that a lookup never covers (1: the engines compute the last token; SGLang EAGLE 2).
``drop_last``: vLLM EAGLE without lookahead hashes drops the last block a lookup matched
(``single_type_kv_cache_manager.py``: ``drop_eagle_block``).
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from cortex.hashing import BlockMedia, MediaSpan, media_extra_keys
from cortex.sim.host import HostBlock, HostPool

__all__ = [
    "BlockHasher",
    "BlocksRemoved",
    "BlocksStored",
    "CacheCleared",
    "CacheEvent",
    "CachedBlock",
    "Lease",
    "PrefixCache",
    "blocks_for",
]


class BlockHasher(Protocol):
    """The engine's block hash: chained digests of full blocks, and their event ids."""

    def digests(self, tokens: Sequence[int], parent: bytes | None,
                media: Mapping[int, BlockMedia] | None = None) -> list[bytes]:
        """Digests of the full blocks of ``tokens`` chained from ``parent`` (None = root);
        ``media``: media pairs of blocks (index from ``tokens[0]``) the digests cover."""
        ...

    def event_id(self, digest: bytes) -> int:
        """The integer the engine puts in its KV events for ``digest``."""
        ...


CacheTier = Literal["device", "host"]
"""Where a block is cached: GPU memory, or the host pool it was offloaded to."""


@dataclass(frozen=True, slots=True)
class BlocksStored:
    """Newly cached consecutive blocks (engine event ids), their parent and tokens."""

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    tier: CacheTier = "device"
    lora_name: str | None = None
    lookahead_token_ids: tuple[tuple[int, ...], ...] | None = None
    media: tuple[BlockMedia, ...] | None = None
    """Per block: the media pairs vLLM puts in its extra keys (``None``: no media)."""


@dataclass(frozen=True, slots=True)
class BlocksRemoved:
    """Evicted blocks (engine event ids)."""

    block_hashes: tuple[int, ...]
    tier: CacheTier = "device"


@dataclass(frozen=True, slots=True)
class CacheCleared:
    """The whole prefix cache was dropped."""


CacheEvent = BlocksStored | BlocksRemoved | CacheCleared


def _lora_seed(lora: str | None) -> bytes | None:
    """The chain seed of a LoRA adapter's namespace (``None``: the base model's root)."""
    return None if lora is None else hashlib.sha256(b"cortex-sim-lora\0" + lora.encode()).digest()


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``tokens`` tokens (a partial last block counts)."""
    return -(-tokens // block_size)


@dataclass(eq=False, slots=True)
class CachedBlock:
    """One cached block; ``refs`` = leases pinning it, ``children`` = cached blocks below."""

    digest: bytes
    event_id: int
    block_id: int
    parent: CachedBlock | None
    tokens: tuple[int, ...]
    children: int = 0
    refs: int = 0
    last_access: int = 0
    alive: bool = True
    lora: str | None = None
    lookahead: tuple[int, ...] = ()
    media: BlockMedia = ()

    def __repr__(self) -> str:
        return (
            f"CachedBlock(id={self.block_id}, hash={self.event_id}, refs={self.refs}, "
            f"children={self.children})"
        )


@dataclass(eq=False, slots=True)
class Lease:
    """A request's hold on the cache: pinned cached path plus reserved private blocks.

    ``cached_tokens`` is the prefix that was already cached at admission (tokens).
    """

    digests: list[bytes]
    blocks: list[CachedBlock] = field(default_factory=list)
    reserved: int = 0
    cached_tokens: int = 0
    loaded_tokens: int = 0
    released: bool = False
    lora: str | None = None
    media: Mapping[int, BlockMedia] = field(default_factory=dict)
    """The sequence's media pairs per block index (vLLM multimodal extra keys)."""

    @property
    def block_ids(self) -> list[int]:
        return [block.block_id for block in self.blocks]

    def __repr__(self) -> str:
        return (
            f"Lease(cached_tokens={self.cached_tokens}, pinned={len(self.blocks)}, "
            f"reserved={self.reserved}, released={self.released})"
        )


class PrefixCache:
    """A paged prefix cache of ``capacity`` blocks with LRU leaf eviction.

    ``coalesce_removals``: one :class:`BlocksRemoved` per evicted chain (SGLang evicts a
    radix node with all its pages) instead of one per block (vLLM). ``enabled=False``
    models an engine without prefix caching: capacity is still reserved, nothing is
    cached and no event is recorded.
    """

    def __init__(
        self,
        capacity: int,
        block_size: int,
        hasher: BlockHasher,
        *,
        coalesce_removals: bool = False,
        enabled: bool = True,
        host: HostPool | None = None,
        lookahead: int = 0,
        match_margin: int = 1,
        drop_last: bool = False,
    ) -> None:
        if capacity < 1 or block_size < 1:
            raise ValueError("capacity and block_size must be >= 1")
        self.lookahead = lookahead
        self.match_margin = match_margin
        self.drop_last = drop_last
        self.capacity = capacity
        self.block_size = block_size
        self.enabled = enabled
        self._hasher = hasher
        self._coalesce = coalesce_removals
        self.host = host
        self._index: dict[bytes, CachedBlock] = {}
        self._heap: list[tuple[int, int, CachedBlock]] = []
        self._clock = itertools.count(1)
        self._tiebreak = itertools.count()
        self._block_ids = itertools.count()
        self._reserved = 0
        self._leases: set[Lease] = set()
        self._events: list[CacheEvent] = []
        self.query_tokens = 0
        """Prompt tokens looked up at admission (cumulative)."""
        self.hit_tokens = 0
        """Prompt tokens found cached at admission (cumulative)."""
        self.evicted_blocks = 0

    # -- queries -----------------------------------------------------------------------

    @property
    def cached_blocks(self) -> int:
        return len(self._index)

    @property
    def used_blocks(self) -> int:
        """Cached blocks plus blocks reserved by running requests."""
        return len(self._index) + self._reserved

    @property
    def free_blocks(self) -> int:
        return self.capacity - self.used_blocks

    @property
    def pinned_blocks(self) -> int:
        return sum(1 for block in self._index.values() if block.refs)

    @property
    def active_leases(self) -> int:
        return len(self._leases)

    def digests(self, tokens: Sequence[int], lora: str | None = None,
                media: Mapping[int, BlockMedia] | None = None) -> list[bytes]:
        """Engine digests of the full blocks of a sequence that starts at the root (of
        ``lora``'s namespace); ``media``: the blocks' media pairs by block index."""
        if media:
            return self._hasher.digests(tokens, _lora_seed(lora), media)
        return self._hasher.digests(tokens, _lora_seed(lora))

    def lookup(self, tokens: Sequence[int], lora: str | None = None,
               media: Sequence[MediaSpan] = ()) -> int:
        """Cached prefix of ``tokens`` in tokens (block-aligned), without pinning;
        ``media``: the prompt's placeholder runs (see :meth:`admit`)."""
        pairs = self._media_pairs(tokens, media)
        return self._match(self.digests(tokens, lora, pairs), len(tokens)) * self.block_size

    def _media_pairs(self, prompt: Sequence[int], media: Sequence[MediaSpan]
                     ) -> dict[int, BlockMedia]:
        if not media:
            return {}
        return media_extra_keys(media, blocks_for(len(prompt), self.block_size), self.block_size)

    def blocks(self) -> Iterator[CachedBlock]:
        """Every cached block (snapshot order: insertion)."""
        return iter(list(self._index.values()))

    def contents(self) -> dict[int, tuple[int | None, tuple[int, ...]]]:
        """``event id -> (parent event id, tokens)`` of every cached block."""
        return {
            block.event_id: (block.parent.event_id if block.parent else None, block.tokens)
            for block in self._index.values()
        }

    def drain_events(self) -> list[CacheEvent]:
        """Events recorded since the last call, oldest first."""
        events, self._events = self._events, []
        return events

    # -- request lifecycle --------------------------------------------------------------

    def _match(self, digests: Sequence[bytes], prompt_len: int) -> int:
        if not self.enabled:
            return 0
        # The engines always compute the last prompt token (they need its logits).
        limit = min(len(digests), max(prompt_len - self.match_margin, 0) // self.block_size)
        matched = 0
        while matched < limit and digests[matched] in self._index:
            matched += 1
        return matched - 1 if self.drop_last and matched else matched

    def admit(self, prompt: Sequence[int], total_tokens: int, lora: str | None = None,
              media: Sequence[MediaSpan] = ()) -> Lease | None:
        """Pin the cached prefix of ``prompt`` and reserve room for ``total_tokens``.

        ``total_tokens`` = prompt + output tokens the request will hold. Evicts LRU leaves
        when space is short. Returns ``None`` (nothing changed) when even eviction cannot
        make room: the caller waits for running requests to finish. ``media``: the
        prompt's media placeholder runs (vLLM: their identifiers are in the blocks' hashes).
        """
        pairs = self._media_pairs(prompt, media)
        digests = self.digests(prompt, lora, pairs)
        matched = self._match(digests, len(prompt))
        loaded = 0
        if self.host is not None and self.enabled:
            limit = min(len(digests), max(len(prompt) - self.match_margin, 0) // self.block_size)
            loaded = self.host.run(digests, matched, limit)
        path: list[CachedBlock] = []
        for digest in digests[:matched]:
            block = self._index[digest]
            block.refs += 1
            path.append(block)
        need = max(blocks_for(max(total_tokens, len(prompt)), self.block_size) - matched, 0)
        if self.free_blocks < need:
            self._evict(need - self.free_blocks)
        if self.free_blocks < need:
            for block in path:
                self._unpin(block)
            return None
        self._reserved += need
        now = next(self._clock)
        for block in path:
            block.last_access = now
        lease = Lease(digests=digests, blocks=path, reserved=need,
                      cached_tokens=(matched + loaded) * self.block_size,
                      loaded_tokens=loaded * self.block_size, lora=lora,
                      media=pairs)
        self._leases.add(lease)
        self.query_tokens += len(prompt)
        self.hit_tokens += lease.cached_tokens
        return lease

    def commit(self, lease: Lease, tokens: Sequence[int]) -> int:
        """Cache the full blocks of ``tokens`` (the lease's sequence so far) beyond its path.

        Blocks another request cached meanwhile are shared (the lease's duplicate block is
        freed). Returns the number of blocks newly cached. Records one
        :class:`BlocksStored` for the new run.
        """
        if lease.released or not self.enabled:
            return 0
        ahead = self.lookahead
        full = max(len(tokens) - ahead, 0) // self.block_size
        if full > len(lease.digests):
            start = len(lease.digests)
            parent = lease.digests[-1] if lease.digests else _lora_seed(lease.lora)
            rest = tokens[start * self.block_size : full * self.block_size + ahead]
            later = {i - start: p for i, p in lease.media.items() if i >= start}
            lease.digests.extend(self._hasher.digests(rest, parent, later) if later
                                 else self._hasher.digests(rest, parent))
        now = next(self._clock)
        new: list[CachedBlock] = []
        for i in range(len(lease.blocks), full):
            digest = lease.digests[i]
            block = self._index.get(digest)
            if block is not None:
                block.refs += 1
                block.last_access = now
                if lease.reserved:
                    lease.reserved -= 1
                    self._reserved -= 1
                if new:  # cannot happen in a tree (a child implies its parent), but be safe
                    self._record_stored(new)
                    new = []
            else:
                if lease.reserved:
                    lease.reserved -= 1
                    self._reserved -= 1
                elif self.free_blocks < 1:
                    self._evict(1)
                    if self.free_blocks < 1:
                        break
                parent_block = lease.blocks[-1] if lease.blocks else None
                block = CachedBlock(
                    digest=digest,
                    event_id=self._hasher.event_id(digest),
                    block_id=next(self._block_ids),
                    parent=parent_block,
                    tokens=tuple(tokens[i * self.block_size : (i + 1) * self.block_size]),
                    refs=1,
                    last_access=now,
                    lora=lease.lora,
                    lookahead=tuple(tokens[(i + 1) * self.block_size :][:ahead]),
                    media=lease.media.get(i, ()),
                )
                if parent_block is not None:
                    parent_block.children += 1
                self._index[digest] = block
                new.append(block)
            lease.blocks.append(block)
        if new:
            self._record_stored(new)
        return len(new)

    def release(self, lease: Lease) -> None:
        """Unpin the lease's blocks and free its remaining reservation (idempotent)."""
        if lease.released:
            return
        lease.released = True
        self._leases.discard(lease)
        self._reserved -= lease.reserved
        lease.reserved = 0
        now = next(self._clock)
        for block in lease.blocks:
            block.last_access = now
        for block in reversed(lease.blocks):
            self._unpin(block)

    def evict(self, count: int) -> int:
        """Evict up to ``count`` unpinned LRU leaves now (memory pressure from outside the
        cache); returns how many went."""
        return self._evict(count)

    def clear(self) -> bool:
        """Drop the whole cache if no request holds any part of it; ``False`` otherwise."""
        if self._leases:
            return False
        self._drop_all()
        return True

    def reset(self) -> None:
        """Drop the whole cache unconditionally (engine restart).

        Running requests keep their memory: their pinned blocks become private
        reservations and are cached again when committed.
        """
        for lease in self._leases:
            lease.reserved += len(lease.blocks)
            self._reserved += len(lease.blocks)
            lease.blocks = []
        self._drop_all()

    # -- internals ----------------------------------------------------------------------

    def _drop_all(self) -> None:
        for block in self._index.values():
            block.alive = False
        self._index.clear()
        self._heap.clear()
        if self.host is not None:
            self.host.clear()  # SGLang's HiRadixCache.reset drops the host pool too
        if self.enabled:
            self._events.append(CacheCleared())

    def _record_stored(self, run: list[CachedBlock]) -> None:
        parent = run[0].parent
        self._events.append(BlocksStored(
            block_hashes=tuple(block.event_id for block in run),
            parent_block_hash=parent.event_id if parent is not None else None,
            token_ids=tuple(token for block in run for token in block.tokens),
            block_size=self.block_size,
            lora_name=run[0].lora,
            lookahead_token_ids=tuple(b.lookahead for b in run) if self.lookahead else None,
            media=tuple(b.media for b in run) if any(b.media for b in run) else None,
        ))

    def _unpin(self, block: CachedBlock) -> None:
        block.refs -= 1
        if block.refs == 0 and block.children == 0 and block.alive:
            self._push(block)

    def _push(self, block: CachedBlock) -> None:
        heapq.heappush(self._heap, (block.last_access, next(self._tiebreak), block))
        if len(self._heap) > 2 * len(self._index) + 1024:
            # Touches leave stale entries behind; rebuild from the live evictable leaves so
            # a cache that never fills up does not grow its heap without bound.
            self._heap = [(b.last_access, next(self._tiebreak), b) for b in self._index.values()
                          if b.refs == 0 and b.children == 0]
            heapq.heapify(self._heap)

    def _evict(self, count: int) -> int:
        """Evict up to ``count`` unpinned LRU leaves; returns how many went."""
        evicted = 0
        group: list[CachedBlock] = []
        while evicted < count and self._heap:
            stamp, _, block = heapq.heappop(self._heap)
            if (not block.alive or block.refs or block.children
                    or block.last_access != stamp):
                continue  # stale heap entry
            block.alive = False
            del self._index[block.digest]
            evicted += 1
            if self.host is not None:
                self._offload(block)
            if self._coalesce and group and group[-1].parent is block:
                group.append(block)
            else:
                if group:
                    self._events.append(BlocksRemoved(tuple(b.event_id for b in group)))
                group = [block]
            parent = block.parent
            if parent is not None:
                parent.children -= 1
                if parent.children == 0 and parent.refs == 0 and parent.alive:
                    self._push(parent)
        if group:
            self._events.append(BlocksRemoved(tuple(b.event_id for b in group)))
        self.evicted_blocks += evicted
        return evicted

    def _offload(self, block: CachedBlock) -> None:
        """Keep an evicted block in the host pool (recorded before its GPU removal)."""
        assert self.host is not None
        parent = block.parent
        new, dropped = self.host.offload(block.digest, HostBlock(
            block.event_id, parent.event_id if parent is not None else None, block.tokens,
            block.lora))
        if dropped:
            self._events.append(BlocksRemoved(tuple(b.event_id for b in dropped), "host"))
        if new:
            self._events.append(BlocksStored(
                (block.event_id,), parent.event_id if parent is not None else None,
                block.tokens, self.block_size, "host", block.lora,
                (block.lookahead,) if self.lookahead else None))

    def __repr__(self) -> str:
        return (
            f"PrefixCache(capacity={self.capacity}, block_size={self.block_size}, "
            f"cached={self.cached_blocks}, reserved={self._reserved}, "
            f"leases={len(self._leases)}, enabled={self.enabled})"
        )
