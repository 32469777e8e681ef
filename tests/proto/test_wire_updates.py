"""cortex.index.wire's UpdateBatch decoder against protobuf's own codec (upb, via the
grpcio-generated module) and betterproto's encoder.

Differential: for any bytes, upb and the decoder agree — the same fields when upb parses,
``WireError`` when upb rejects. Semantic checks (``*_le`` lengths, enum values, snapshot
shapes) are the index's, per update: the decoder keeps what was sent.
"""

from __future__ import annotations

from array import array
from typing import Any

import betterproto
import numpy as np
import pytest
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cortex.api.index import v1 as pb
from cortex.index.grpcio_stubs import GrpcioStubs as Grpcio
from cortex.index.wire import (
    WireBatch,
    WireClear,
    WireDomain,
    WireError,
    WireRemove,
    WireRemoveSource,
    WireSetState,
    WireSnapshot,
    WireSource,
    WireStore,
    WireUpdate,
    decode_update_batch,
)

pytestmark = pytest.mark.timeout(60)
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MASK64 = 2**64 - 1

uint32 = st.integers(0, 2**32 - 1)
uint64 = st.integers(0, MASK64)
int32 = st.integers(-(2**31), 2**31 - 1)
text = st.text(max_size=10)
key_list = st.lists(uint64, max_size=12)


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


def unknown(low: int) -> st.SearchStrategy[bytes]:
    """An unknown field numbered from ``low`` on, of any wire type (groups included)."""
    number = st.integers(low, 2000)
    return st.one_of(
        st.tuples(st.integers(low, 2**29 - 1), uint64).map(
            lambda t: tag(t[0], 0) + varint(t[1])
        ),
        st.tuples(number, st.binary(min_size=8, max_size=8)).map(lambda t: tag(t[0], 1) + t[1]),
        st.tuples(number, st.binary(max_size=12)).map(lambda t: ld(t[0], t[1])),
        st.tuples(number, st.binary(min_size=4, max_size=4)).map(lambda t: tag(t[0], 5) + t[1]),
        st.tuples(number, uint64).map(
            lambda t: tag(t[0], 3) + tag(1, 0) + varint(t[1]) + tag(t[0], 4)
        ),
    )


def repeated_keys(field: int) -> st.SearchStrategy[bytes]:
    """One occurrence of ``repeated fixed64`` field ``field``: packed, or unpacked elements."""
    return st.one_of(
        key_list.map(lambda ks: ld(field, fixed64(ks))),
        st.lists(uint64, min_size=1, max_size=6).map(
            lambda ks: b"".join(tag(field, 1) + fixed64([k]) for k in ks)
        ),
        uint64.map(lambda k: non_minimal(field << 3 | 1) + fixed64([k])),
    )


def fragments(*parts: st.SearchStrategy[bytes], low: int) -> st.SearchStrategy[bytes]:
    """A message: any sequence of its field occurrences and unknown fields."""
    return st.lists(st.one_of(*parts, unknown(low)), max_size=6).map(b"".join)


def string_field(field: int) -> st.SearchStrategy[bytes]:
    return text.map(lambda s: ld(field, s.encode()))


def varint_field(field: int, values: st.SearchStrategy[int]) -> st.SearchStrategy[bytes]:
    return st.tuples(values, st.booleans()).map(
        lambda t: (non_minimal(field << 3) if t[1] else tag(field, 0)) + varint(t[0])
    )


def wrong_type(fields: list[int]) -> st.SearchStrategy[bytes]:
    """A known field with another wire type: an unknown field to protobuf."""
    return st.sampled_from(fields).map(lambda f: tag(f, 5) + b"\x01\x02\x03\x04")


source_bytes = fragments(
    string_field(1), varint_field(2, uint64), wrong_type([1, 2]), low=3
)
domain_bytes = fragments(
    string_field(1), varint_field(2, uint64), varint_field(3, int32), wrong_type([1, 3]), low=4
)
store_bytes = fragments(
    uint64.map(lambda k: tag(1, 1) + fixed64([k])),
    repeated_keys(2),
    st.binary(max_size=20).map(lambda b: ld(3, b)),  # any length: checked by the index
    wrong_type([1, 2, 3]),
    low=4,
)
remove_bytes = fragments(
    repeated_keys(1), st.binary(max_size=20).map(lambda b: ld(2, b)), low=3
)
reason_bytes = fragments(string_field(1), wrong_type([1]), low=2)
state_bytes = fragments(varint_field(1, int32), string_field(2), low=3)
snapshot_bytes = fragments(
    repeated_keys(1),
    repeated_keys(2),
    key_list.map(lambda ks: ld(3, fixed64(ks))),
    st.binary(max_size=20).map(lambda b: ld(4, b)),
    varint_field(5, st.one_of(st.integers(0, 6), int32)),
    string_field(6),
    low=7,
)
op_bytes = st.one_of(
    store_bytes.map(lambda b: ld(10, b)),
    remove_bytes.map(lambda b: ld(11, b)),
    reason_bytes.map(lambda b: ld(12, b)),
    state_bytes.map(lambda b: ld(13, b)),
    snapshot_bytes.map(lambda b: ld(14, b)),
    reason_bytes.map(lambda b: ld(15, b)),
)
update_bytes = st.lists(
    st.one_of(
        source_bytes.map(lambda b: ld(1, b)),
        domain_bytes.map(lambda b: ld(2, b)),
        varint_field(3, uint64),
        varint_field(4, uint64),
        op_bytes,  # several: the same member merges, another one replaces it
        wrong_type([1, 3, 10, 14]),
        unknown(16),
    ),
    max_size=8,
).map(b"".join)
batch_bytes = st.lists(
    st.one_of(
        update_bytes.map(lambda b: ld(2, b)),
        string_field(1),
        wrong_type([1, 2]),
        unknown(3),
    ),
    max_size=6,
).map(b"".join)


# ---- comparing upb's parse with the decoder's records -----------------------------------


def upb_op(name: str, m: Any) -> tuple[Any, ...]:
    if name == "store":
        return (m.parent_key, list(m.keys), m.keys_le)
    if name == "remove":
        return (list(m.keys), m.keys_le)
    if name == "state":
        return (m.state, m.reason)
    if name == "snapshot":
        return (list(m.parent_keys), list(m.keys), m.parent_keys_le, m.keys_le, m.state,
                m.reason)
    return (m.reason,)  # clear, remove_source


def upb_batch(message: Any) -> tuple[Any, ...]:
    updates = []
    for u in message.updates:
        op = u.WhichOneof("op")
        updates.append((
            (u.source.worker_id, u.source.dp_rank) if u.HasField("source") else None,
            (u.domain.model, u.domain.block_size, u.domain.engine)
            if u.HasField("domain") else None,
            u.epoch,
            u.seq,
            op or "none",
            upb_op(op, getattr(u, op)) if op else None,
        ))
    return message.ingest_id, updates


def wire_op(op: Any) -> tuple[Any, ...]:
    if isinstance(op, WireStore):
        return (op.parent_key, op.keys.tolist(), op.keys_le)
    if isinstance(op, WireRemove):
        return (op.keys.tolist(), op.keys_le)
    if isinstance(op, WireSetState):
        return (op.state, op.reason)
    if isinstance(op, WireSnapshot):
        return (op.parent_keys.tolist(), op.keys.tolist(), op.parent_keys_le, op.keys_le,
                op.state, op.reason)
    assert isinstance(op, WireClear | WireRemoveSource)
    return (op.reason,)


def wire_batch(batch: WireBatch) -> tuple[Any, ...]:
    updates = [
        (
            None if u.source is None else (u.source.worker_id, u.source.dp_rank),
            None if u.domain is None else (u.domain.model, u.domain.block_size, u.domain.engine),
            u.epoch,
            u.seq,
            u.op_name,
            None if u.op is None else wire_op(u.op),
        )
        for u in batch.updates
    ]
    return batch.ingest_id, updates


def assert_agrees(data: bytes, grpcio: Grpcio) -> None:
    try:
        ref = grpcio.pb2.UpdateBatch.FromString(data)
    except DecodeError:
        with pytest.raises(WireError):
            decode_update_batch(data)
        return
    assert wire_batch(decode_update_batch(data)) == upb_batch(ref)


# ---- encoders' output -------------------------------------------------------------------


def pb2_update(pb2: Any, op: str, keys: list[int], parents: list[int], extra: int) -> Any:
    update = pb2.LedgerUpdate(
        source=pb2.Source(worker_id=f"w{extra % 7}", dp_rank=extra % 3),
        domain=pb2.Domain(model="m", block_size=16, engine=extra % 3),
        epoch=extra,
        seq=extra * 31 % 2**64,
    )
    if op == "store":
        update.store.parent_key = extra
        update.store.keys.extend(keys)
    elif op == "store_le":
        update.store.keys_le = fixed64(keys)
    elif op == "remove":
        update.remove.keys.extend(keys)
    elif op == "remove_le":
        update.remove.keys_le = fixed64(keys)
    elif op == "clear":
        update.clear.reason = "seq_reset"
    elif op == "clear_empty":
        update.clear.SetInParent()  # present but empty: still the op
    elif op == "state":
        update.state.state = extra % 6
        update.state.reason = "gap"
    elif op == "snapshot":
        update.snapshot.parent_keys.extend(parents)
        update.snapshot.keys.extend(keys)
        update.snapshot.state = 2
    elif op == "snapshot_le":
        update.snapshot.parent_keys_le = fixed64(parents)
        update.snapshot.keys_le = fixed64(keys)
        update.snapshot.reason = "resync"
    elif op == "remove_source":
        update.remove_source.reason = "lease_lost"
    return update


ops = st.sampled_from([
    "store", "store_le", "remove", "remove_le", "clear", "clear_empty", "state", "snapshot",
    "snapshot_le", "remove_source", "none",
])


@SETTINGS
@given(
    ingest_id=text,
    updates=st.lists(st.tuples(ops, key_list, key_list, uint64), max_size=8),
)
def test_protobuf_encoded_batches_decode_identically(
    grpcio_modules: Grpcio, ingest_id: str, updates: list[tuple[str, list[int], list[int], int]]
) -> None:
    pb2 = grpcio_modules.pb2
    message = pb2.UpdateBatch(
        ingest_id=ingest_id, updates=[pb2_update(pb2, *u) for u in updates]
    )
    data = message.SerializeToString()
    assert wire_batch(decode_update_batch(data)) == upb_batch(message)


@st.composite
def betterproto_update(draw: st.DrawFn) -> pb.LedgerUpdate:
    update = pb.LedgerUpdate(
        source=pb.Source(worker_id=draw(text), dp_rank=draw(uint32)),
        domain=pb.Domain(model=draw(text), block_size=draw(uint32),
                         engine=pb.EngineKind(draw(st.integers(0, 2)))),
        epoch=draw(uint64),
        seq=draw(uint64),
    )
    keys, parents, reason = draw(key_list), draw(key_list), draw(text)
    kind = draw(st.integers(0, 6))
    if kind == 0:
        update.store = pb.StoreBlocks(parent_key=draw(uint64), keys=keys,
                                      keys_le=fixed64(parents))
    elif kind == 1:
        update.remove = pb.RemoveBlocks(keys=keys, keys_le=fixed64(parents))
    elif kind == 2:
        update.clear = pb.ClearBlocks(reason=reason)
    elif kind == 3:
        update.state = pb.SetState(state=pb.LedgerState(draw(st.integers(0, 5))), reason=reason)
    elif kind == 4:
        update.snapshot = pb.Snapshot(
            parent_keys=parents, keys=keys, parent_keys_le=fixed64(keys),
            keys_le=fixed64(parents), state=pb.LedgerState(draw(st.integers(0, 5))),
            reason=reason,
        )
    elif kind == 5:
        update.remove_source = pb.RemoveSource(reason=reason)
    return update  # kind 6: no op


def betterproto_op(update: pb.LedgerUpdate) -> tuple[str, tuple[Any, ...] | None]:
    name, m = betterproto.which_one_of(update, "op")
    if not name:
        return "none", None
    if isinstance(m, pb.StoreBlocks):
        return name, (m.parent_key, m.keys, m.keys_le)
    if isinstance(m, pb.RemoveBlocks):
        return name, (m.keys, m.keys_le)
    if isinstance(m, pb.SetState):
        return name, (int(m.state), m.reason)
    if isinstance(m, pb.Snapshot):
        return name, (m.parent_keys, m.keys, m.parent_keys_le, m.keys_le, int(m.state),
                      m.reason)
    assert isinstance(m, pb.ClearBlocks | pb.RemoveSource)
    return name, (m.reason,)


@SETTINGS
@given(ingest_id=text, updates=st.lists(betterproto_update(), max_size=6))
def test_betterproto_encoded_batches_decode_identically(
    ingest_id: str, updates: list[pb.LedgerUpdate]
) -> None:
    message = pb.UpdateBatch(ingest_id=ingest_id, updates=updates)
    batch = decode_update_batch(bytes(message))
    assert batch.ingest_id == ingest_id
    assert len(batch.updates) == len(updates)
    for got, sent in zip(batch.updates, updates, strict=True):
        assert got.source == WireSource(sent.source.worker_id, sent.source.dp_rank)
        assert got.domain == WireDomain(sent.domain.model, sent.domain.block_size,
                                        int(sent.domain.engine))
        assert (got.epoch, got.seq) == (sent.epoch, sent.seq)
        name, fields = betterproto_op(sent)
        assert got.op_name == name
        assert (None if got.op is None else wire_op(got.op)) == fields
    assert WireBatch.from_message(message) == batch


# ---- hand-made variants and corruption ---------------------------------------------------


@SETTINGS
@given(data=batch_bytes)
def test_hand_encoded_variants_decode_like_protobuf(grpcio_modules: Grpcio, data: bytes) -> None:
    """Unpacked and mixed key encodings, non-minimal tags and varints, unknown fields and
    groups, wrong wire types, values past 32 bits, repeated singular fields (last wins),
    repeated sub-messages (merged), oneof members replacing each other."""
    assert_agrees(data, grpcio_modules)


@SETTINGS
@given(
    data=batch_bytes,
    cut=st.integers(0, 2**16),
    flips=st.lists(st.tuples(uint32, st.integers(0, 255)), max_size=3),
)
def test_corrupted_batches_fail_only_with_wire_error(
    grpcio_modules: Grpcio, data: bytes, cut: int, flips: list[tuple[int, int]]
) -> None:
    corrupted = bytearray(data[: cut % (len(data) + 1)])
    for where, value in flips:
        if corrupted:
            corrupted[where % len(corrupted)] = value
    assert_agrees(bytes(corrupted), grpcio_modules)


@SETTINGS
@given(data=st.binary(max_size=80))
def test_random_bytes_fail_only_with_wire_error(grpcio_modules: Grpcio, data: bytes) -> None:
    assert_agrees(data, grpcio_modules)


GOOD = ld(2, ld(1, ld(1, b"w")) + tag(4, 0) + varint(1))  # one update: source w, seq 1


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (ld(2, b"\x0a\x05ab"), r"^updates\[0\]: length-delimited field overruns"),
        (GOOD + ld(2, tag(4, 0) + b"\x80"), r"^updates\[1\]: truncated varint"),
        (GOOD + ld(2, tag(4, 0) + b"\xff" * 10 + b"\x01"), r"^updates\[1\]: .*longer than 10"),
        (ld(2, ld(10, tag(1, 1) + b"\x01\x02\x03")), "truncated fixed64"),
        (ld(2, ld(10, ld(2, b"\x01" * 5))), "packed fixed64 length is not a multiple of 8"),
        (ld(2, ld(11, tag(1, 1) + b"\x01")), "truncated fixed64"),
        (ld(2, ld(1, ld(1, b"\xc3\x28"))), "UTF-8"),
        (ld(1, b"\xff"), "UTF-8"),  # ingest_id
        (ld(2, b"\x00\x01"), "field number 0"),
        (b"\x12\x05\x0a", "overruns"),
        (ld(2, tag(20, 3) + tag(1, 0) + b"\x01" + tag(21, 4)), "mismatched end-group"),
        (ld(2, ld(14, b"\x2f")), "unexpected wire type 7"),
        # an occurrence cut short must not borrow the next one's bytes when they merge
        (ld(2, ld(1, b"\x0a\x02") + ld(1, b"\x10\x01")), "overruns"),
        (ld(2, ld(10, b"\x09\x01") + ld(10, ld(2, fixed64([1, 2])))), "truncated fixed64"),
    ],
)
def test_malformed_batches_say_why(grpcio_modules: Grpcio, data: bytes, message: str) -> None:
    with pytest.raises(DecodeError):
        grpcio_modules.pb2.UpdateBatch.FromString(data)
    with pytest.raises(WireError, match=message):
        decode_update_batch(data)


def nested_groups(depth: int) -> bytes:
    return tag(20, 3) * depth + tag(20, 4) * depth


@pytest.mark.parametrize(
    "data",
    [
        *(nested_groups(n) for n in (99, 100, 101)),  # upb's nesting limit: 100 ...
        *(ld(2, nested_groups(n)) for n in (98, 99, 100)),  # ... counting the messages
        *(ld(2, ld(10, nested_groups(n))) for n in (97, 98, 99)),  # around the groups
        *(ld(2, ld(1, nested_groups(n))) for n in (97, 98, 99)),
        tag(20, 3) + b"\x00\x00" + tag(20, 4),  # field number 0 passes inside a group
        ld(2, ld(10, tag(20, 3) + b"\x02\x01x" + tag(20, 4))),
        b"\x8a\x80\x80\x80\x00\x00",  # a tag in 5 bytes (ingest_id) ...
        b"\x8a\x80\x80\x80\x80\x00\x00",  # ... but not in 6
        ld(2, ld(12, b"\x00") + ld(10, b"")),  # a replaced op member must be valid too
        ld(2, ld(12, b"\x0a\x01") + ld(12, b"x")),  # merged ones each on their own
    ],
)
def test_edge_cases_agree_with_protobuf(grpcio_modules: Grpcio, data: bytes) -> None:
    assert_agrees(data, grpcio_modules)


def test_semantic_problems_are_kept_for_the_index() -> None:
    """What protobuf accepts decodes, even where the index will reject the update."""
    data = b"".join([
        ld(2, ld(10, ld(3, b"\x00" * 5))),  # keys_le of 5 bytes
        ld(2, ld(13, tag(1, 0) + varint(-3))),  # an unknown (negative) LedgerState
        ld(2, ld(14, ld(1, fixed64([1, 2])) + ld(2, fixed64([3])))),  # 2 parents, 1 key
        ld(2, ld(2, tag(3, 0) + varint(9))),  # no source, an unknown engine, no op
    ])
    batch = decode_update_batch(data)
    store, state, snapshot, bare = batch.updates
    assert store.op == WireStore(keys_le=b"\x00" * 5)
    assert state.op == WireSetState(state=-3)
    assert isinstance(snapshot.op, WireSnapshot)
    assert (snapshot.op.parent_keys.tolist(), snapshot.op.keys.tolist()) == ([1, 2], [3])
    assert bare == WireUpdate(domain=WireDomain(engine=9))
    assert bare.op_name == "none"


def test_sub_messages_merge_and_oneof_members_replace() -> None:
    def update(*fields: bytes) -> WireUpdate:
        return decode_update_batch(ld(2, b"".join(fields))).updates[0]

    got = update(ld(1, ld(1, b"w1")), ld(1, tag(2, 0) + varint(3)))
    assert got.source == WireSource("w1", 3)
    store = ld(10, tag(1, 1) + fixed64([7]) + ld(2, fixed64([1])))
    got = update(store, ld(10, ld(2, fixed64([2]))))
    assert got.op == WireStore(7, array("Q", [1, 2]))
    clear = ld(12, ld(1, b"x"))
    assert update(store, clear).op == WireClear("x")
    assert update(store, clear, ld(15, b"")).op == WireRemoveSource()  # present though empty
    assert update(clear, store, ld(12, b"")).op == WireClear()  # a member set anew
    snapshot = update(ld(14, ld(6, b"r")), ld(14, tag(5, 0) + varint(3)))
    assert snapshot.op == WireSnapshot(state=3, reason="r")


def test_long_runs_and_many_sources(grpcio_modules: Grpcio) -> None:
    rng = np.random.default_rng(5)
    keys = rng.integers(0, 2**64, 4000, dtype=np.uint64).tolist()
    # unpacked keys, long enough for the run reader to grow its window many times
    store = tag(1, 1) + fixed64([9]) + b"".join(tag(2, 1) + fixed64([k]) for k in keys)
    batch = decode_update_batch(ld(2, ld(10, store)))
    op = batch.updates[0].op
    assert isinstance(op, WireStore)
    assert (op.parent_key, op.keys.tolist()) == (9, keys)
    # more distinct sources and domains than the decoder caches
    pb2 = grpcio_modules.pb2
    message = pb2.UpdateBatch(updates=[
        pb2.LedgerUpdate(source=pb2.Source(worker_id=f"w{i}", dp_rank=i),
                         domain=pb2.Domain(model=f"m{i % 4100}", block_size=i), seq=i)
        for i in range(9000)
    ])
    decoded = decode_update_batch(message.SerializeToString())
    assert [(u.source, u.domain, u.seq) for u in decoded.updates] == [
        (WireSource(f"w{i}", i), WireDomain(f"m{i % 4100}", i, 0), i) for i in range(9000)
    ]


def test_records_from_generated_messages() -> None:
    update = pb.LedgerUpdate(source=pb.Source(worker_id="w"), seq=2,
                             clear=pb.ClearBlocks(reason="seq_reset"))
    assert WireUpdate.from_message(update) == WireUpdate(
        source=WireSource("w"), seq=2, op=WireClear("seq_reset")
    )
    assert WireUpdate.from_message(update).op_name == "clear"
    assert decode_update_batch(b"") == WireBatch()
