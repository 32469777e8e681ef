"""The segment cache (pure): an LRU bounded by tokens and by bytes, counting its hits."""

from __future__ import annotations

from cortex.gateway.tokens.prompt import SegmentCache


def test_the_least_recently_used_segments_go_first_when_tokens_run_out() -> None:
    cache = SegmentCache(max_tokens=5)
    cache.put(("a", False), [1, 2])
    cache.put(("b", False), [3, 4])
    assert cache.get(("a", False)) is not None  # a is now the most recent
    cache.put(("c", False), [5, 6])  # 6 tokens: b goes
    assert cache.get(("b", False)) is None
    assert list(cache.get(("a", False)) or []) == [1, 2] and cache.tokens == 4
    assert cache.lookup([("c", False), ("x", True)])[1] is None


def test_a_byte_bound_evicts_too_and_keys_differ_by_special_tokens() -> None:
    one = SegmentCache.cost(("abc", False), 3)
    cache = SegmentCache(max_tokens=1_000, max_bytes=2 * one)
    cache.put_many([(("abc", False), [1, 2, 3]), (("abc", True), [9, 1, 2, 3]),
                    (("xyz", False), [4, 5, 6])])
    assert cache.bytes <= 2 * one and len(cache) <= 2
    assert cache.get(("xyz", False)) is not None
