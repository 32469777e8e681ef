"""The sim's engine model driven directly: stores, evictions, flushes, expected Cortex keys."""

from __future__ import annotations

import pytest

from cortex.hashing import Engine, HashDomain
from cortex.hashing.engines import vllm_block_hashes, vllm_event_int
from cortex.sim.cache import BlocksRemoved, BlocksStored, CacheCleared
from cortex.sim.feed import EngineCache

B = 4


def test_a_store_caches_the_full_blocks_once_and_knows_their_keys() -> None:
    cache = EngineCache(Engine.VLLM, B, 100)
    prompt = list(range(1, 18))  # 17 tokens: 4 full blocks
    [stored] = cache.store(prompt)
    assert isinstance(stored, BlocksStored) and len(stored.block_hashes) == 4
    assert stored.parent_block_hash is None and stored.token_ids == tuple(prompt[:16])
    assert cache.store(prompt) == []  # all cached
    assert cache.expected_keys("m") == set(HashDomain("m", B, Engine.VLLM).keys(prompt))
    [more] = cache.store(prompt[:16] + [7] * 4)
    assert isinstance(more, BlocksStored) and more.parent_block_hash == stored.block_hashes[-1]


def test_an_adapter_lives_in_its_own_namespace() -> None:
    cache = EngineCache(Engine.VLLM, B, 100)
    prompt = list(range(1, 9))
    cache.store(prompt)
    [stored] = cache.store(prompt, lora="a")
    assert stored.lora_name == "a" and stored.parent_block_hash is None
    domain = HashDomain("m", B, Engine.VLLM)
    assert cache.expected_keys("m") == {*domain.keys(prompt), *domain.keys(prompt, "a")}


@pytest.mark.parametrize(("engine", "removals"), [(Engine.VLLM, 2), (Engine.SGLANG, 1)])
def test_lru_leaves_make_room_one_event_per_block_or_per_chain(engine: Engine,
                                                               removals: int) -> None:
    cache = EngineCache(engine, B, 4)
    cache.store(list(range(100, 108)))  # 2 blocks, least recently used
    cache.store(list(range(200, 208)))
    events = cache.store(list(range(300, 308)))
    assert [type(e) for e in events] == [BlocksRemoved] * removals + [BlocksStored]
    assert len(cache) == 4
    domain = HashDomain("m", B, engine)
    assert cache.expected_keys("m") == {*domain.keys(list(range(200, 208))),
                                        *domain.keys(list(range(300, 308)))}
    evicted = cache.evict(1)
    assert sum(len(e.block_hashes) for e in evicted if isinstance(e, BlocksRemoved)) == 1
    assert cache.clear() == [CacheCleared()] and cache.expected_keys("m") == set()


def test_engine_hashes_are_the_engines() -> None:
    cache = EngineCache(Engine.VLLM, B, 100, hashes="engine")
    prompt = list(range(1, 9))
    [stored] = cache.store(prompt)
    assert stored.block_hashes == tuple(vllm_event_int(d) for d in vllm_block_hashes(prompt, B))


def test_a_prompt_larger_than_the_cache_is_refused() -> None:
    cache = EngineCache(Engine.VLLM, B, 2)
    with pytest.raises(ValueError, match="does not fit"):
        cache.store(list(range(12)))
    assert len(cache) == 0
