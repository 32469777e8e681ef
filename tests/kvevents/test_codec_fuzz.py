"""Fuzzing decode_batch: whatever the bytes, the result is a well-formed batch or a CodecError.

Three sources: random bytes, mutations and truncations of the golden payloads, and valid
msgpack shaped like a batch but with random values. Deterministic (derandomized) and bounded
in examples, so the file runs in a few seconds.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cortex.kvevents.codec import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CodecError,
    EventBatch,
    decode_batch,
)

pytestmark = pytest.mark.timeout(90)

FUZZ = settings(
    max_examples=400,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def _golden_payloads() -> list[bytes]:
    golden = json.loads((Path(__file__).with_name("data") / "kv_event_payloads.json").read_text())
    return [bytes.fromhex(g["payload_hex"]) for g in golden]


GOLDEN = _golden_payloads()


def decode_or_error(payload: bytes, engine: str) -> EventBatch | None:
    """Decode; a CodecError is a fine answer, any other exception fails the test."""
    try:
        batch = decode_batch(payload, engine)
    except CodecError as exc:
        # The boundary safety net must never be what produced the error.
        assert not str(exc).startswith("internal"), str(exc)
        return None
    assert_well_formed(batch)
    return batch


def assert_well_formed(batch: EventBatch) -> None:
    assert isinstance(batch.ts, float)
    assert batch.dp_rank is None or (type(batch.dp_rank) is int and batch.dp_rank >= 0)
    assert batch.skipped_unknown >= 0
    for event in batch.events:
        if isinstance(event, AllBlocksCleared):
            continue
        assert isinstance(event, BlockStored | BlockRemoved)
        assert all(type(h) in (int, bytes) for h in event.block_hashes)
        assert type(event.group_idx) is int and event.group_idx >= 0
        assert event.medium is None or type(event.medium) is str
        if isinstance(event, BlockStored):
            assert all(type(t) is int and 0 <= t < 2**32 for t in event.token_ids)
            assert type(event.block_size) is int and event.block_size >= 0
            assert event.parent_block_hash is None or type(event.parent_block_hash) in (int, bytes)


@FUZZ
@given(payload=st.binary(max_size=600), engine=st.sampled_from(["vllm", "sglang"]))
def test_random_bytes(payload: bytes, engine: str) -> None:
    decode_or_error(payload, engine)


SET_BYTES = [0x00, 0x7F, 0x80, 0x90, 0xA0, 0xC0, 0xC1, 0xC2, 0xCA, 0xCB, 0xCC, 0xCF, 0xD0, 0xD3,
             0xD9, 0xDC, 0xDD, 0xDE, 0xDF, 0xE0, 0xFF]
"""Bytes a mutation writes: msgpack's type markers at their edges, the never-used 0xC1."""


@st.composite
def mutated(draw: st.DrawFn, payloads: Sequence[bytes]) -> bytes:
    """One of ``payloads`` after 1-4 edits: a flipped bit, a byte set to a type marker, a
    truncation, an insertion, a deletion, a duplicated run (also the ingest's columnar tests)."""
    data = bytearray(draw(st.sampled_from(payloads)))
    for _ in range(draw(st.integers(1, 4))):
        position = draw(st.integers(0, max(0, len(data) - 1)))
        action = draw(st.sampled_from(["flip", "set", "truncate", "insert", "delete", "dup"]))
        if action == "flip" and data:
            data[position] ^= 1 << draw(st.integers(0, 7))
        elif action == "set" and data:
            data[position] = draw(st.sampled_from(SET_BYTES))
        elif action == "truncate":
            del data[position:]
        elif action == "insert":
            data[position:position] = draw(st.binary(min_size=1, max_size=9))
        elif action == "delete":
            del data[position : position + draw(st.integers(1, 16))]
        else:
            data[position:position] = data[position : position + draw(st.integers(1, 32))]
    return bytes(data)


@FUZZ
@given(payload=mutated(GOLDEN), engine=st.sampled_from(["vllm", "sglang"]))
def test_mutated_golden_payloads(payload: bytes, engine: str) -> None:
    decode_or_error(payload, engine)


def test_every_truncation_of_every_golden_payload() -> None:
    for payload in GOLDEN:
        for end in range(len(payload)):
            assert decode_or_error(payload[:end], "vllm") is None


# Valid msgpack, wrong shapes: random values where the codec expects particular types.
scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=True)
    | st.text(max_size=12)
    | st.binary(max_size=40)
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=5)
        | st.dictionaries(st.text(max_size=8) | st.integers(-1000, 1000), inner, max_size=4)
    ),
    max_leaves=20,
)
FIELD_NAMES = [
    "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
    "lora_name", "cache_salt", "extra_keys", "group_idx", "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window", "locality", "ownership", "session_id",
    "lookahead_token_ids", "type", "unknown",
]  # fmt: skip
TAGS = st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "Other"])
plausible = {
    "block_hashes": st.lists(st.integers(-(2**63), 2**64 - 1) | st.binary(max_size=40)),
    "parent_block_hash": st.none() | st.integers(-(2**63), 2**64 - 1),
    "token_ids": st.lists(st.integers(-5, 2**33), max_size=20),
    "block_size": st.integers(-3, 2**33),
    "medium": st.none() | st.sampled_from(["GPU", "CPU"]),
}


@st.composite
def field_value(draw: st.DrawFn, name: str) -> Any:
    if name in plausible and draw(st.booleans()):
        return draw(plausible[name])
    return draw(values)


@st.composite
def map_event(draw: st.DrawFn) -> dict[Any, Any]:
    names = draw(st.lists(st.sampled_from(FIELD_NAMES), max_size=10, unique=True))
    event: dict[Any, Any] = {name: draw(field_value(name)) for name in names}
    if draw(st.booleans()):
        event["type"] = draw(TAGS)
    return event


@st.composite
def array_event(draw: st.DrawFn) -> list[Any]:
    names = FIELD_NAMES[: draw(st.integers(0, 16))]
    return [draw(TAGS | values), *(draw(field_value(name)) for name in names)]


@st.composite
def shaped_batch(draw: st.DrawFn) -> bytes:
    events = draw(st.lists(map_event() | array_event() | values, max_size=5))
    ts = draw(st.floats(allow_nan=True) | values)
    batch = [ts, events, draw(st.none() | st.integers(-5, 2**40) | values)][
        : draw(st.integers(0, 4))
    ]
    packed: bytes = msgpack.packb(batch, use_bin_type=True)
    return packed


@FUZZ
@given(payload=shaped_batch(), engine=st.sampled_from(["vllm", "sglang"]))
def test_valid_msgpack_of_the_wrong_shape(payload: bytes, engine: str) -> None:
    decode_or_error(payload, engine)


# Nearly valid batches: every field well typed, then a few replaced by random values, so the
# fuzzing also walks the success paths and every field's own check.
valid_fields: dict[str, st.SearchStrategy[Any]] = {
    "block_hashes": st.lists(
        st.integers(-(2**63), 2**64 - 1) | st.binary(min_size=32, max_size=32)
    ),
    "parent_block_hash": st.none() | st.integers(-(2**63), 2**64 - 1),
    "token_ids": st.lists(st.integers(0, 2**32 - 1), max_size=20),
    "block_size": st.integers(0, 64),
    "lora_id": st.none() | st.integers(-5, 2**40),
    "medium": st.none() | st.sampled_from(["GPU", "CPU", "DISK"]),
    "lora_name": st.none() | st.text(max_size=5),
    "cache_salt": st.none()
    | st.text(max_size=5)
    | st.fixed_dictionaries({"cache_salt": st.text()}),
    "extra_keys": st.none()
    | st.lists(st.none() | st.tuples(st.text(max_size=3), st.integers(-1000, 2**40))),
    "group_idx": st.none() | st.integers(0, 8),
    "kv_cache_spec_kind": st.none() | st.text(max_size=5),
    "kv_cache_spec_sliding_window": st.none() | st.integers(0, 4096),
    "locality": st.none() | st.text(max_size=5),
    "ownership": st.none() | st.text(max_size=5),
    "session_id": st.none() | st.text(max_size=5),
    "lookahead_token_ids": st.none()
    | st.lists(st.lists(st.integers(0, 2**32 - 1), max_size=4), max_size=3),
}


REMOVED_NAMES = ["block_hashes", "medium", "group_idx", "locality", "ownership"]


@st.composite
def near_valid_batch(draw: st.DrawFn) -> bytes:
    events: list[Any] = []
    for _ in range(draw(st.integers(0, 4))):
        tag = draw(st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared"]))
        names = (
            FIELD_NAMES[:16] if tag == "BlockStored" else ["block_hashes", "medium", "group_idx"]
        )
        fields = {name: draw(valid_fields[name]) for name in names}
        for name in draw(st.lists(st.sampled_from(names), max_size=2)):
            fields[name] = draw(values)
        if draw(st.booleans()):
            events.append({"type": tag, **fields})
        else:
            events.append([tag, *fields.values()])
    rank = draw(st.none() | st.integers(0, 64))
    packed: bytes = msgpack.packb([draw(st.floats(0, 2e9)), events, rank], use_bin_type=True)
    return packed


@FUZZ
@given(payload=near_valid_batch(), engine=st.sampled_from(["vllm", "sglang"]))
def test_nearly_valid_batches(payload: bytes, engine: str) -> None:
    decode_or_error(payload, engine)
