"""vLLM multimodal stores through the tracker: the ``(identifier, offset)`` pairs in
``BlockStored.extra_keys`` (shaped as vLLM 0.32 publishes them, from its own code's golden
vectors) key the blocks exactly as the gateway keys the expanded prompt (pure)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from cortex.hashing import (
    Engine,
    HashDomain,
    MediaSpan,
    media_block_keys,
    media_extra_keys,
)
from cortex.ingest.ops import SourceId
from cortex.ingest.tracker import SourceTracker, TrackerConfig
from cortex.kvevents.codec import BlockStored, EventBatch, encode_batch
from cortex.ledger.model import StoreBlocks

pytestmark = pytest.mark.timeout(30)

REFERENCE = json.loads((Path(__file__).parents[1] / "chat" / "data"
                        / "media_vllm_reference.json").read_text())
DOMAIN = HashDomain("m", 16, Engine.VLLM)


def _tracker() -> SourceTracker:
    tracker = SourceTracker(SourceId("w", 0), TrackerConfig(engine=Engine.VLLM, model="m",
                                                            block_size=16))
    tracker.start()
    tracker.on_connected()
    tracker.take_ops()
    return tracker


def _store(row: dict[str, Any], extra_keys: list[Any], lora: str | None = None) -> bytes:
    blocks = len(row["tokens"]) // 16
    extras: list[tuple[object, ...] | None] = [
        None if e is None else tuple(tuple(p) for p in e) for e in extra_keys]
    if lora is not None:
        extras = [(lora, *(e or ())) for e in extras]
    event = BlockStored(block_hashes=tuple(row["event_ints"]), parent_block_hash=None,
                        token_ids=tuple(row["tokens"][: blocks * 16]), block_size=16,
                        medium="GPU", lora_name=lora, extra_keys=tuple(extras))
    return encode_batch(EventBatch(ts=1.0, events=(event,)), Engine.VLLM, "0.33.0")


@pytest.mark.parametrize("row", REFERENCE["blocks"], ids=lambda r: r["name"])
def test_media_stores_key_like_the_gateway(row: dict[str, Any]) -> None:
    tracker = _tracker()
    tracker.on_message(0, _store(row, row["event_extra_keys"]))
    spans = [MediaSpan(i, off, n) for i, off, n in row["spans"]]
    blocks = len(row["tokens"]) // 16
    keys = media_block_keys(row["tokens"], 16, DOMAIN.root_key(),
                            media_extra_keys(spans, blocks, 16))
    assert tracker.take_ops() == [StoreBlocks(DOMAIN.root_key(), keys)]
    plain = DOMAIN.keys(row["tokens"])
    first = spans[0].offset // 16  # blocks before the first run keep their plain keys
    assert keys[:first] == plain[:first] and keys[first] != plain[first]


def test_media_under_a_lora_adapter_and_foreign_extras() -> None:
    row = REFERENCE["blocks"][0]
    tracker = _tracker()
    tracker.on_message(0, _store(row, row["event_extra_keys"], lora="sql"))
    spans = [MediaSpan(i, off, n) for i, off, n in row["spans"]]
    keys = media_block_keys(row["tokens"], 16, DOMAIN.root_key("sql"),
                            media_extra_keys(spans, 2, 16))
    assert tracker.take_ops() == [StoreBlocks(DOMAIN.root_key("sql"), keys)]
    # a prompt-embeds digest (bytes) is nothing the gateway can reproduce: not keyed
    other = _tracker()
    other.on_message(0, _store(row, [[[b"\x01" * 32]], None]))
    assert other.take_ops() == []
