"""Hand-written protobuf codec for ``Index.Match``, and the grpclib hook that puts it in use.

Why: betterproto's pure-Python codec needs ~8 ms to decode a ``MatchRequest`` carrying 4,096
``repeated uint32 token_ids`` and ~1 ms to encode a 32-worker ``MatchResponse``; other
schedulers call Match from grpcio clients with exactly that encoding. Here packed varints are
decoded with numpy in one pass, packed fixed64 and the ``*_le`` twins with one memcpy, and the
reply is written without building betterproto objects (numbers: ``docs/bench/wire.md``).

Server hook. grpclib decodes every request with ``request_type.FromString(data)``
(``grpclib.encoding.proto.ProtoCodec.decode``), where ``request_type`` is the third item of
the service's ``__mapping__()[path]`` ``Handler``; a reply goes through
``reply.SerializeToString()`` after an ``isinstance(reply, reply_type)`` check.
:class:`IndexServiceBase` subclasses the generated ``IndexBase`` and replaces only the
``/cortex.index.v1.Index/Match`` entry: its request type is :class:`MatchRequestWire`, whose
``FromString`` returns a :class:`MatchQuery` (malformed bytes become ``INVALID_ARGUMENT``), and
its reply type is :class:`EncodedMessage`, carrying bytes from :func:`encode_match_response`.
The index server therefore writes::

    class IndexServer(IndexServiceBase):
        async def match_query(self, query: MatchQuery) -> MatchReply | MatchResponse: ...
        async def workers(self, workers_request: WorkersRequest) -> WorkersResponse: ...
        # stats / sync / changes: the generated signatures, unchanged

    grpclib.server.Server([IndexServer(...)])

It must not override ``match`` (that is the in-process entry, and the class refuses it).

Client side (gateway): :func:`encode_match_request` builds request bytes through the ``*_le``
twins, :func:`call_match` sends them over a grpclib ``Channel`` and decodes the reply with
:func:`decode_match_response`; :func:`match_request` builds the generated message instead.

Decoding follows protobuf's rules: repeated scalars packed or not (even mixed), the last value
of a singular field wins, a known field with an unexpected wire type is skipped like an unknown
field, unknown fields and groups are skipped, uint32 values are truncated to 32 bits and int32
enums sign-extended as protobuf does, strings must be UTF-8. Anything else raises
:class:`WireError`, as does a ``*_le`` twin whose length is not a whole number of items.
"""

from __future__ import annotations

import sys
import threading
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, cast

import grpclib.client
import grpclib.const
import grpclib.server
import numpy as np
import numpy.typing as npt
from grpclib.const import Cardinality, Handler, Status
from grpclib.exceptions import GRPCError
from grpclib.metadata import Deadline, _MetadataLike

from cortex.api.index.v1 import IndexBase, MatchRequest, MatchResponse

__all__ = [
    "MATCH_METHOD",
    "EncodedMessage",
    "IndexServiceBase",
    "MatchDomain",
    "MatchQuery",
    "MatchReply",
    "MatchReplyWire",
    "MatchRequestWire",
    "WireError",
    "WorkerHit",
    "call_match",
    "decode_match_request",
    "decode_match_response",
    "encode_match_request",
    "encode_match_response",
    "match_request",
    "pack_block_keys",
    "pack_token_ids",
]

MATCH_METHOD = "/cortex.index.v1.Index/Match"

_LITTLE = sys.byteorder == "little"
_MASK32 = 0xFFFFFFFF
_MASK64 = 0xFFFFFFFFFFFFFFFF
_MAX_FIELD = (1 << 29) - 1
_MAX_GROUP_DEPTH = 100  # upb's default nesting limit
_RUN_WINDOW = 256  # bytes scanned first for a run of unpacked elements; grows x4
_SCALAR_MAX = 32  # packed varint payloads up to this many bytes are decoded in Python
_BUFFERS_MAX = 1 << 16  # payload bytes (~20k tokens) up to which work arrays are kept
assert array("I").itemsize == 4 and array("Q").itemsize == 8


class WireError(ValueError):
    """Bytes that are not a valid encoding of the expected message.

    The RPC boundary reacts: the server answers ``INVALID_ARGUMENT`` with this message, a
    client treats it as a broken peer. Never a bug of the caller's own code.
    """


# ---- typed views ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class MatchQuery:
    """A decoded ``MatchRequest``, with the ``*_le`` twins already resolved.

    ``token_ids`` (``array('I')``, tokens) and ``block_keys`` (``array('Q')``, Cortex keys)
    hold the ``_le`` bytes when those were set, else the repeated field; an ``array`` is a
    ``Sequence[int]`` that ``cortex.hashing.block_keys`` packs with one memcpy. Treat both as
    read-only. ``engine`` is the raw ``EngineKind`` value: unknown values are kept, as proto3
    requires, for the index to reject.
    """

    model: str = ""
    token_ids: array[int] = field(default_factory=lambda: array("I"))
    block_keys: array[int] = field(default_factory=lambda: array("Q"))
    candidate_workers: tuple[str, ...] = ()
    max_blocks: int = 0
    block_size: int = 0
    engine: int = 0
    lora_name: str = ""
    cache_salt: str = ""

    @classmethod
    def from_message(cls, message: MatchRequest) -> MatchQuery:
        """The query a generated ``MatchRequest`` stands for (in-process callers, tests)."""
        return decode_match_request(bytes(message))


class WorkerHit(NamedTuple):
    """One ``WorkerMatch``: consecutive leading blocks a source holds (blocks, tokens).

    A NamedTuple rather than a dataclass: replies carry one per worker, and a tuple is
    built 4x faster than a frozen dataclass.
    """

    worker_id: str
    matched_blocks: int
    matched_tokens: int
    state: int  # a LedgerState value
    dp_rank: int = 0


@dataclass(frozen=True, slots=True)
class MatchDomain:
    """The ``Domain`` a Match was answered in (model, tokens per block, EngineKind value)."""

    model: str
    block_size: int
    engine: int


@dataclass(frozen=True, slots=True)
class MatchReply:
    """A ``MatchResponse``: every source of the domain, the index version, the query size."""

    matches: Sequence[WorkerHit] = ()
    index_version: int = 0
    query_blocks: int = 0
    domain: MatchDomain | None = None

    @classmethod
    def from_message(cls, message: MatchResponse) -> MatchReply:
        return decode_match_response(bytes(message))


# ---- varints ----------------------------------------------------------------------------


def _varint(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    """The varint at ``pos`` (mod 2**64, as protobuf) and the position after it."""
    if pos < end and buf[pos] < 0x80:
        return buf[pos], pos + 1
    result = 0
    shift = 0
    while pos < end:
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result & _MASK64, pos
        shift += 7
        if shift == 70:
            raise WireError("varint longer than 10 bytes")
    raise WireError("truncated varint")


class _Buffers:
    """Work arrays of the vectorised varint decoder, reused across calls in one thread.

    Why: a 4,096-token payload needs ~0.5 MiB of temporaries. Allocated per call, glibc
    may hand them back to the OS on free and page-fault them in again on the next request,
    which made the decode 4x slower (160 µs instead of 40) depending on heap history.
    """

    __slots__ = (
        "capacity",
        "index",
        "lengths",
        "mask",
        "out",
        "payload",
        "starts",
        "values",
        "work",
    )

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.index = np.arange(capacity, dtype=np.uint64)
        self.mask = np.empty(capacity, np.bool_)
        self.work = np.empty(capacity, np.uint64)
        self.payload = np.empty(capacity, np.uint64)
        self.lengths = np.empty(capacity, np.intp)
        self.starts = np.empty(capacity, np.intp)
        self.values = np.empty(capacity, np.uint64)
        self.out = np.empty(capacity, np.uint64)


_local = threading.local()


def _buffers(size: int) -> _Buffers:
    """Buffers for a payload of ``size`` bytes: this thread's, or one-off when very large."""
    if size > _BUFFERS_MAX:
        return _Buffers(size)
    buffers: _Buffers | None = getattr(_local, "buffers", None)
    if buffers is None or buffers.capacity < size:
        buffers = _local.buffers = _Buffers(max(4096, 1 << (size - 1).bit_length()))
    return buffers


def _varint_values(raw: npt.NDArray[np.uint8]) -> npt.NDArray[np.uint64]:
    """Values (mod 2**64) of the varints that exactly tile ``raw``, a non-empty payload.

    Returns a view into this thread's buffers: copy or convert it before the next call.
    Raises :class:`WireError` for a cut or over-long (> 10 bytes) varint. The 7-bit groups
    of one varint occupy distinct bits, so OR equals SUM, and one cumulative sum replaces
    the per-varint reduction (faster than ``bitwise_or.reduceat``).
    """
    size = raw.size
    buffers = _buffers(size)
    mask = buffers.mask[:size]
    np.less(raw, 0x80, out=mask)
    if not mask[-1]:
        raise WireError("truncated varint")
    ends = np.flatnonzero(mask)  # last byte of each varint
    count = ends.size
    out = buffers.out[:count]
    if count == size:  # all one-byte varints
        np.copyto(out, raw)
        return out
    lengths = buffers.lengths[:count]
    lengths[0] = ends[0] + 1
    np.subtract(ends[1:], ends[:-1], out=lengths[1:])
    if int(lengths.max()) > 10:
        raise WireError("varint longer than 10 bytes")
    starts = buffers.starts[: count - 1]
    np.add(ends[:-1], 1, out=starts)
    # work := each byte's offset inside its varint, via a cumulative sum of varint lengths
    work = buffers.work[:size]
    work.fill(0)
    work[starts] = lengths[:-1]
    np.cumsum(work, out=work)
    np.subtract(buffers.index[:size], work, out=work)
    work *= 7
    payload = buffers.payload[:size]
    np.bitwise_and(raw, 0x7F, out=payload, casting="unsafe")
    np.left_shift(payload, work, out=payload)
    np.cumsum(payload, out=payload)
    values = buffers.values[:count]
    np.take(payload, ends, out=values)
    out[0] = values[0]
    np.subtract(values[1:], values[:-1], out=out[1:])
    return out


def _unpacked_varints(
    buf: bytes, pos: int, end: int, tag: int
) -> tuple[npt.NDArray[np.uint64], int]:
    """The run of unpacked elements ``tag varint tag varint ...`` starting at ``pos``.

    Protobuf allows repeated scalars unpacked, one tag per element; a Python loop would
    cost ~0.5 µs an element. This scans a window that grows x4 while the run fills it, so
    the work stays proportional to the run. It stops before the first element it cannot
    vouch for (another tag, a tag in a non-minimal encoding, an over-long or cut varint);
    the caller's scalar path then handles or rejects that element.
    """
    chunks: list[npt.NDArray[np.uint64]] = []
    window = _RUN_WINDOW
    while True:
        stop = min(end, pos + window)
        raw = np.frombuffer(buf, np.uint8, stop - pos, pos)
        ends = np.flatnonzero(raw < 0x80)
        pairs = ends.size // 2
        ends = ends[: 2 * pairs]
        lengths = np.empty_like(ends)
        if pairs:
            lengths[0] = ends[0] + 1
            lengths[1:] = np.diff(ends)
        tag_at = ends[0::2]  # a one-byte tag ends where it starts
        good = (raw[tag_at] == tag) & (lengths[0::2] == 1) & (lengths[1::2] <= 10)
        bad = np.flatnonzero(~good)
        taken = int(bad[0]) if bad.size else pairs
        if taken:
            used = int(ends[2 * taken - 1]) + 1
            chunks.append(_varint_values(raw[:used])[1::2].copy())
            pos += used
        if bad.size or taken == 0 or stop == end:
            break
        window *= 4
    if len(chunks) == 1:
        return chunks[0], pos
    return np.concatenate(chunks or [np.zeros(0, np.uint64)]), pos


def _unpacked_fixed64(buf: bytes, pos: int, end: int, tag: int) -> tuple[bytes, int]:
    """The run of unpacked fixed64 elements (one-byte ``tag`` + 8 bytes) from ``pos``.

    Returns the little-endian payload bytes. Windowed like :func:`_unpacked_varints`.
    """
    parts: list[bytes] = []
    window = _RUN_WINDOW
    while True:
        stop = min(end, pos + window)
        count = (stop - pos) // 9
        rows = np.frombuffer(buf, np.uint8, 9 * count, pos).reshape(count, 9)
        bad = np.flatnonzero(rows[:, 0] != tag)
        taken = int(bad[0]) if bad.size else count
        if taken:
            parts.append(rows[:taken, 1:].tobytes())
            pos += 9 * taken
        if bad.size or taken == 0 or end - pos < 9:
            break
        window *= 4
    return b"".join(parts), pos


# ---- field skipping and scalars ---------------------------------------------------------


def _skip(buf: bytes, pos: int, end: int, tag: int, depth: int = 0) -> int:
    """Skip the value of an unknown field (or a known one with another wire type)."""
    wire_type = tag & 7
    if wire_type == 0:
        return _varint(buf, pos, end)[1]
    if wire_type == 1:
        pos += 8
    elif wire_type == 2:
        length, pos = _varint(buf, pos, end)
        pos += length
    elif wire_type == 5:
        pos += 4
    elif wire_type == 3:
        if depth >= _MAX_GROUP_DEPTH:
            raise WireError("groups nested too deeply")
        while True:
            inner, pos = _tag(buf, pos, end)
            if inner & 7 == 4:
                if inner >> 3 != tag >> 3:
                    raise WireError("mismatched end-group")
                return pos
            pos = _skip(buf, pos, end, inner, depth + 1)
    else:  # 4 outside its group, 6 and 7 do not exist
        raise WireError(f"unexpected wire type {wire_type}")
    if pos > end:
        raise WireError("field overruns the message")
    return pos


def _tag(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    tag, pos = _varint(buf, pos, end)
    if tag >> 3 == 0 or tag >> 3 > _MAX_FIELD:
        raise WireError(f"invalid field number {tag >> 3}")
    return tag, pos


def _span(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    """Bounds of a length-delimited value whose length varint starts at ``pos``."""
    length, start = _varint(buf, pos, end)
    stop = start + length
    if stop > end:
        raise WireError("length-delimited field overruns the message")
    return start, stop


def _text(buf: bytes, start: int, stop: int) -> str:
    try:
        return str(buf[start:stop], "utf-8")
    except UnicodeDecodeError as exc:
        raise WireError("string field is not valid UTF-8") from exc


def _int32(value: int) -> int:
    value &= _MASK32
    return value - (1 << 32) if value >> 31 else value


def _le_array(typecode: str, data: bytes | memoryview) -> array[int]:
    """A native ``array`` from little-endian bytes (length already checked)."""
    out = array(typecode)
    out.frombytes(data)
    if not _LITTLE:
        out.byteswap()
    return out


# ---- MatchRequest -----------------------------------------------------------------------


def decode_match_request(data: bytes | bytearray | memoryview) -> MatchQuery:
    """Decode ``MatchRequest`` bytes into a :class:`MatchQuery`; :class:`WireError` if invalid.

    Cost: ~40 µs for 4,096 packed ``token_ids``, a few µs for packed keys or ``*_le`` twins.
    """
    buf = data if type(data) is bytes else bytes(data)
    view = memoryview(buf)
    end = len(buf)
    pos = 0
    model = lora_name = cache_salt = ""
    max_blocks = block_size = engine = 0
    candidates: list[str] = []
    tokens = array("I")
    keys = array("Q")
    tokens_le: tuple[int, int] | None = None
    keys_le: tuple[int, int] | None = None
    while pos < end:
        tag_at = pos
        tag = buf[pos]
        if tag < 0x80:
            pos += 1
            if tag < 8:
                raise WireError("invalid field number 0")
        else:
            tag, pos = _tag(buf, pos, end)
        if tag == 0x12:  # token_ids, packed
            start, pos = _span(buf, pos, end)
            if pos - start > _SCALAR_MAX:
                raw = np.frombuffer(buf, np.uint8, pos - start, start)
                tokens.frombytes(_varint_values(raw).astype(np.uint32).tobytes())
            else:  # a few tokens (or many tiny chunks): numpy's call overhead would dominate
                while start < pos:
                    value, start = _varint(buf, start, pos)
                    tokens.append(value & _MASK32)
        elif tag == 0x1A:  # block_keys, packed
            start, pos = _span(buf, pos, end)
            if (pos - start) % 8:
                raise WireError("packed fixed64 length is not a multiple of 8")
            keys.extend(_le_array("Q", view[start:pos]))
        elif tag == 0x52:  # token_ids_le
            tokens_le = _span(buf, pos, end)
            pos = tokens_le[1]
        elif tag == 0x5A:  # block_keys_le
            keys_le = _span(buf, pos, end)
            pos = keys_le[1]
        elif tag == 0x0A:
            start, pos = _span(buf, pos, end)
            model = _text(buf, start, pos)
        elif tag == 0x22:
            start, pos = _span(buf, pos, end)
            candidates.append(_text(buf, start, pos))
        elif tag == 0x28:
            max_blocks, pos = _varint(buf, pos, end)
            max_blocks &= _MASK32
        elif tag == 0x30:
            block_size, pos = _varint(buf, pos, end)
            block_size &= _MASK32
        elif tag == 0x38:
            engine, pos = _varint(buf, pos, end)
            engine = _int32(engine)
        elif tag == 0x42:
            start, pos = _span(buf, pos, end)
            lora_name = _text(buf, start, pos)
        elif tag == 0x4A:
            start, pos = _span(buf, pos, end)
            cache_salt = _text(buf, start, pos)
        elif tag == 0x10:  # token_ids, unpacked: decode the run from this tag on at once
            run = _unpacked_varints(buf, tag_at, end, 0x10) if pos == tag_at + 1 else None
            if run is not None and run[0].size:
                tokens.frombytes(run[0].astype(np.uint32).tobytes())
                pos = run[1]
            else:  # a non-minimal tag or a bad value: one element, the scalar way
                value, pos = _varint(buf, pos, end)
                tokens.append(value & _MASK32)
        elif tag == 0x19:  # block_keys, unpacked
            fixed = _unpacked_fixed64(buf, tag_at, end, 0x19) if pos == tag_at + 1 else None
            if fixed is not None and fixed[0]:
                keys.extend(_le_array("Q", fixed[0]))
                pos = fixed[1]
            else:
                if pos + 8 > end:
                    raise WireError("truncated fixed64")
                keys.extend(_le_array("Q", view[pos : pos + 8]))
                pos += 8
        else:
            pos = _skip(buf, pos, end, tag)
    if tokens_le is not None and tokens_le[0] != tokens_le[1]:
        if (tokens_le[1] - tokens_le[0]) % 4:
            raise WireError("token_ids_le length is not a multiple of 4")
        tokens = _le_array("I", view[tokens_le[0] : tokens_le[1]])
    if keys_le is not None and keys_le[0] != keys_le[1]:
        if (keys_le[1] - keys_le[0]) % 8:
            raise WireError("block_keys_le length is not a multiple of 8")
        keys = _le_array("Q", view[keys_le[0] : keys_le[1]])
    return MatchQuery(
        model=model,
        token_ids=tokens,
        block_keys=keys,
        candidate_workers=tuple(candidates),
        max_blocks=max_blocks,
        block_size=block_size,
        engine=engine,
        lora_name=lora_name,
        cache_salt=cache_salt,
    )


def _put_varint(out: bytearray, value: int) -> None:
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)


def _put_bytes(out: bytearray, tag: int, data: bytes) -> None:
    if data:
        out.append(tag)
        _put_varint(out, len(data))
        out += data


def _put_uint(out: bytearray, tag: int, value: int) -> None:
    if value:
        out.append(tag)
        _put_varint(out, value & _MASK64)  # negative int32 enums: 10 bytes, as protobuf


def pack_token_ids(token_ids: Sequence[int]) -> bytes:
    """``token_ids_le``: uint32 little-endian. ``OverflowError`` outside ``[0, 2**32-1]``."""
    packed = token_ids if isinstance(token_ids, array) and token_ids.typecode == "I" else None
    packed = array("I", token_ids) if packed is None else packed
    if not _LITTLE:
        packed = array("I", packed)
        packed.byteswap()
    return packed.tobytes()


def pack_block_keys(block_keys: Sequence[int]) -> bytes:
    """``block_keys_le`` (and every ``*keys_le``): uint64 little-endian, 8 bytes a key."""
    packed = block_keys if isinstance(block_keys, array) and block_keys.typecode == "Q" else None
    packed = array("Q", block_keys) if packed is None else packed
    if not _LITTLE:
        packed = array("Q", packed)
        packed.byteswap()
    return packed.tobytes()


def encode_match_request(
    model: str,
    *,
    block_keys: Sequence[int] = (),
    token_ids: Sequence[int] = (),
    candidate_workers: Sequence[str] = (),
    max_blocks: int = 0,
    block_size: int = 0,
    engine: int = 0,
    lora_name: str = "",
    cache_salt: str = "",
) -> bytes:
    """``MatchRequest`` bytes, lists sent through the ``*_le`` twins (~5 µs for 256 keys).

    Give ``block_keys`` (precomputed Cortex keys) or ``token_ids``; the index uses the keys
    when both are set. Fields at their default are omitted, as protobuf does.
    """
    out = bytearray()
    _put_bytes(out, 0x0A, model.encode())
    for worker in candidate_workers:
        out.append(0x22)
        encoded = worker.encode()
        _put_varint(out, len(encoded))
        out += encoded
    _put_uint(out, 0x28, max_blocks)
    _put_uint(out, 0x30, block_size)
    _put_uint(out, 0x38, engine)
    _put_bytes(out, 0x42, lora_name.encode())
    _put_bytes(out, 0x4A, cache_salt.encode())
    _put_bytes(out, 0x52, pack_token_ids(token_ids) if token_ids else b"")
    _put_bytes(out, 0x5A, pack_block_keys(block_keys) if block_keys else b"")
    return bytes(out)


def match_request(
    model: str,
    *,
    block_keys: Sequence[int] = (),
    token_ids: Sequence[int] = (),
    candidate_workers: Sequence[str] = (),
    max_blocks: int = 0,
    block_size: int = 0,
    engine: int = 0,
    lora_name: str = "",
    cache_salt: str = "",
) -> MatchRequest:
    """The generated ``MatchRequest`` (for ``IndexStub.match``), lists in the ``*_le`` twins."""
    return MatchRequest(
        model=model,
        candidate_workers=list(candidate_workers),
        max_blocks=max_blocks,
        block_size=block_size,
        engine=engine,  # type: ignore[arg-type]  # an EngineKind value
        lora_name=lora_name,
        cache_salt=cache_salt,
        token_ids_le=pack_token_ids(token_ids) if token_ids else b"",
        block_keys_le=pack_block_keys(block_keys) if block_keys else b"",
    )


# ---- MatchResponse ----------------------------------------------------------------------


def encode_match_response(reply: MatchReply) -> bytes:
    """``MatchResponse`` bytes, byte-identical to protobuf's (~1 µs a worker)."""
    out = bytearray()
    entry = bytearray()
    for hit in reply.matches:
        entry.clear()
        _put_bytes(entry, 0x0A, hit.worker_id.encode())
        _put_uint(entry, 0x10, hit.matched_blocks)
        _put_uint(entry, 0x18, hit.matched_tokens)
        _put_uint(entry, 0x20, hit.state)
        _put_uint(entry, 0x28, hit.dp_rank)
        out.append(0x0A)
        _put_varint(out, len(entry))
        out += entry
    _put_uint(out, 0x10, reply.index_version)
    _put_uint(out, 0x18, reply.query_blocks)
    if reply.domain is not None:
        entry.clear()
        _put_bytes(entry, 0x0A, reply.domain.model.encode())
        _put_uint(entry, 0x10, reply.domain.block_size)
        _put_uint(entry, 0x18, reply.domain.engine)
        out.append(0x22)
        _put_varint(out, len(entry))
        out += entry
    return bytes(out)


def _decode_worker_match(buf: bytes, pos: int, end: int) -> WorkerHit:
    worker_id = ""
    blocks = tokens = state = dp_rank = 0
    while pos < end:
        tag = buf[pos]
        if 8 <= tag < 0x80:
            pos += 1
        else:
            tag, pos = _tag(buf, pos, end)
        if tag == 0x0A:
            start, pos = _span(buf, pos, end)
            worker_id = _text(buf, start, pos)
        elif tag == 0x10:
            blocks, pos = _varint(buf, pos, end)
        elif tag == 0x18:
            tokens, pos = _varint(buf, pos, end)
        elif tag == 0x20:
            state, pos = _varint(buf, pos, end)
        elif tag == 0x28:
            dp_rank, pos = _varint(buf, pos, end)
        else:
            pos = _skip(buf, pos, end, tag)
    return WorkerHit(
        worker_id, blocks & _MASK32, tokens & _MASK32, _int32(state), dp_rank & _MASK32
    )


def _decode_domain(buf: bytes, pos: int, end: int, into: MatchDomain | None) -> MatchDomain:
    # a repeated sub-message occurrence merges into the previous one, as protobuf does
    model, block_size, engine = (
        ("", 0, 0) if into is None else (into.model, into.block_size, into.engine)
    )
    while pos < end:
        tag, pos = _tag(buf, pos, end)
        if tag == 0x0A:
            start, pos = _span(buf, pos, end)
            model = _text(buf, start, pos)
        elif tag == 0x10:
            block_size, pos = _varint(buf, pos, end)
            block_size &= _MASK32
        elif tag == 0x18:
            engine, pos = _varint(buf, pos, end)
            engine = _int32(engine)
        else:
            pos = _skip(buf, pos, end, tag)
    return MatchDomain(model, block_size, engine)


# Decoded WorkerMatch entries by their bytes. Most entries of a reply repeat from one reply
# to the next (every worker without a hit, the same few hits); WorkerHit is immutable.
_HITS: dict[bytes, WorkerHit] = {}
_HITS_MAX = 4096


def decode_match_response(data: bytes | bytearray | memoryview) -> MatchReply:
    """Decode ``MatchResponse`` bytes into a :class:`MatchReply`; :class:`WireError` if invalid."""
    buf = data if type(data) is bytes else bytes(data)
    end = len(buf)
    pos = 0
    matches: list[WorkerHit] = []
    version = blocks = 0
    domain: MatchDomain | None = None
    while pos < end:
        tag, pos = _tag(buf, pos, end)
        if tag == 0x0A:
            start, pos = _span(buf, pos, end)
            entry = buf[start:pos]
            hit = _HITS.get(entry)
            if hit is None:
                hit = _decode_worker_match(buf, start, pos)
                if len(_HITS) >= _HITS_MAX:
                    _HITS.clear()
                _HITS[entry] = hit
            matches.append(hit)
        elif tag == 0x10:
            version, pos = _varint(buf, pos, end)
        elif tag == 0x18:
            blocks, pos = _varint(buf, pos, end)
            blocks &= _MASK32
        elif tag == 0x22:
            start, pos = _span(buf, pos, end)
            domain = _decode_domain(buf, start, pos, domain)
        else:
            pos = _skip(buf, pos, end, tag)
    return MatchReply(matches, version, blocks, domain)


# ---- grpclib plumbing -------------------------------------------------------------------


class EncodedMessage:
    """Protobuf bytes that pass through grpclib's ``ProtoCodec`` unchanged, either way."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data

    def SerializeToString(self) -> bytes:  # the protobuf name grpclib calls
        return self.data

    @classmethod
    def FromString(cls, data: bytes) -> EncodedMessage:
        return cls(data)

    def __repr__(self) -> str:
        return f"EncodedMessage({len(self.data)} bytes)"


class MatchRequestWire:
    """Request type for a grpclib ``Handler``: decodes ``MatchRequest`` into a MatchQuery."""

    @staticmethod
    def FromString(data: bytes) -> MatchQuery:
        try:
            return decode_match_request(data)
        except WireError as exc:
            raise GRPCError(Status.INVALID_ARGUMENT, f"malformed MatchRequest: {exc}") from exc


class MatchReplyWire:
    """Reply type for a grpclib client call: decodes ``MatchResponse`` into a MatchReply."""

    @staticmethod
    def FromString(data: bytes) -> MatchReply:
        return decode_match_response(data)


class IndexServiceBase(IndexBase):
    """The generated ``IndexBase`` with Match served by this module's codec.

    Subclasses implement :meth:`match_query` and the other RPCs with their generated
    signatures. Overriding ``match`` is refused at class creation: gRPC calls would never
    reach it.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "match" in cls.__dict__:
            raise TypeError(
                f"{cls.__name__} overrides match(); implement match_query(query: MatchQuery) "
                "instead: gRPC Match requests are decoded by cortex.index.wire"
            )

    async def match_query(self, query: MatchQuery) -> MatchReply | MatchResponse:
        """Answer one Match. Raise ``GRPCError`` for client errors (``INVALID_ARGUMENT``...)."""
        raise GRPCError(Status.UNIMPLEMENTED)

    async def match(self, match_request: MatchRequest) -> MatchResponse:
        """In-process Match with generated messages: same path as the wire, slower."""
        reply = await self.match_query(MatchQuery.from_message(match_request))
        if isinstance(reply, MatchReply):
            return MatchResponse().parse(encode_match_response(reply))
        return reply

    async def _rpc_match_query(
        self, stream: grpclib.server.Stream[MatchQuery, EncodedMessage]
    ) -> None:
        query = await stream.recv_message()
        if query is None:
            raise GRPCError(Status.INVALID_ARGUMENT, "Match needs a request message")
        reply = await self.match_query(query)
        data = encode_match_response(reply) if isinstance(reply, MatchReply) else bytes(reply)
        await stream.send_message(EncodedMessage(data))

    def __mapping__(self) -> dict[str, Handler]:
        mapping: dict[str, Handler] = dict(super().__mapping__())
        mapping[MATCH_METHOD] = Handler(
            self._rpc_match_query, Cardinality.UNARY_UNARY, MatchRequestWire, EncodedMessage
        )
        return mapping


async def call_match(
    channel: grpclib.client.Channel,
    request: bytes,
    *,
    timeout: float | None = None,
    deadline: Deadline | None = None,
    metadata: _MetadataLike | None = None,
) -> MatchReply:
    """One Match over a grpclib channel: ``request`` from :func:`encode_match_request`.

    ``timeout`` in seconds; the smaller of it and ``deadline`` bounds the call. Raises
    grpclib's ``GRPCError`` / ``StreamTerminatedError`` as a generated stub would, and
    :class:`WireError` for a reply that does not decode.
    """
    async with channel.request(
        MATCH_METHOD,
        Cardinality.UNARY_UNARY,
        EncodedMessage,
        MatchReplyWire,
        timeout=timeout,
        deadline=deadline,
        metadata=metadata,
    ) as stream:
        await stream.send_message(EncodedMessage(request), end=True)
        reply = await stream.recv_message()
    if reply is None:  # grpclib raises before a unary call ends without a message
        raise WireError("Match returned no message")
    return cast(MatchReply, reply)  # what MatchReplyWire.FromString returns
