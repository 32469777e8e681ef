"""Decoding rules, hostile input and the per-version encoder of cortex.kvevents.codec."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cortex.hashing import Engine
from cortex.kvevents.codec import (
    ENCODER_VERSIONS,
    MAX_PAYLOAD_BYTES,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CodecError,
    Event,
    EventBatch,
    decode_batch,
    encode_batch,
)

pytestmark = pytest.mark.timeout(60)


def pack(obj: Any) -> bytes:
    packed: bytes = msgpack.packb(obj, use_bin_type=True)
    return packed


def stored_map(**overrides: Any) -> dict[str, Any]:
    event = {
        "type": "BlockStored",
        "block_hashes": [11, 12],
        "parent_block_hash": None,
        "token_ids": [1, 2, 3, 4],
        "block_size": 2,
        "lora_id": None,
        "medium": "GPU",
    }
    event.update(overrides)
    return event


def nested(depth: int) -> list[Any]:
    value: list[Any] = [1]
    for _ in range(depth - 1):
        value = [value]
    return value


def batch_of(*events: Any, rank: Any = 0) -> bytes:
    return pack([1.5, list(events), rank])


# --------------------------------------------------------------------------------------------
# Decoding rules


def test_array_era_positions_past_medium_depend_on_the_engine() -> None:
    event = ["BlockStored", [7], None, [1, 2], 2, None, "GPU", "seventh"]
    vllm = decode_batch(batch_of(event), Engine.VLLM).events[0]
    sglang = decode_batch(batch_of(event), "sglang").events[0]
    assert isinstance(vllm, BlockStored) and isinstance(sglang, BlockStored)
    # Position 7 is lora_name in vLLM, cache_salt in SGLang.
    assert (vllm.lora_name, vllm.cache_salt) == ("seventh", None)
    assert (sglang.cache_salt, sglang.lora_name) == ("seventh", None)
    full = [*event, "session", "lora", "a field from the future"]
    sglang = decode_batch(batch_of(full), Engine.SGLANG).events[0]
    assert isinstance(sglang, BlockStored)
    assert (sglang.cache_salt, sglang.session_id, sglang.lora_name) == (
        "seventh",
        "session",
        "lora",
    )


def test_vllm_array_era_reads_every_positional_field() -> None:
    event = [
        "BlockStored", [1], 9, [5, 6], 2, 3, "CPU", "lora", [["mm", 4]], 2, "sliding_window",
        128, "local", "owner", "sess", [[7, 8]], "a field from the future",
    ]  # fmt: skip
    got = decode_batch(batch_of(event), Engine.VLLM).events[0]
    assert got == BlockStored(
        block_hashes=(1,),
        parent_block_hash=9,
        token_ids=(5, 6),
        block_size=2,
        lora_id=3,
        medium="CPU",
        lora_name="lora",
        extra_keys=(("mm", 4),),
        group_idx=2,
        kv_cache_spec_kind="sliding_window",
        kv_cache_spec_sliding_window=128,
        locality="local",
        ownership="owner",
        session_id="sess",
        lookahead_token_ids=((7, 8),),
    )


def test_two_element_batch_has_no_rank() -> None:
    batch = decode_batch(pack([2.0, [["AllBlocksCleared"]]]), Engine.VLLM)
    assert batch == EventBatch(ts=2.0, events=(AllBlocksCleared(),), dp_rank=None)


def test_unknown_event_tags_are_skipped_and_counted() -> None:
    payload = batch_of(
        {"type": "BlockMigrated", "block_hashes": [1], "destination": "x"},
        ["KVSnapshot", 1, 2],
        stored_map(),
        {"type": "AllBlocksCleared"},
    )
    batch = decode_batch(payload, Engine.VLLM)
    assert batch.skipped_unknown == 2
    assert [type(e) for e in batch.events] == [BlockStored, AllBlocksCleared]


def test_unknown_keys_media_and_placeholders_are_tolerated() -> None:
    payload = batch_of(
        stored_map(medium="CPU_PINNED", remaining_copy_counts=[1, 2], future={"a": 1}),
        stored_map(token_ids=[], block_size=0, group_idx=3),
        {"type": "BlockRemoved", "block_hashes": [1], "medium": "STORAGE", "new": None},
        ["AllBlocksCleared", "extra", 1],
    )
    events = decode_batch(payload, Engine.VLLM).events
    assert isinstance(events[0], BlockStored) and events[0].medium == "CPU_PINNED"
    assert isinstance(events[1], BlockStored)
    assert (events[1].token_ids, events[1].block_size, events[1].group_idx) == ((), 0, 3)
    assert events[2] == BlockRemoved(block_hashes=(1,), medium="STORAGE")
    assert events[3] == AllBlocksCleared()


def test_hashes_of_every_width_sign_and_bin() -> None:
    digest = bytes(range(32))
    hashes = [0, -1, -(2**63), 2**63 - 1, 2**64 - 1, digest]
    event = stored_map(block_hashes=hashes, parent_block_hash=digest)
    got = decode_batch(batch_of(event), Engine.VLLM).events[0]
    assert isinstance(got, BlockStored)
    assert got.block_hashes == tuple(hashes) and got.parent_block_hash == digest


def test_any_integer_width_and_map_header_is_accepted() -> None:
    # Hand-written: map32 header, block_size as uint32, ts as float32, rank as int64.
    event = (
        b"\xdf\x00\x00\x00\x05"
        + pack("type") + pack("BlockStored")
        + pack("block_hashes") + b"\x91\xd3" + (5).to_bytes(8, "big", signed=True)
        + pack("parent_block_hash") + b"\xc0"
        + pack("token_ids") + b"\x92\xce\x00\x00\x00\x01\xcd\x00\x02"
        + pack("block_size") + b"\xce\x00\x00\x00\x02"
    )  # fmt: skip
    payload = b"\x93\xca\x3f\xc0\x00\x00\xdd\x00\x00\x00\x01" + event + b"\xd3" + bytes(7) + b"\x01"
    batch = decode_batch(payload, Engine.SGLANG)
    assert batch.ts == 1.5 and batch.dp_rank == 1
    assert batch.events == (BlockStored((5,), None, (1, 2), 2),)


def test_sglang_metadata_struct_carries_the_salt() -> None:
    event = ["BlockStored", [1], None, [1, 2], 2, None, "GPU", {"cache_salt": "tenant-a"}]
    got = decode_batch(batch_of(event), Engine.SGLANG).events[0]
    assert isinstance(got, BlockStored) and got.cache_salt == "tenant-a"


def test_struct_shaped_batch_map_is_accepted() -> None:
    payload = pack({"ts": 3.0, "events": [stored_map()], "data_parallel_rank": 2})
    batch = decode_batch(payload, Engine.VLLM)
    assert batch.ts == 3.0 and batch.dp_rank == 2 and len(batch.events) == 1


# --------------------------------------------------------------------------------------------
# Hostile input: CodecError with a message, nothing else.

GOLDEN_SMALL = bytes.fromhex(
    "93cb41d954fc402000009397ab426c6f636b53746f72656492cf137bb037547f4cafd0d6c094010203040"
    "2c0a347505593ac426c6f636b52656d6f76656491d0d6a347505591b0416c6c426c6f636b73436c65617265"
    "6400"
)

HOSTILE: dict[str, tuple[bytes, str]] = {
    "empty": (b"", "empty"),
    "never-used byte": (b"\xc1", "msgpack"),
    "truncated": (GOLDEN_SMALL[:-5], "msgpack"),
    "trailing garbage": (GOLDEN_SMALL + b"\x00", "msgpack"),
    "not an array": (pack(42), "batch must be an array"),
    "one-element batch": (pack([1.0]), "got 1 element"),
    "ts is a str": (pack(["now", []]), "ts must be a float"),
    "ts is NaN": (pack([float("nan"), []]), "finite"),
    "ts is inf": (pack([float("inf"), []]), "finite"),
    "events not an array": (pack([1.0, {"a": 1}]), "events must be an array"),
    "event is an int": (batch_of(5), "event 0: event must be an array or a map"),
    "empty array event": (batch_of([]), "type tag"),
    "array tag is an int": (batch_of([1, 2]), "type tag"),
    "map event without type": (batch_of({"block_hashes": [1]}), "'type'"),
    "missing token_ids": (batch_of({"type": "BlockStored", "block_hashes": [1]}), "needs"),
    "short array store": (batch_of(["BlockStored", [1], None, [1]]), "needs"),
    "removed without hashes": (batch_of(["BlockRemoved"]), "needs block_hashes"),
    "hash is a str": (batch_of(stored_map(block_hashes=["ab"])), "block_hashes[0]"),
    "hash is a float": (batch_of(stored_map(block_hashes=[1.5])), "int or bin"),
    "hash is nil": (batch_of(stored_map(block_hashes=[1, None])), "block_hashes[1]"),
    "hash is a bool": (batch_of(stored_map(block_hashes=[True])), "got bool"),
    "hash is empty bin": (batch_of(stored_map(block_hashes=[b""])), "0 bytes"),
    "hash bin too long": (batch_of(stored_map(block_hashes=[b"x" * 65])), "65 bytes"),
    "hashes is a map": (batch_of(stored_map(block_hashes={"a": 1})), "must be an array"),
    "parent is a str": (batch_of(stored_map(parent_block_hash="p")), "parent_block_hash"),
    "token below 0": (batch_of(stored_map(token_ids=[1, -1])), "outside uint32"),
    "token above uint32": (batch_of(stored_map(token_ids=[2**32])), "outside uint32"),
    "token is a float": (batch_of(stored_map(token_ids=[1.0])), "must hold ints"),
    "token is a bool": (batch_of(stored_map(token_ids=[True])), "must hold ints"),
    "token is nil": (batch_of(stored_map(token_ids=[None])), "must hold ints"),
    "tokens is a bin": (batch_of(stored_map(token_ids=b"\x01\x02")), "must be an array"),
    "negative block_size": (batch_of(stored_map(block_size=-16)), "block_size"),
    "block_size is a str": (batch_of(stored_map(block_size="16")), "block_size"),
    "medium is an int": (batch_of(stored_map(medium=1)), "medium"),
    "lora_id is a str": (batch_of(stored_map(lora_id="x")), "lora_id"),
    "negative group_idx": (batch_of(stored_map(group_idx=-1)), "group_idx"),
    "lookahead out of range": (batch_of(stored_map(lookahead_token_ids=[[-3]])), "lookahead"),
    "lookahead is flat": (batch_of(stored_map(lookahead_token_ids=[3])), "lookahead"),
    "bigram is not a pair": (batch_of(stored_map(token_ids=[[1, 2, 3]])), "pair"),
    "bigrams do not chain": (
        batch_of(stored_map(block_hashes=[1], token_ids=[[1, 2], [3, 4]], block_size=2)),
        "share a token",
    ),
    "bigrams miss a page": (
        batch_of(stored_map(block_hashes=[1, 2], token_ids=[[1, 2], [2, 3]], block_size=2)),
        "pairs for 2 pages",
    ),
    "extra_keys is a str": (batch_of(stored_map(extra_keys="k")), "extra_keys"),
    "negative dp_rank": (batch_of(rank=-1), "dp_rank"),
    "dp_rank is a str": (batch_of(rank="0"), "dp_rank"),
    "non-UTF-8 str": (b"\x92\xcb" + bytes(8) + b"\x91\x91\xa2\xff\xfe", "msgpack"),
    "huge array32 header": (b"\xdd\xff\xff\xff\xff", "msgpack"),
    "huge str32 header": (b"\xdb\xff\xff\xff\xff", "msgpack"),
    "huge bin32 header": (b"\xc6\xff\xff\xff\xff", "msgpack"),
    "huge map32 header": (b"\xdf\xff\xff\xff\xff", "msgpack"),
    "deep nesting": (b"\x91" * 100_000 + b"\xc0", "msgpack"),
    "deep extra_keys": (
        batch_of(stored_map(extra_keys=nested(20))),
        "nested deeper",
    ),
}


@pytest.mark.parametrize(("payload", "fragment"), HOSTILE.values(), ids=HOSTILE.keys())
def test_hostile_payload_raises_codec_error(payload: bytes, fragment: str) -> None:
    with pytest.raises(CodecError) as info:
        decode_batch(payload, Engine.VLLM)
    message = str(info.value)
    assert fragment in message and "internal" not in message
    assert "\n" not in message and len(message) < 400


def test_oversized_payload_is_refused_before_parsing() -> None:
    with pytest.raises(CodecError, match="exceeds"):
        decode_batch(b"\x90" * (MAX_PAYLOAD_BYTES + 1), Engine.VLLM)


def test_wrong_argument_types_raise_codec_error() -> None:
    with pytest.raises(CodecError, match="unknown engine"):
        decode_batch(GOLDEN_SMALL, "tgi")
    with pytest.raises(CodecError, match="must be bytes"):
        decode_batch(GOLDEN_SMALL.hex(), Engine.VLLM)  # type: ignore[arg-type]


def test_buffers_other_than_bytes_decode() -> None:
    expected = decode_batch(GOLDEN_SMALL, Engine.VLLM)
    assert decode_batch(bytearray(GOLDEN_SMALL), Engine.VLLM) == expected  # type: ignore[arg-type]
    assert decode_batch(memoryview(GOLDEN_SMALL), Engine.VLLM) == expected  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------
# Encoder: per-version rules for arbitrary content

# Optional BlockStored fields each version carries, read off the engines' structs (the spec's
# field order, truncated where the golden payloads show each version ends).
_V023 = (
    "lora_id", "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
)  # fmt: skip
_SG_ARRAY = ("lora_id", "medium")
STORED_FIELDS: dict[tuple[str, str], tuple[str, ...]] = {
    ("vllm", "0.9.0"): ("lora_id",),
    ("vllm", "0.11.0"): ("lora_id", "medium"),
    ("vllm", "0.23.0"): _V023,
    ("vllm", "0.24.0"): _V023,
    ("vllm", "0.26.0"): _V023,
    ("vllm", "0.32.0"): (*_V023, "locality", "ownership", "session_id"),
    ("vllm", "0.33.0"): (*_V023, "locality", "ownership", "session_id", "lookahead_token_ids"),
    ("sglang", "0.4.7"): ("lora_id",),
    ("sglang", "0.5.9"): _SG_ARRAY,
    ("sglang", "0.5.18"): _SG_ARRAY,
    ("sglang", "0.5.20"): _SG_ARRAY,
    ("sglang", "0.5.21"): _SG_ARRAY,
    ("sglang", "0.5.22"): _SG_ARRAY,
    ("sglang", "0.5.23"): (*_SG_ARRAY, "cache_salt", "session_id", "lora_name"),
}

SUPPORTED = [(engine.value, v) for engine, versions in ENCODER_VERSIONS.items() for v in versions]


def test_field_tables_cover_every_supported_version() -> None:
    assert sorted(STORED_FIELDS) == sorted(SUPPORTED)


hashes = st.one_of(st.integers(-(2**63), 2**64 - 1), st.binary(min_size=32, max_size=32))
tokens = st.lists(st.integers(0, 2**32 - 1), max_size=40).map(tuple)
short_text = st.text(max_size=40)
optional_values: dict[str, st.SearchStrategy[Any]] = {
    "lora_id": st.none() | st.integers(-(2**31), 2**40),
    "medium": st.none() | st.sampled_from(["GPU", "CPU", "CPU_PINNED", "DISK"]),
    "lora_name": st.none() | short_text,
    "cache_salt": st.none() | st.text(max_size=300),
    "session_id": st.none() | short_text,
    "extra_keys": st.none()
    | st.lists(st.none() | st.tuples(short_text, st.integers(0, 2**40)), max_size=5).map(tuple),
    "kv_cache_spec_kind": st.none() | st.sampled_from(["full_attention", "sliding_window"]),
    "kv_cache_spec_sliding_window": st.none() | st.integers(0, 2**20),
    "locality": st.none() | short_text,
    "ownership": st.none() | short_text,
    "lookahead_token_ids": st.none() | st.lists(tokens, max_size=3).map(tuple),
}


@st.composite
def batches(draw: st.DrawFn, engine: str, version: str) -> EventBatch:
    has = STORED_FIELDS[(engine, version)]
    group_field = "group_idx" in has
    events: list[Event] = []
    for _ in range(draw(st.integers(0, 6))):
        kind = draw(st.sampled_from(["stored", "removed", "cleared"]))
        group = draw(st.none() | st.integers(0, 300)) if group_field else None
        if kind == "stored":
            extras = {name: draw(optional_values[name]) for name in has if name != "group_idx"}
            events.append(
                BlockStored(
                    block_hashes=tuple(draw(st.lists(hashes, max_size=8))),
                    parent_block_hash=draw(st.none() | hashes),
                    token_ids=draw(tokens),
                    block_size=draw(st.integers(0, 64)),
                    group_idx=group or 0,
                    group_idx_nil=group is None,
                    **extras,
                )
            )
        elif kind == "removed":
            extras = {
                name: draw(optional_values[name])
                for name in ("medium", "locality", "ownership")
                if name in has
            }
            events.append(
                BlockRemoved(
                    block_hashes=tuple(draw(st.lists(hashes, max_size=8))),
                    group_idx=group or 0,
                    group_idx_nil=group is None,
                    **extras,
                )
            )
        else:
            events.append(AllBlocksCleared())
    no_rank = (engine, version) == ("vllm", "0.9.0")
    rank = None if no_rank else draw(st.none() | st.integers(0, 1024))
    ts = draw(st.floats(0, 4e9, allow_nan=False))
    return EventBatch(ts=ts, events=tuple(events), dp_rank=rank)


@pytest.mark.parametrize(("engine", "version"), SUPPORTED)
@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])  # fmt: skip
@given(data=st.data())
def test_encode_then_decode_is_identity(engine: str, version: str, data: st.DataObject) -> None:
    batch = data.draw(batches(engine, version))
    payload = encode_batch(batch, engine, version)
    back = decode_batch(payload, engine)
    assert back == batch
    assert [getattr(e, "group_idx_nil", None) for e in back.events] == [
        getattr(e, "group_idx_nil", None) for e in batch.events
    ]
    assert encode_batch(back, engine, version) == payload


def test_map16_header_follows_the_struct_size_not_the_entry_count() -> None:
    event = BlockStored(block_hashes=(1,), parent_block_hash=None, token_ids=(1,), block_size=1)
    batch = EventBatch(ts=1.0, events=(event,), dp_rank=0)
    vllm_033 = encode_batch(batch, Engine.VLLM, "0.33.0")
    vllm_026 = encode_batch(batch, Engine.VLLM, "0.26.0")
    sglang = encode_batch(batch, Engine.SGLANG, "0.5.23")
    # 15 fields + tag in vLLM 0.33: map16 even for 9 entries; 11 + tag in 0.26: fixmap.
    assert vllm_033[11:14] == b"\xde\x00\x09"
    assert vllm_026[11] == 0x89
    assert sglang[11] == 0x86  # SGLang: medium has a default, so nil medium is omitted


def test_array_era_writes_trailing_nils() -> None:
    event = BlockRemoved(block_hashes=(5,))
    payload = encode_batch(EventBatch(1.0, (event,), None), Engine.VLLM, "0.23.0")
    assert payload.endswith(b"\x94\xacBlockRemoved\x91\x05\xc0\x00\xc0")  # medium nil, group 0


def test_encoder_refuses_what_the_version_could_not_send() -> None:
    stored = BlockStored((1,), None, (1, 2), 2, medium="GPU")
    with pytest.raises(CodecError, match="no field 'locality'"):
        encode_batch(EventBatch(1.0, (replace(stored, locality="x"),)), "vllm", "0.26.0")
    with pytest.raises(CodecError, match="no field 'cache_salt'"):
        encode_batch(EventBatch(1.0, (replace(stored, cache_salt="s"),)), "vllm", "0.33.0")
    with pytest.raises(CodecError, match="no field 'medium'"):
        encode_batch(EventBatch(1.0, (stored,)), "sglang", "0.4.7")
    with pytest.raises(CodecError, match="no field 'group_idx'"):
        encode_batch(EventBatch(1.0, (replace(stored, group_idx=1),)), "sglang", "0.5.23")
    with pytest.raises(CodecError, match="dp_rank"):
        encode_batch(EventBatch(1.0, (), dp_rank=0), "vllm", "0.9.0")
    with pytest.raises(CodecError, match="no encoder"):
        encode_batch(EventBatch(1.0, ()), "vllm", "0.25.0")
    with pytest.raises(CodecError, match="unknown engine"):
        encode_batch(EventBatch(1.0, ()), "tgi", "1.0")
    with pytest.raises(CodecError, match="cannot encode"):
        encode_batch(EventBatch(1.0, (replace(stored, lora_id=2**70),)), "vllm", "0.33.0")


def test_version_spellings_are_normalized() -> None:
    batch = EventBatch(1.0, (AllBlocksCleared(),), 0)
    reference = encode_batch(batch, Engine.VLLM, "0.33.0")
    assert encode_batch(batch, "vllm", "v0.33") == reference
    assert encode_batch(batch, Engine.VLLM, " 0.33.0 ") == reference


def test_group_idx_nil_flag_is_a_wire_detail_outside_equality() -> None:
    nil = BlockRemoved((1,), "GPU", group_idx_nil=True)
    zero = BlockRemoved((1,), "GPU")
    assert nil == zero
    batch = EventBatch(1.0, (nil,), 0)
    assert encode_batch(batch, "vllm", "0.33.0") != encode_batch(
        EventBatch(1.0, (zero,), 0), "vllm", "0.33.0"
    )
