"""The 2026 golden payloads (``tools/gen_golden_2026.py``: encoded by the vLLM 0.33.0 and
SGLang 0.5.23 wheels' own event classes) decode to the engines' meaning and re-encode byte
for byte."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from cortex.hashing import Engine
from cortex.kvevents.codec import BlockRemoved, BlockStored, decode_batch, encode_batch

pytestmark = pytest.mark.timeout(30)

GOLDEN: list[dict[str, Any]] = json.loads(
    (Path(__file__).with_name("data") / "kv_event_payloads_2026.json").read_text()
)
IDS = [f"{g['engine']}-{i}" for i, g in enumerate(GOLDEN)]


def _golden(engine: str, words: str) -> dict[str, Any]:
    return next(g for g in GOLDEN if g["engine"] == engine and words in g["note"])


@pytest.mark.parametrize("golden", GOLDEN, ids=IDS)
def test_2026_payload_reencodes_byte_identically(golden: dict[str, Any]) -> None:
    payload = bytes.fromhex(golden["payload_hex"])
    batch = decode_batch(payload, golden["engine"])
    assert encode_batch(batch, golden["engine"], golden["version"]) == payload


def test_vllm_lookahead_lists_are_per_block() -> None:
    batch = decode_batch(bytes.fromhex(_golden("vllm", "L=1")["payload_hex"]), Engine.VLLM)
    first, more, gone = batch.events
    assert isinstance(first, BlockStored) and isinstance(more, BlockStored)
    assert first.token_ids == tuple(range(1, 33)) and first.lookahead_token_ids == ((17,), (33,))
    assert first.lookahead == 1 and not first.bigram
    assert more.parent_block_hash == first.block_hashes[1]
    assert isinstance(gone, BlockRemoved) and gone.block_hashes == more.block_hashes
    mtp = decode_batch(bytes.fromhex(_golden("vllm", "MTP")["payload_hex"]), Engine.VLLM)
    stored = mtp.events[0]
    assert isinstance(stored, BlockStored) and stored.lookahead == 2
    assert stored.lookahead_token_ids == ((17, 18), (33, 34), (49, 50))


def test_sglang_bigram_pages_decode_to_positions_and_next_tokens() -> None:
    one = decode_batch(bytes.fromhex(_golden("sglang", "page size 1")["payload_hex"]),
                       Engine.SGLANG)
    stored = one.events[0]
    assert isinstance(stored, BlockStored) and stored.bigram and stored.block_size == 1
    assert stored.token_ids == (1, 2, 3, 4)
    assert stored.lookahead_token_ids == ((2,), (3,), (4,), (5,)) and stored.lookahead == 1
    four = decode_batch(bytes.fromhex(_golden("sglang", "page size 4")["payload_hex"]),
                        Engine.SGLANG)
    node, child = four.events
    assert isinstance(node, BlockStored) and isinstance(child, BlockStored)
    assert node.token_ids == tuple(range(1, 9)) and node.lookahead_token_ids == ((5,), (9,))
    assert child.token_ids == (9, 10, 11, 12) and child.lookahead_token_ids == ((13,),)


def test_vllm_hybrid_groups_keep_kind_and_window() -> None:
    batch = decode_batch(bytes.fromhex(_golden("vllm", "sliding-window")["payload_hex"]),
                         Engine.VLLM)
    full, window, gone = batch.events
    assert isinstance(full, BlockStored) and isinstance(window, BlockStored)
    assert (full.group_idx, full.kv_cache_spec_kind) == (0, "full_attention")
    assert (window.group_idx, window.kv_cache_spec_kind) == (1, "sliding_window")
    assert window.kv_cache_spec_sliding_window == 32 and window.block_hashes == full.block_hashes
    assert isinstance(gone, BlockRemoved) and gone.group_idx == 1
