"""Every golden payload (real engine publisher output) decodes to its generic decode and
re-encodes byte for byte."""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest

from cortex.hashing import Engine
from cortex.kvevents.codec import (
    ENCODER_VERSIONS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    EventBatch,
    decode_batch,
    encode_batch,
)

pytestmark = pytest.mark.timeout(30)

# Field order of the spec (kv-events.md §2): the meaning of array-era positions.
STORED_ORDER = {
    "vllm": [
        "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
        "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
        "kv_cache_spec_sliding_window", "locality", "ownership", "session_id",
        "lookahead_token_ids",
    ],
    "sglang": [
        "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
        "cache_salt", "session_id", "lora_name",
    ],
}  # fmt: skip
REMOVED_ORDER = {
    "vllm": ["block_hashes", "medium", "group_idx", "locality", "ownership"],
    "sglang": ["block_hashes", "medium"],
}


def _golden_path() -> Path:
    """The engines' own encoded batches (a copy of shared/data/golden, kept with the tests
    so a clone runs them without the shared folder beside it)."""
    return Path(__file__).with_name("data") / "kv_event_payloads.json"


GOLDEN: list[dict[str, Any]] = json.loads(_golden_path().read_text())
IDS = [f"{g['engine']}-{g['version']}-{i}" for i, g in enumerate(GOLDEN)]


def _tuples(value: Any) -> Any:
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def _expected_event(raw: Any, engine: str) -> Event | None:
    """The normalized event the spec says a generic decode stands for (None: unknown tag)."""
    if isinstance(raw, list):
        tag, values = raw[0], dict(zip(_order(raw[0], engine), raw[1:], strict=False))
    else:
        values = dict(raw)
        tag = values.pop("type")
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    group = values.pop("group_idx", None)
    args = {name: _tuples(value) for name, value in values.items()}
    if tag == "BlockStored":
        return BlockStored(**args, group_idx=group or 0, group_idx_nil=group is None)
    if tag == "BlockRemoved":
        return BlockRemoved(**args, group_idx=group or 0, group_idx_nil=group is None)
    return None


def _order(tag: str, engine: str) -> list[str]:
    return STORED_ORDER[engine] if tag == "BlockStored" else REMOVED_ORDER[engine]


@pytest.mark.parametrize("golden", GOLDEN, ids=IDS)
def test_golden_payload_decodes_to_its_generic_decode(golden: dict[str, Any]) -> None:
    batch = decode_batch(bytes.fromhex(golden["payload_hex"]), golden["engine"])
    decoded = golden["decoded"]
    assert batch.ts == decoded[0]
    assert batch.dp_rank == (decoded[2] if len(decoded) > 2 else None)
    expected = [_expected_event(raw, golden["engine"]) for raw in decoded[1]]
    assert batch.skipped_unknown == expected.count(None)
    known = [event for event in expected if event is not None]
    assert len(batch.events) == len(known)
    for got, want in zip(batch.events, known, strict=True):
        assert type(got) is type(want)
        for spec in fields(want):  # field by field, wire-only flag included
            assert getattr(got, spec.name) == getattr(want, spec.name), spec.name


@pytest.mark.parametrize("golden", GOLDEN, ids=IDS)
def test_golden_payload_reencodes_byte_identically(golden: dict[str, Any]) -> None:
    payload = bytes.fromhex(golden["payload_hex"])
    batch = decode_batch(payload, golden["engine"])
    assert encode_batch(batch, golden["engine"], golden["version"]) == payload


def test_every_golden_version_has_an_encoder() -> None:
    golden_versions = {(Engine(g["engine"]), g["version"]) for g in GOLDEN}
    supported = {(engine, v) for engine, versions in ENCODER_VERSIONS.items() for v in versions}
    assert golden_versions <= supported


def test_golden_hashes_and_salt_survive_normalization() -> None:
    sglang_full = next(g for g in GOLDEN if g["engine"] == "sglang" and "full batch" in g["note"])
    batch = decode_batch(bytes.fromhex(sglang_full["payload_hex"]), Engine.SGLANG)
    first, salted = batch.events[0], batch.events[1]
    assert isinstance(first, BlockStored) and isinstance(salted, BlockStored)
    # The spec's SGLang vectors: tokens 1..48, page 16; tokens 1..16 salted "s1".
    assert first.block_hashes == (8635429971592222890, 1256577331724852459, 5689809685380680247)
    assert first.token_ids == tuple(range(1, 49)) and first.block_size == 16
    assert salted.cache_salt == "s1" and salted.block_hashes == (2241309735000630258,)


def test_vllm_033_full_batch_keeps_group_and_spec_kind() -> None:
    vllm_full = next(g for g in GOLDEN if g["engine"] == "vllm" and "full batch" in g["note"])
    batch = decode_batch(bytes.fromhex(vllm_full["payload_hex"]), Engine.VLLM)
    stored = batch.events[0]
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == (1403909460543360175, 1643945449041937783)
    assert stored.extra_keys == (None, None)
    assert (stored.group_idx, stored.group_idx_nil) == (0, False)
    assert stored.kv_cache_spec_kind == "full_attention"
    assert batch == EventBatch(ts=batch.ts, events=batch.events, dp_rank=0)
