"""Memory tiers at ingest (pure): the engines' media names, offload stores with and without
tokens, removals per medium, clears, and each tier as a source of its own."""

from __future__ import annotations

from itertools import count

import pytest

from cortex.hashing import Engine, HashDomain
from cortex.ingest.media import tier_of
from cortex.ingest.ops import SourceId
from cortex.ingest.tracker import SourceTracker, TrackerConfig
from cortex.kvevents.codec import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    EventBatch,
    encode_batch,
)
from cortex.ledger.model import (
    ClearBlocks,
    LedgerState,
    RemoveBlocks,
    RemoveSource,
    SetState,
    Snapshot,
    StoreBlocks,
    Tier,
)

pytestmark = pytest.mark.timeout(10)

BS = 4
TOKENS = list(range(1, 13))  # three blocks of 4
_ts = count(1)
_seq = count(0)


def domain(engine: Engine) -> HashDomain:
    return HashDomain("m", BS, engine)


def tracker(engine: Engine = Engine.VLLM) -> SourceTracker:
    cfg = TrackerConfig(engine=engine, model="m", block_size=BS, align_every=0)
    t = SourceTracker(SourceId("w", 0), cfg)
    t.start()
    t.on_connected()
    t.take_ops()
    return t


def feed(t: SourceTracker, *events: Event) -> None:
    version = "0.33.0" if t.config.engine is Engine.VLLM else "0.5.23"
    batch = EventBatch(ts=float(next(_ts)), events=tuple(events), dp_rank=0)
    t.on_message(t.expected or 0, encode_batch(batch, t.config.engine, version))


def stored(hashes: list[int], tokens: list[int], parent: int | None = None,
           medium: str | None = "GPU", block_size: int = BS) -> BlockStored:
    return BlockStored(tuple(hashes), parent, tuple(tokens), block_size, medium=medium)


@pytest.mark.parametrize(
    ("medium", "tier"),
    [(None, Tier.DEVICE), ("GPU", Tier.DEVICE), ("CPU", Tier.HOST),
     ("CPU_PINNED", Tier.HOST), ("STORAGE", Tier.DISK), ("DISK", Tier.DISK),
     ("EXTERNAL", Tier.SHARED), ("cpu_pinned", Tier.HOST), ("TAPE", None)],
)
def test_engine_media_names_map_to_tiers(medium: str | None, tier: Tier | None) -> None:
    assert tier_of(medium) is tier


def test_sglang_hicache_host_store_is_its_own_source() -> None:
    """SGLang backs a node up to host memory with its tokens (HiCache write-through), then
    evicts the device copy: the host tier keeps it, the device ledger drops it."""
    t = tracker(Engine.SGLANG)
    keys = domain(Engine.SGLANG).keys(TOKENS[:8])
    feed(t, stored([1, 2], TOKENS[:8]), stored([1, 2], TOKENS[:8], medium="CPU_PINNED"),
         BlockRemoved((2,), "GPU"))
    assert t.take_ops() == [StoreBlocks(domain(Engine.SGLANG).root_key(), keys),
                            RemoveBlocks([keys[1]])]
    host = t.take_tier_ops()
    assert host == {Tier.HOST: [Snapshot([], [], LedgerState.READY, "live (no replay endpoint)"),
                                StoreBlocks(domain(Engine.SGLANG).root_key(), keys)]}
    snap = t.snapshot(Tier.HOST)
    assert snap is not None and snap.keys == keys
    assert t.snapshot(Tier.DISK) is None  # never announced
    assert t.tiers == [Tier.HOST]


def test_vllm_offload_placeholder_resolves_hashes_the_worker_computed() -> None:
    """vLLM's offloading connector publishes ``token_ids=[]``, no parent: each hash is a
    block the GPU ledger knows; an unknown one is counted, never guessed."""
    t = tracker()
    keys = domain(Engine.VLLM).keys(TOKENS)
    root = domain(Engine.VLLM).root_key()
    feed(t, stored([1, 2, 3], TOKENS), stored([1, 2, 99], [], medium="CPU", block_size=0))
    ops = t.take_tier_ops()[Tier.HOST]
    assert ops[1:] == [StoreBlocks(root, keys[:2])]
    assert t.stats.ignored_blocks == {"unresolved_offload": 1}
    # the GPU evicts block 2, the CPU still has it: the host ledger resolves a later store
    feed(t, BlockRemoved((1, 2, 3), "GPU"), stored([3], [], medium="CPU", block_size=BS))
    assert t.take_tier_ops() == {}  # hash 3 left the GPU ledger before the CPU store came
    assert t.stats.ignored_blocks == {"unresolved_offload": 2}
    feed(t, BlockRemoved((2,), "CPU"))
    assert t.take_tier_ops() == {Tier.HOST: [RemoveBlocks([keys[1]])]}
    assert t.take_ops() == [StoreBlocks(root, keys), RemoveBlocks(keys)]


def test_offload_block_size_other_than_the_domain_is_ignored_not_misaligned() -> None:
    t = tracker()
    feed(t, stored([1, 2], TOKENS[:8]), stored([2], [], medium="CPU", block_size=2 * BS),
         stored([5], TOKENS[:8], medium="CPU", block_size=2 * BS))
    assert t.state is LedgerState.READY
    assert t.stats.ignored_blocks == {"offload_block_size": 2}
    assert t.take_tier_ops() == {}


def test_removal_names_its_medium_and_clears_and_states_reach_every_tier() -> None:
    t = tracker(Engine.SGLANG)
    keys = domain(Engine.SGLANG).keys(TOKENS[:4])
    feed(t, stored([1], TOKENS[:4]), stored([1], TOKENS[:4], medium="DISK"),
         BlockRemoved((1,), "DISK"))
    assert t.take_ops()[-1] == StoreBlocks(domain(Engine.SGLANG).root_key(), keys)
    assert t.take_tier_ops()[Tier.DISK][-1] == RemoveBlocks(keys)
    assert t.snapshot().keys == keys  # type: ignore[union-attr]
    feed(t, stored([1], TOKENS[:4], medium="CPU_PINNED"), AllBlocksCleared())
    assert t.take_ops() == [ClearBlocks("all_blocks_cleared")]
    assert t.take_tier_ops()[Tier.HOST][-1] == ClearBlocks("all_blocks_cleared")
    assert t.keymap.blocks == 0
    t.remove("lease lost")
    removed = SetState(LedgerState.REMOVED, "lease lost")
    assert t.take_ops() == [removed, RemoveSource("lease lost")]
    assert t.take_tier_ops() == {Tier.DISK: [removed, RemoveSource("lease lost")],
                                 Tier.HOST: [removed, RemoveSource("lease lost")]}


def test_unknown_medium_is_counted_and_changes_nothing() -> None:
    t = tracker()
    feed(t, stored([1], TOKENS[:4], medium="TAPE"), BlockRemoved((1,), "TAPE"))
    assert t.take_ops() == [] and t.take_tier_ops() == {}
    assert t.stats.ignored_blocks == {"medium": 2}
