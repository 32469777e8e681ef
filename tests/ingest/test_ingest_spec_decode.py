"""Speculative decoding through the tracker: the 2026 golden payloads (vLLM EAGLE lookahead,
multi-module MTP, SGLang EAGLE bigram pages) become lookahead keys the gateway computes from
the prompt, the engine's own vLLM hashes check out, and a mode the spec does not announce
is an alignment failure (pure)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from cortex.hashing import Engine, HashDomain
from cortex.ingest.ops import SourceId
from cortex.ingest.tracker import SourceTracker, TrackerConfig
from cortex.kvevents.codec import BlockStored, EventBatch, encode_batch
from cortex.ledger.model import LedgerState, RemoveBlocks, Snapshot, StoreBlocks

pytestmark = pytest.mark.timeout(30)

GOLDEN: list[dict[str, Any]] = json.loads(
    (Path(__file__).parents[1] / "kvevents" / "data" / "kv_event_payloads_2026.json").read_text()
)


def _payload(engine: str, words: str) -> bytes:
    found = next(g for g in GOLDEN if g["engine"] == engine and words in g["note"])
    return bytes.fromhex(found["payload_hex"])


def _tracker(engine: Engine, block_size: int, lookahead: int | None) -> SourceTracker:
    config = TrackerConfig(engine=engine, model="m", block_size=block_size, align_every=1,
                           kv_lookahead=lookahead)
    tracker = SourceTracker(SourceId("w", 0), config)
    tracker.start()
    tracker.on_connected()
    tracker.take_ops()
    return tracker


@pytest.mark.parametrize("configured", [1, None], ids=["configured", "learned"])
def test_vllm_eagle_blocks_key_with_their_next_token(configured: int | None) -> None:
    tracker = _tracker(Engine.VLLM, 16, configured)
    tracker.on_message(0, _payload("vllm", "L=1"))
    prompt = list(range(1, 51))
    keys = HashDomain("m", 16, Engine.VLLM).keys(prompt, lookahead=1)
    assert len(keys) == 3
    ops = tracker.take_ops()
    assert ops == [StoreBlocks(HashDomain("m", 16, Engine.VLLM).root_key(lookahead=1), keys),
                   RemoveBlocks([keys[2]])]
    stats = tracker.stats
    assert stats.alignment_checks == 1 and not stats.alignment_mismatches  # real vLLM hashes
    assert tracker.state is LedgerState.READY and tracker.keymap.lookahead == 1
    # A prompt that differs in block 1's next token (the 33rd) cannot reuse block 1.
    other = HashDomain("m", 16, Engine.VLLM).keys([*prompt[:32], 999, *prompt[33:]],
                                                  lookahead=1)
    assert other[0] == keys[0] and other[1] != keys[1]


def test_mtp_keys_cover_two_lookahead_tokens() -> None:
    tracker = _tracker(Engine.VLLM, 16, 2)
    tracker.on_message(0, _payload("vllm", "MTP"))
    keys = HashDomain("m", 16, Engine.VLLM).keys(list(range(1, 51)), lookahead=2)
    ops = tracker.take_ops()
    assert [op.keys for op in ops if isinstance(op, StoreBlocks)] == [keys]
    assert not tracker.stats.alignment_mismatches


@pytest.mark.parametrize(("words", "raw", "page"), [
    ("page size 1", list(range(1, 6)), 1),
    ("page size 4", list(range(1, 14)), 4),
])
def test_sglang_bigram_pages_key_like_their_radix_match(words: str, raw: list[int],
                                                        page: int) -> None:
    tracker = _tracker(Engine.SGLANG, page, 1)
    tracker.on_message(0, _payload("sglang", words))
    domain = HashDomain("m", page, Engine.SGLANG)
    # A request's bigram key over raw tokens r0..rn matches page k iff r0..r(k+1)P agree:
    # exactly the lookahead-1 keys of the prompt.
    keys = domain.keys(raw, lookahead=1)
    stores = [op for op in tracker.take_ops() if isinstance(op, StoreBlocks)]
    assert [key for op in stores for key in op.keys] == keys
    assert tracker.state is LedgerState.READY


def test_a_mode_the_spec_does_not_announce_misaligns_with_a_metric() -> None:
    tracker = _tracker(Engine.VLLM, 16, 0)
    tracker.on_message(0, _payload("vllm", "L=1"))
    assert tracker.state is LedgerState.MISALIGNED
    assert "lookahead" in tracker.reason
    assert tracker.stats.alignment_mismatches == {"spec_decode": 1}
    assert isinstance(tracker.take_ops()[-1], Snapshot)


def test_plain_stores_after_learned_lookahead_misalign() -> None:
    tracker = _tracker(Engine.VLLM, 4, None)
    eagle = BlockStored((1,), None, (1, 2, 3, 4), 4, medium="GPU", lookahead_token_ids=((5,),))
    plain = BlockStored((2,), None, (1, 2, 3, 4), 4, medium="GPU")
    for seq, event in enumerate((eagle, plain)):
        tracker.on_message(seq, encode_batch(EventBatch(1.0, (event,), 0), "vllm", "0.33.0"))
    assert tracker.state is LedgerState.MISALIGNED
    assert tracker.stats.alignment_mismatches.get("spec_decode") == 1


def test_lookahead_that_is_not_the_next_block_is_ignored() -> None:
    tracker = _tracker(Engine.VLLM, 4, 1)
    bad = BlockStored((1, 2), None, tuple(range(1, 9)), 4, medium="GPU",
                      lookahead_token_ids=((77,), (9,)))
    tracker.on_message(0, encode_batch(EventBatch(1.0, (bad,), 0), "vllm", "0.33.0"))
    assert tracker.stats.ignored_blocks == {"lookahead_shape": 2}
    assert tracker.state is LedgerState.READY
