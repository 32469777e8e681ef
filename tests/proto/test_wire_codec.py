"""cortex.index.wire against protobuf's own codec (upb, via the grpcio-generated module).

Differential: for any bytes, upb and wire.py agree — same decoded fields when upb parses,
``WireError`` when upb rejects — except the one documented extra rule, a ``*_le`` twin whose
length is not a whole number of items.
"""

from __future__ import annotations

import struct
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cortex.api.index.v1 import MatchRequest, MatchResponse
from cortex.index.grpcio_stubs import GrpcioStubs as Grpcio
from cortex.index.wire import (
    MatchDomain,
    MatchQuery,
    MatchReply,
    WireError,
    WorkerHit,
    decode_match_request,
    decode_match_response,
    encode_match_request,
    encode_match_response,
    match_request,
    pack_block_keys,
    pack_token_ids,
)

pytestmark = pytest.mark.timeout(60)
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MASK64 = 2**64 - 1

uint32 = st.integers(0, 2**32 - 1)
uint64 = st.integers(0, MASK64)
int32 = st.integers(-(2**31), 2**31 - 1)
# token ids as engines see them (1-3 byte varints) plus the full range (up to 5 bytes)
token = st.one_of(st.integers(0, 127), st.integers(0, 2**18), uint32)


# ---- a small independent encoder for hand-made wire variants ----------------------------


def varint(value: int) -> bytes:
    value &= MASK64
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def non_minimal(value: int) -> bytes:
    """The same value with one redundant continuation byte (still <= 10 bytes)."""
    encoded = varint(value)
    if len(encoded) >= 10:
        return encoded
    return encoded[:-1] + bytes([encoded[-1] | 0x80, 0])


def tag(field: int, wire_type: int) -> bytes:
    return varint(field << 3 | wire_type)


def ld(field: int, payload: bytes) -> bytes:
    return tag(field, 2) + varint(len(payload)) + payload


def fixed64(values: list[int]) -> bytes:
    return b"".join(v.to_bytes(8, "little") for v in values)


unknown_field = st.one_of(
    st.tuples(st.integers(12, 2**29 - 1), uint64).map(lambda t: tag(t[0], 0) + varint(t[1])),
    st.tuples(st.integers(12, 2000), st.binary(min_size=8, max_size=8)).map(
        lambda t: tag(t[0], 1) + t[1]
    ),
    st.tuples(st.integers(12, 2000), st.binary(max_size=12)).map(lambda t: ld(t[0], t[1])),
    st.tuples(st.integers(12, 2000), st.binary(min_size=4, max_size=4)).map(
        lambda t: tag(t[0], 5) + t[1]
    ),
    st.tuples(st.integers(12, 2000), uint64).map(  # a group holding one varint field
        lambda t: tag(t[0], 3) + tag(1, 0) + varint(t[1]) + tag(t[0], 4)
    ),
)

request_fragment = st.one_of(
    st.text(max_size=12).map(lambda s: ld(1, s.encode())),
    st.lists(st.one_of(token, uint64), max_size=80).map(  # > 32 bytes: the numpy path
        lambda xs: ld(2, b"".join(varint(x) for x in xs))
    ),
    st.lists(st.one_of(token, uint64), min_size=1, max_size=40).map(
        lambda xs: b"".join(tag(2, 0) + varint(x) for x in xs)
    ),
    token.map(lambda x: non_minimal(2 << 3) + varint(x)),
    st.lists(uint64, max_size=12).map(lambda ks: ld(3, fixed64(ks))),
    st.lists(uint64, min_size=1, max_size=12).map(
        lambda ks: b"".join(tag(3, 1) + fixed64([k]) for k in ks)
    ),
    st.text(max_size=8).map(lambda s: ld(4, s.encode())),
    st.tuples(st.sampled_from([5, 6]), uint64).map(lambda t: tag(t[0], 0) + varint(t[1])),
    int32.map(lambda v: tag(7, 0) + varint(v)),
    uint32.map(lambda v: non_minimal(5 << 3) + non_minimal(v)),
    st.tuples(st.sampled_from([8, 9]), st.text(max_size=8)).map(lambda t: ld(t[0], t[1].encode())),
    st.lists(token, max_size=16).map(lambda xs: ld(10, struct.pack(f"<{len(xs)}I", *xs))),
    st.lists(uint64, max_size=8).map(lambda ks: ld(11, fixed64(ks))),
    st.tuples(st.sampled_from([10, 11]), st.binary(max_size=9)).map(lambda t: ld(t[0], t[1])),
    # known fields with another wire type: unknown fields to protobuf
    st.tuples(st.sampled_from([1, 4, 10]), uint64).map(lambda t: tag(t[0], 0) + varint(t[1])),
    st.sampled_from([2, 3, 5, 7]).map(lambda field: tag(field, 5) + b"\x01\x02\x03\x04"),
    unknown_field,
)
hand_made = st.lists(request_fragment, max_size=10).map(b"".join)


def expected_query(ref: Any) -> dict[str, Any] | None:
    """What wire.py must return for an upb-parsed MatchRequest; None = WireError."""
    if len(ref.token_ids_le) % 4 or len(ref.block_keys_le) % 8:
        return None
    tokens = ref.token_ids_le
    keys = ref.block_keys_le
    return {
        "model": ref.model,
        "token_ids": list(struct.unpack(f"<{len(tokens) // 4}I", tokens))
        if tokens
        else list(ref.token_ids),
        "block_keys": list(struct.unpack(f"<{len(keys) // 8}Q", keys))
        if keys
        else list(ref.block_keys),
        "candidate_workers": tuple(ref.candidate_workers),
        "max_blocks": ref.max_blocks,
        "block_size": ref.block_size,
        "engine": ref.engine,
        "lora_name": ref.lora_name,
        "cache_salt": ref.cache_salt,
    }


def as_dict(query: MatchQuery) -> dict[str, Any]:
    return {
        "model": query.model,
        "token_ids": query.token_ids.tolist(),
        "block_keys": query.block_keys.tolist(),
        "candidate_workers": query.candidate_workers,
        "max_blocks": query.max_blocks,
        "block_size": query.block_size,
        "engine": query.engine,
        "lora_name": query.lora_name,
        "cache_salt": query.cache_salt,
    }


def assert_request_agrees(data: bytes, grpcio: Grpcio) -> None:
    try:
        ref = grpcio.pb2.MatchRequest.FromString(data)
    except DecodeError:
        with pytest.raises(WireError):
            decode_match_request(data)
        return
    want = expected_query(ref)
    if want is None:
        with pytest.raises(WireError, match="_le length"):
            decode_match_request(data)
    else:
        assert as_dict(decode_match_request(data)) == want


# ---- MatchRequest -------------------------------------------------------------------------


@SETTINGS
@given(
    model=st.text(max_size=20),
    token_ids=st.lists(token, max_size=600),
    block_keys=st.lists(uint64, max_size=64),
    candidates=st.lists(st.text(max_size=10), max_size=4),
    scalars=st.tuples(uint32, uint32, int32),
    extras=st.tuples(st.text(max_size=8), st.text(max_size=8)),
    twins=st.tuples(st.lists(token, max_size=20), st.lists(uint64, max_size=8)),
)
def test_protobuf_encoded_requests_decode_identically(
    grpcio_modules: Grpcio,
    model: str,
    token_ids: list[int],
    block_keys: list[int],
    candidates: list[str],
    scalars: tuple[int, int, int],
    extras: tuple[str, str],
    twins: tuple[list[int], list[int]],
) -> None:
    message = grpcio_modules.pb2.MatchRequest(
        model=model,
        token_ids=token_ids,
        block_keys=block_keys,
        candidate_workers=candidates,
        max_blocks=scalars[0],
        block_size=scalars[1],
        engine=scalars[2],
        lora_name=extras[0],
        cache_salt=extras[1],
        token_ids_le=struct.pack(f"<{len(twins[0])}I", *twins[0]),
        block_keys_le=fixed64(twins[1]),
    )
    data = message.SerializeToString()
    query = decode_match_request(data)
    assert as_dict(query) == expected_query(message)
    assert query.token_ids.tolist() == (twins[0] or token_ids)  # the bytes twin wins
    assert query.block_keys.tolist() == (twins[1] or block_keys)


@SETTINGS
@given(data=hand_made)
def test_hand_encoded_variants_decode_like_protobuf(grpcio_modules: Grpcio, data: bytes) -> None:
    """Unpacked and mixed repeated encodings, non-minimal varints, unknown fields, groups,
    wrong wire types, values past 32 bits, repeated singular fields (last wins)."""
    assert_request_agrees(data, grpcio_modules)


flips = st.lists(st.tuples(uint32, st.integers(0, 255)), max_size=3)


@SETTINGS
@given(data=hand_made, cut=st.integers(0, 2**16), flips=flips)
def test_corrupted_requests_fail_only_with_wire_error(
    grpcio_modules: Grpcio, data: bytes, cut: int, flips: list[tuple[int, int]]
) -> None:
    corrupted = bytearray(data[: cut % (len(data) + 1)])
    for where, value in flips:
        if corrupted:
            corrupted[where % len(corrupted)] = value
    assert_request_agrees(bytes(corrupted), grpcio_modules)


@SETTINGS
@given(data=st.binary(max_size=80))
def test_random_bytes_fail_only_with_wire_error(grpcio_modules: Grpcio, data: bytes) -> None:
    assert_request_agrees(data, grpcio_modules)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"\x12\x02\x80\x80", "truncated varint"),
        (ld(2, b"\x01" * 40 + b"\x80"), "truncated varint"),  # the numpy path
        (ld(2, b"\x01" * 40 + b"\xff" * 10 + b"\x01"), "longer than 10 bytes"),
        (b"\x12\x0b" + b"\xff" * 10 + b"\x01", "longer than 10 bytes"),
        (b"\x10" + b"\xff" * 10 + b"\x01", "longer than 10 bytes"),
        (b"\x1a\x03\x01\x02\x03", "multiple of 8"),
        (b"\x19\x01\x02", "truncated fixed64"),
        (b"\x0a\x05ab", "overruns"),
        (b"\x0a\x02\xc3\x28", "UTF-8"),
        (b"\x00\x01", "field number 0"),
        (b"\x63\x08\x01\x6c", "mismatched end-group"),
        (b"\x64", "unexpected wire type 4"),
        (b"\x0f", "unexpected wire type 7"),
        (b"\x52\x03abc", "token_ids_le length"),
        (b"\x5a\x04abcd", "block_keys_le length"),
    ],
)
def test_malformed_requests_say_why(grpcio_modules: Grpcio, data: bytes, message: str) -> None:
    with pytest.raises(WireError, match=message):
        decode_match_request(data)


def test_long_and_unpacked_token_lists(grpcio_modules: Grpcio) -> None:
    rng = np.random.default_rng(7)
    # > 64 KiB of packed varints: the one-off buffer path
    tokens = rng.integers(2**21, 2**32, 20_000, dtype=np.uint64).tolist()
    data = grpcio_modules.pb2.MatchRequest(model="m", token_ids=tokens).SerializeToString()
    assert decode_match_request(data).token_ids.tolist() == tokens
    # one tag per element, long enough for the run decoder to grow its window many times
    unpacked = b"".join(tag(2, 0) + varint(t) for t in tokens[:5000]) + ld(1, b"m")
    query = decode_match_request(unpacked)
    assert query.token_ids.tolist() == tokens[:5000]
    assert query.model == "m"
    keys = rng.integers(0, 2**63, 3000, dtype=np.uint64).tolist()
    unpacked_keys = b"".join(tag(3, 1) + fixed64([k]) for k in keys) + tag(5, 0) + varint(9)
    query = decode_match_request(unpacked_keys)
    assert query.block_keys.tolist() == keys
    assert query.max_blocks == 9


def test_threads_decode_independently(grpcio_modules: Grpcio) -> None:
    """Work buffers are per thread: concurrent decodes never see each other's data."""
    messages = [
        grpcio_modules.pb2.MatchRequest(token_ids=list(range(n, n + 3000 + 7 * n, 1 + n % 5)))
        for n in range(8)
    ]
    encoded = [m.SerializeToString() for m in messages]

    def decode_all(i: int) -> bool:
        return all(
            decode_match_request(encoded[(i + j) % 8]).token_ids.tolist()
            == list(messages[(i + j) % 8].token_ids)
            for j in range(40)
        )

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(decode_all, range(8)))


@SETTINGS
@given(
    model=st.text(max_size=12),
    keys=st.lists(uint64, max_size=64),
    tokens=st.lists(token, max_size=64),
    candidates=st.lists(st.text(max_size=6), max_size=3),
    scalars=st.tuples(uint32, uint32, st.sampled_from([0, 1, 2])),
    extras=st.tuples(st.text(max_size=6), st.text(max_size=6)),
)
def test_request_encoders_match_protobuf(
    grpcio_modules: Grpcio,
    model: str,
    keys: list[int],
    tokens: list[int],
    candidates: list[str],
    scalars: tuple[int, int, int],
    extras: tuple[str, str],
) -> None:
    kwargs: dict[str, Any] = {
        "block_keys": keys,
        "token_ids": tokens,
        "candidate_workers": candidates,
        "max_blocks": scalars[0],
        "block_size": scalars[1],
        "engine": scalars[2],
        "lora_name": extras[0],
        "cache_salt": extras[1],
    }
    data = encode_match_request(model, **kwargs)
    want = grpcio_modules.pb2.MatchRequest(
        model=model,
        candidate_workers=candidates,
        max_blocks=scalars[0],
        block_size=scalars[1],
        engine=scalars[2],
        lora_name=extras[0],
        cache_salt=extras[1],
        token_ids_le=pack_token_ids(tokens),
        block_keys_le=pack_block_keys(keys),
    )
    assert data == want.SerializeToString()  # canonical: byte for byte
    assert bytes(match_request(model, **kwargs)) == data  # the betterproto builder
    query = decode_match_request(data)
    assert query.block_keys.tolist() == keys
    assert query.token_ids.tolist() == tokens
    assert MatchQuery.from_message(MatchRequest().parse(data)) == query


def test_packers_are_little_endian() -> None:
    assert pack_token_ids([1, 2**32 - 1]) == b"\x01\0\0\0\xff\xff\xff\xff"
    assert pack_block_keys([2**64 - 2]) == b"\xfe" + b"\xff" * 7
    with pytest.raises(OverflowError):
        pack_token_ids([2**32])


# ---- MatchResponse ------------------------------------------------------------------------

hit = st.builds(
    WorkerHit,
    worker_id=st.text(max_size=12),
    matched_blocks=uint32,
    matched_tokens=uint32,
    state=st.one_of(st.integers(0, 5), int32),
    dp_rank=uint32,
)
reply = st.builds(
    MatchReply,
    matches=st.lists(hit, max_size=12),
    index_version=uint64,
    query_blocks=uint32,
    domain=st.none() | st.builds(MatchDomain, st.text(max_size=8), uint32, int32),
)


def pb2_reply(pb2: Any, value: MatchReply) -> Any:
    message = pb2.MatchResponse(
        matches=[
            pb2.WorkerMatch(
                worker_id=h.worker_id,
                matched_blocks=h.matched_blocks,
                matched_tokens=h.matched_tokens,
                state=h.state,
                dp_rank=h.dp_rank,
            )
            for h in value.matches
        ],
        index_version=value.index_version,
        query_blocks=value.query_blocks,
    )
    if value.domain is not None:
        message.domain.SetInParent()
        message.domain.model = value.domain.model
        message.domain.block_size = value.domain.block_size
        message.domain.engine = value.domain.engine
    return message


@SETTINGS
@given(value=reply)
def test_responses_round_trip_byte_identical(grpcio_modules: Grpcio, value: MatchReply) -> None:
    reference = pb2_reply(grpcio_modules.pb2, value).SerializeToString()
    assert encode_match_response(value) == reference
    decoded = decode_match_response(reference)
    assert list(decoded.matches) == list(value.matches)
    assert (decoded.index_version, decoded.query_blocks, decoded.domain) == (
        value.index_version,
        value.query_blocks,
        value.domain,
    )
    assert MatchReply.from_message(MatchResponse().parse(reference)) == decoded


@SETTINGS
@given(value=reply, cut=st.integers(0, 2**16), flip=st.tuples(uint32, st.integers(0, 255)))
def test_corrupted_responses_fail_only_with_wire_error(
    grpcio_modules: Grpcio, value: MatchReply, cut: int, flip: tuple[int, int]
) -> None:
    data = bytearray(encode_match_response(value))
    data = data[: cut % (len(data) + 1)]
    if data:
        data[flip[0] % len(data)] = flip[1]
    try:
        ref = grpcio_modules.pb2.MatchResponse.FromString(bytes(data))
    except DecodeError:
        with pytest.raises(WireError):
            decode_match_response(bytes(data))
        return
    decoded = decode_match_response(bytes(data))
    assert [tuple(h) for h in decoded.matches] == [
        (m.worker_id, m.matched_blocks, m.matched_tokens, m.state, m.dp_rank) for m in ref.matches
    ]
    assert decoded.index_version == ref.index_version
    assert decoded.query_blocks == ref.query_blocks
    if ref.HasField("domain"):
        assert decoded.domain == MatchDomain(
            ref.domain.model, ref.domain.block_size, ref.domain.engine
        )
    else:
        assert decoded.domain is None
