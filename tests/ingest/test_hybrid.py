"""Hybrid models through the tracker: the full-attention group is the prefix ledger and a
block is credited only while the other groups hold it (golden vLLM 0.33 payloads, pure)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from cortex.hashing import Engine, HashDomain
from cortex.index.prefix_index import PrefixIndex
from cortex.ingest.ops import SourceId
from cortex.ingest.tracker import SourceTracker, TrackerConfig
from cortex.kvevents.codec import BlockRemoved, BlockStored, EventBatch, encode_batch
from cortex.ledger.model import LedgerState, LedgerUpdate, RemoveBlocks, Source, StoreBlocks

pytestmark = pytest.mark.timeout(30)

GOLDEN: list[dict[str, Any]] = json.loads(
    (Path(__file__).parents[1] / "kvevents" / "data" / "kv_event_payloads_2026.json").read_text()
)
DOMAIN = HashDomain("m", 16, Engine.VLLM)
KEYS = DOMAIN.keys(list(range(1, 49)))


def _payload(words: str) -> bytes:
    found = next(g for g in GOLDEN if g["engine"] == "vllm" and words in g["note"])
    return bytes.fromhex(found["payload_hex"])


def _tracker() -> SourceTracker:
    tracker = SourceTracker(SourceId("w", 0), TrackerConfig(engine=Engine.VLLM, model="m",
                                                            block_size=16))
    tracker.start()
    tracker.take_ops()
    return tracker


def _credited(tracker: SourceTracker) -> list[int]:
    snapshot = tracker.snapshot()
    assert snapshot is not None
    return list(snapshot.keys)


def _encode(*events: BlockStored | BlockRemoved) -> bytes:
    return encode_batch(EventBatch(1.0, events, 0), "vllm", "0.33.0")


def test_a_sliding_window_eviction_takes_the_full_attention_credit_back() -> None:
    tracker = _tracker()
    tracker.on_message(0, _payload("sliding-window"))
    ops = tracker.take_ops()
    # group 0 stored first (credited, then held back when group 1 revealed a hybrid
    # model), group 1 confirmed all three, then evicted block 2
    assert _credited(tracker) == KEYS[:2]
    assert ops[-1] == RemoveBlocks([KEYS[2]])
    assert any(isinstance(op, StoreBlocks) and op.keys == KEYS for op in ops)
    assert tracker.keymap.hybrid is not None and tracker.keymap.hybrid.kinds == {
        0: None, 1: "sliding_window"}
    assert tracker.state is LedgerState.READY


def test_a_mamba_group_confirms_then_a_clear_drops_everything() -> None:
    tracker = _tracker()
    tracker.on_message(0, _payload("Mamba"))
    assert _credited(tracker) == []  # AllBlocksCleared ends the batch
    assert tracker.stats.clears.get("all_blocks_cleared") == 1


def test_full_attention_blocks_wait_for_the_other_group() -> None:
    tracker = _tracker()
    tokens = tuple(range(1, 49))
    window = BlockStored((1, 2, 3), None, tokens, 16, medium="GPU", group_idx=1,
                         kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=32)
    tracker.on_message(0, _encode(window))
    assert _credited(tracker) == []  # no full-attention group yet: nothing to credit
    full = BlockStored((1, 2, 3), None, tokens, 16, medium="GPU", group_idx=0,
                       kv_cache_spec_kind="full_attention")
    more = BlockStored((4,), 3, tuple(range(49, 65)), 16, medium="GPU", group_idx=0,
                       kv_cache_spec_kind="full_attention")
    tracker.on_message(1, _encode(full, more))
    all_keys = DOMAIN.keys(list(range(1, 65)))
    assert _credited(tracker) == all_keys[:3]  # block 4: group 1 does not hold it (yet)
    assert tracker.stats.ignored_blocks.get("hybrid_unconfirmed") == 1
    tracker.on_message(2, _encode(BlockStored((4,), 3, tuple(range(49, 65)), 16, medium="GPU",
                                              group_idx=1, kv_cache_spec_kind="sliding_window")))
    assert _credited(tracker) == all_keys
    tracker.on_message(3, _encode(BlockRemoved((1,), "GPU", group_idx=0)))
    assert _credited(tracker) == all_keys[1:]  # the index's match stops at the gap


def test_a_group_of_another_block_size_caps_the_credit_at_nothing() -> None:
    tracker = _tracker()
    tokens = tuple(range(1, 49))
    full = BlockStored((1, 2, 3), None, tokens, 16, medium="GPU", group_idx=0,
                       kv_cache_spec_kind="full_attention")
    mamba = BlockStored((9,), None, tokens, 48, medium="GPU", group_idx=1,
                        kv_cache_spec_kind="mamba")
    tracker.on_message(0, _encode(full, mamba))
    assert _credited(tracker) == []
    assert tracker.stats.ignored_blocks.get("hybrid_block_size") == 1
    assert tracker.state is LedgerState.READY


@pytest.mark.parametrize(("words", "held"), [("sliding-window", 2), ("Mamba", 0)])
def test_golden_hybrid_batches_through_the_index_match(words: str, held: int) -> None:
    tracker = SourceTracker(SourceId("w", 0), TrackerConfig(engine=Engine.VLLM, model="m",
                                                            block_size=16))
    tracker.start()
    tracker.on_message(0, _payload(words))
    index = PrefixIndex()
    for seq, op in enumerate(tracker.take_ops(), start=1):
        index.apply(LedgerUpdate(Source("w", 0), DOMAIN, 1, seq, op))
    answer = index.match("m", block_keys=KEYS, block_size=16, engine=Engine.VLLM)
    assert answer.blocks_of("w") == held
