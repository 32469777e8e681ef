"""Tiered matching (pure): a rank's offload tiers continue its device prefix the way the
engines load blocks back, and the shared tier is one cluster-level count."""

from __future__ import annotations

import numpy as np
import pytest

from cortex.hashing import Engine, HashDomain
from cortex.ledger import LedgerState, LedgerView, Source, Tier
from cortex.ledger.match import Match
from cortex.ledger.tiers import continuation

pytestmark = pytest.mark.timeout(10)

DOMAIN = HashDomain("m", 4, Engine.VLLM)
ROOT = DOMAIN.root_key()
KEYS = [101, 102, 103, 104, 105, 106, 107, 108]
W = Source("w")
HOST, DISK, SHARED = W.in_tier(Tier.HOST), W.in_tier(Tier.DISK), W.in_tier(Tier.SHARED)


def held(rows: list[str]) -> np.ndarray:
    """Rows of "HD" flags: H = host holds the block, D = disk holds it."""
    return np.array([[("H" in r), ("D" in r)] for r in rows], np.bool_)


@pytest.mark.parametrize(
    ("device", "rows", "expected"),
    [
        (0, ["H", "H", "D", "", "H"], [2, 1]),  # a block nobody holds ends the run
        (2, ["H", "H", "HD", "D"], [1, 1]),  # after the device prefix; host before disk
        (4, ["H", "H"], [0, 0]),  # the device prefix covers everything held
        (1, ["", "", "H"], [0, 0]),  # block 1 is missing: nothing after it counts
    ],
)
def test_continuation(device: int, rows: list[str], expected: list[int]) -> None:
    assert continuation(device, held(rows), [Tier.HOST, Tier.DISK]) == expected


def view() -> LedgerView:
    v = LedgerView()
    for source in (W, HOST, DISK, SHARED, Source("x")):
        v.attach(source, DOMAIN, LedgerState.READY)
    return v


def counts(v: LedgerView, keys: list[int] = KEYS) -> dict[Source, int]:
    return {s: blocks for s, blocks, _ in v.match(DOMAIN, keys, 1)}


def test_host_and_disk_continue_the_device_prefix() -> None:
    v = view()
    v.store(W, ROOT, KEYS[:2], 0)
    v.store(HOST, ROOT, KEYS[:3], 0)
    v.store(DISK, KEYS[2], KEYS[3:5], 0)
    v.store(W, KEYS[4], KEYS[5:6], 0)  # a device block after the run: not loaded from there
    v.store(SHARED, ROOT, KEYS[:7], 0)
    got = counts(v)
    assert (got[W], got[HOST], got[DISK]) == (2, 1, 2)
    assert got[SHARED] == 7 and Match.of(v.match(DOMAIN, KEYS, 2), 0, len(KEYS)).shared_blocks == 7
    assert got[Source("x")] == 0


def test_an_offload_tier_not_ready_adds_nothing() -> None:
    v = view()
    v.store(HOST, ROOT, KEYS[:3], 0)
    v.store(DISK, KEYS[2], KEYS[3:5], 0)
    v.attach(HOST, DOMAIN, LedgerState.STALE, "gap")
    got = counts(v)
    assert (got[W], got[HOST], got[DISK]) == (0, 0, 0)  # disk alone cannot start at block 0
    v.attach(SHARED, DOMAIN, LedgerState.SYNCING)
    v.store(SHARED, ROOT, KEYS[:2], 0)
    assert Match.of(v.match(DOMAIN, KEYS, 2), 0, len(KEYS)).shared_blocks == 0


def test_removing_from_one_tier_keeps_the_others() -> None:
    v = view()
    v.store(W, ROOT, KEYS[:4], 0)
    v.store(HOST, ROOT, KEYS[:4], 0)
    v.remove(W, KEYS[2:4])  # evicted from the GPU, still in host memory
    got = counts(v)
    assert (got[W], got[HOST]) == (2, 2)
    v.clear(HOST)
    got = counts(v)
    assert (got[W], got[HOST]) == (2, 0)


def test_a_view_knows_whether_its_domain_has_a_shared_tier() -> None:
    v = view()
    v.store(SHARED, ROOT, KEYS[:3], 0)
    assert v.has_shared_tier(DOMAIN)
    assert Match.of(v.match(DOMAIN, KEYS, 2), 0, len(KEYS),
                    shared_tier=v.has_shared_tier(DOMAIN)).shared_blocks == 3
    v.detach(SHARED)  # the cached roster goes with it
    assert not v.has_shared_tier(DOMAIN)
    assert not v.has_shared_tier(HashDomain("other", 4, Engine.VLLM))
    assert Match.of(v.match(DOMAIN, KEYS, 3), 0, len(KEYS),
                    shared_tier=v.has_shared_tier(DOMAIN)).shared_blocks == 0
