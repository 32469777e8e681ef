"""The paged prefix cache: prefix reuse, capacity, LRU leaf eviction, pinning, events."""

from __future__ import annotations

from cortex.hashing import Engine
from cortex.hashing.engines import sglang_event_int, sglang_page_hashes
from cortex.sim.cache import BlocksRemoved, BlocksStored, CacheCleared, PrefixCache, blocks_for
from cortex.sim.engine import EngineHasher

B = 4


def make(capacity: int = 16, engine: Engine = Engine.SGLANG, **kw: bool) -> PrefixCache:
    return PrefixCache(capacity, B, EngineHasher(engine, B), **kw)


def run(cache: PrefixCache, prompt: list[int], output: int = 0) -> int:
    """Admit, commit and release one request; returns its cached tokens."""
    lease = cache.admit(prompt, len(prompt) + output)
    assert lease is not None
    cache.commit(lease, prompt)
    cache.release(lease)
    return lease.cached_tokens


def test_second_request_hits_block_aligned_prefix_and_stores_once() -> None:
    cache = make()
    prompt = list(range(1, 15))  # 14 tokens: 3 full blocks
    assert run(cache, prompt) == 0
    stored = cache.drain_events()
    assert stored == [BlocksStored(
        block_hashes=tuple(sglang_event_int(d) for d in sglang_page_hashes(prompt, B)),
        parent_block_hash=None, token_ids=tuple(prompt[:12]), block_size=B)]
    assert run(cache, prompt) == 12
    assert cache.drain_events() == []
    # Shares two blocks, then diverges: new blocks chain from the shared parent.
    other = prompt[:8] + [99] * 6
    assert run(cache, other) == 8
    (event,) = cache.drain_events()
    assert isinstance(event, BlocksStored)
    assert isinstance(stored[0], BlocksStored)
    assert event.parent_block_hash == stored[0].block_hashes[1]
    assert event.token_ids == (99,) * 4


def test_last_prompt_token_is_always_computed() -> None:
    cache = make()
    prompt = list(range(1, 13))  # exactly 3 blocks
    run(cache, prompt)
    assert cache.lookup(prompt) == 8  # the engines recompute the last token
    assert run(cache, prompt) == 8


def test_eviction_takes_lru_leaves_only_when_space_is_needed() -> None:
    cache = make(capacity=6, engine=Engine.VLLM)
    a = [1] * 8 + [2] * 4 + [3]   # blocks a0 a1 a2
    b = [1] * 8 + [5] * 4 + [3]   # shares a0 a1, own leaf b2
    run(cache, a)
    run(cache, b)
    cache.drain_events()
    assert cache.cached_blocks == 4 and cache.free_blocks == 2
    # Needs 4 blocks: only 2 free, so the two LRU leaves go: a2 first, then b2 — never a
    # block with a cached child.
    c = [7] * 13
    a_hashes = cache.digests(a)
    run(cache, c)
    events = cache.drain_events()
    removed = [e for e in events if isinstance(e, BlocksRemoved)]
    assert [len(e.block_hashes) for e in removed] == [1, 1]  # vLLM: one hash per event
    assert cache.lookup(a) == 8  # the shared parents survived
    assert a_hashes[2] not in {b.digest for b in cache.blocks()}
    assert cache.cached_blocks == 5


def test_pinned_blocks_are_never_evicted_and_admission_waits() -> None:
    cache = make(capacity=4)
    held = cache.admit([1] * 13, 13)  # 4 blocks reserved
    assert held is not None
    cache.commit(held, [1] * 13)
    assert cache.admit([2] * 5, 5) is None  # nothing evictable: the caller must wait
    assert cache.pinned_blocks == 3
    cache.release(held)
    lease = cache.admit([2] * 5, 5)
    assert lease is not None  # the one unpinned LRU leaf made room
    assert cache.cached_blocks == 2
    events = cache.drain_events()
    assert any(isinstance(e, BlocksRemoved) for e in events)


def test_sglang_coalesces_a_chain_into_one_removal() -> None:
    cache = make(capacity=4, coalesce_removals=True)
    run(cache, [1] * 13)
    cache.drain_events()
    run(cache, [2] * 13)
    (removed,) = [e for e in cache.drain_events() if isinstance(e, BlocksRemoved)]
    assert len(removed.block_hashes) == 3


def test_concurrent_requests_with_the_same_new_prefix_share_blocks() -> None:
    cache = make()
    prompt = [3] * 9
    first = cache.admit(prompt, 9)
    second = cache.admit(prompt, 9)
    assert first is not None and second is not None
    assert cache.commit(first, prompt) == 2
    assert cache.commit(second, prompt) == 0  # the duplicate KV is freed, not stored twice
    assert cache.used_blocks == 2 + first.reserved + second.reserved
    cache.release(first)
    cache.release(second)
    assert cache.used_blocks == 2
    assert len([e for e in cache.drain_events() if isinstance(e, BlocksStored)]) == 1


def test_clear_refuses_while_held_and_reset_keeps_running_memory() -> None:
    cache = make()
    lease = cache.admit([1] * 9, 12)
    assert lease is not None
    cache.commit(lease, [1] * 9)
    assert cache.clear() is False
    cache.reset()
    assert cache.cached_blocks == 0 and cache.used_blocks == blocks_for(12, B)
    assert isinstance(cache.drain_events()[-1], CacheCleared)
    cache.commit(lease, [1] * 9)  # cached again after the "restart"
    (event,) = cache.drain_events()
    assert isinstance(event, BlocksStored) and event.parent_block_hash is None
    cache.release(lease)
    assert cache.clear() is True
    assert cache.drain_events() == [CacheCleared()] and cache.used_blocks == 0


def test_disabled_cache_reserves_but_never_caches() -> None:
    cache = make(enabled=False)
    assert run(cache, [1] * 9) == 0
    assert run(cache, [1] * 9) == 0
    assert cache.cached_blocks == 0 and cache.drain_events() == []


def test_lru_heap_stays_bounded_when_the_cache_never_fills() -> None:
    cache = make(capacity=10_000)
    prompt = list(range(1, 10))
    for _ in range(5_000):
        run(cache, prompt)
    assert len(cache._heap) <= 2 * cache.cached_blocks + 1024 + 1
    # Eviction order is unaffected by the rebuilds.
    cache.admit([7] * (4 * 9_999), 4 * 9_999)
    assert cache.cached_blocks == 1


def test_an_evicted_block_goes_to_the_host_tier_and_is_loaded_back() -> None:
    """GPU eviction offloads to the host pool (the host store recorded before the GPU
    removal); a later request's prefix continues there: cached, but loaded, not free."""
    from cortex.sim.host import HostPool

    cache = make(capacity=3, engine=Engine.VLLM, host=HostPool(2))  # type: ignore[arg-type]
    a = [1] * 4 + [2] * 4 + [3]  # blocks a0 a1
    run(cache, a)
    cache.drain_events()
    run(cache, [7] * 9)  # needs 3 blocks: a1 and a0 leave the GPU, into the host pool
    events = cache.drain_events()
    offloaded = {h: i for i, e in enumerate(events)
                 if isinstance(e, BlocksStored) and e.tier == "host" for h in e.block_hashes}
    evicted = {h: i for i, e in enumerate(events)
               if isinstance(e, BlocksRemoved) and e.tier == "device" for h in e.block_hashes}
    assert len(offloaded) == 2 and set(offloaded) == set(evicted)
    assert all(offloaded[h] < evicted[h] for h in offloaded)  # resolvable when it arrives
    assert cache.lookup(a) == 0 and cache.host is not None and len(cache.host) == 2
    lease = cache.admit(a, len(a))
    assert lease is not None
    assert (lease.cached_tokens, lease.loaded_tokens) == (8, 8)
    cache.commit(lease, a)  # the loaded blocks are GPU blocks again
    cache.release(lease)
    assert cache.lookup(a) == 8
    # a third block overflows the host pool (2 blocks): its LRU block is dropped
    run(cache, [9] * 9)
    removed_host = [e for e in cache.drain_events()
                    if isinstance(e, BlocksRemoved) and e.tier == "host"]
    assert removed_host and len(cache.host) == 2


def test_clearing_the_cache_drops_the_host_tier_too() -> None:
    from cortex.sim.host import HostPool

    cache = make(capacity=2, host=HostPool(4))  # type: ignore[arg-type]
    run(cache, [1] * 5)
    run(cache, [2] * 5)  # evicts the first request's block into the host pool
    assert cache.host is not None and len(cache.host) == 1
    assert cache.clear()
    assert len(cache.host) == 0 and isinstance(cache.drain_events()[-1], CacheCleared)
