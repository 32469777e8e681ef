"""Protobuf wire primitives shared by the Match and UpdateBatch codecs (socket-free).

Readers take ``(buf, pos, end)`` (``buf`` a ``bytes``, ``end`` the end of the enclosing
message) and return the value with the position after it; they raise :class:`WireError` for
bytes that are not protobuf. Repeated scalars have vectorised readers: packed varints are
decoded with numpy in one pass, packed fixed64 with one memcpy, and runs of unpacked
elements (one tag per element) in windows, so a grpcio client's encoding costs about as
much as Cortex's ``*_le`` twins. Writers append to a ``bytearray``.

Protobuf's rules, as upb applies them: varints are taken mod 2**64 and may be at most 10
bytes (tags 5), field number 0 and wire types 6 and 7 do not exist (upb tolerates field
number 0 inside a skipped group, and so does this), groups are skipped (nested at most 100
deep) and must close with their own field number, a length may not overrun the enclosing
message, strings must be UTF-8.
"""

from __future__ import annotations

import sys
import threading
from array import array
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

__all__ = [
    "LITTLE",
    "MASK32",
    "MASK64",
    "WireError",
    "as_int32",
    "le_array",
    "pack_block_keys",
    "pack_token_ids",
    "put_bytes",
    "put_uint",
    "put_varint",
    "read_fixed64",
    "read_packed_varints",
    "read_span",
    "read_tag",
    "read_text",
    "read_varint",
    "skip_field",
    "unpacked_varints",
]

LITTLE = sys.byteorder == "little"
MASK32 = 0xFFFFFFFF
MASK64 = 0xFFFFFFFFFFFFFFFF
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


# ---- varints ----------------------------------------------------------------------------


def read_varint(buf: bytes, pos: int, end: int) -> tuple[int, int]:
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
            return result & MASK64, pos
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


def read_packed_varints(buf: bytes, start: int, stop: int, into: array[int]) -> None:
    """Append the packed uint32 varints of ``buf[start:stop]`` to ``into`` (an ``array('I')``,
    values truncated to 32 bits as protobuf does)."""
    if stop - start > _SCALAR_MAX:
        raw = np.frombuffer(buf, np.uint8, stop - start, start)
        into.frombytes(_varint_values(raw).astype(np.uint32).tobytes())
    else:  # a few values (or many tiny chunks): numpy's call overhead would dominate
        while start < stop:
            value, start = read_varint(buf, start, stop)
            into.append(value & MASK32)


def unpacked_varints(
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

    Returns the little-endian payload bytes. Windowed like :func:`unpacked_varints`.
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


def read_fixed64(
    buf: bytes, tag_at: int, pos: int, end: int, tag: int, into: array[int]
) -> int:
    """Append a ``repeated fixed64`` occurrence to ``into`` (an ``array('Q')``).

    ``tag`` is the field's tag as read at ``tag_at`` and ``pos`` the position after it:
    wire type 2 is a packed run (one memcpy), wire type 1 one unpacked element, read
    together with the unpacked elements that follow it. Returns the position after them.
    """
    if tag & 7 == 2:
        start, pos = read_span(buf, pos, end)
        if (pos - start) % 8:
            raise WireError("packed fixed64 length is not a multiple of 8")
        into.extend(le_array("Q", memoryview(buf)[start:pos]))
        return pos
    if pos == tag_at + 1 and pos + 9 < end and buf[pos + 8] == tag:  # a run: vectorise
        run, after = _unpacked_fixed64(buf, tag_at, end, tag)
        if run:
            into.extend(le_array("Q", run))
            return after
    if pos + 8 > end:
        raise WireError("truncated fixed64")
    into.extend(le_array("Q", memoryview(buf)[pos : pos + 8]))
    return pos + 8


# ---- field skipping and scalars ---------------------------------------------------------


def skip_field(buf: bytes, pos: int, end: int, tag: int, depth: int = 0) -> int:
    """Skip the value of an unknown field (or a known one with another wire type).

    ``depth``: how many messages (or groups) enclose the field, 0 at the top level; upb
    refuses groups nested past 100 levels counting those.
    """
    wire_type = tag & 7
    if wire_type == 0:
        return read_varint(buf, pos, end)[1]
    if wire_type == 1:
        pos += 8
    elif wire_type == 2:
        length, pos = read_varint(buf, pos, end)
        pos += length
    elif wire_type == 5:
        pos += 4
    elif wire_type == 3:
        if depth >= _MAX_GROUP_DEPTH:
            raise WireError("groups nested too deeply")
        while True:
            inner, pos = _tag_varint(buf, pos, end)
            if inner >> 3 > _MAX_FIELD:  # (upb lets field number 0 pass inside a group)
                raise WireError(f"invalid field number {inner >> 3}")
            if inner & 7 == 4:
                if inner >> 3 != tag >> 3:
                    raise WireError("mismatched end-group")
                return pos
            pos = skip_field(buf, pos, end, inner, depth + 1)
    else:  # 4 outside its group, 6 and 7 do not exist
        raise WireError(f"unexpected wire type {wire_type}")
    if pos > end:
        raise WireError("field overruns the message")
    return pos


def read_tag(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    """The tag at ``pos`` (field number << 3 | wire type) and the position after it."""
    tag, pos = _tag_varint(buf, pos, end)
    if tag >> 3 == 0 or tag >> 3 > _MAX_FIELD:
        raise WireError(f"invalid field number {tag >> 3}")
    return tag, pos


def _tag_varint(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    tag, after = read_varint(buf, pos, end)
    if after - pos > 5:  # a 32-bit varint, as upb reads tags
        raise WireError("tag longer than 5 bytes")
    return tag, after


def read_span(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    """Bounds of a length-delimited value whose length varint starts at ``pos``."""
    length, start = read_varint(buf, pos, end)
    stop = start + length
    if stop > end:
        raise WireError("length-delimited field overruns the message")
    return start, stop


def read_text(buf: bytes, start: int, stop: int) -> str:
    """``buf[start:stop]`` as a string field: UTF-8 or :class:`WireError`."""
    try:
        return str(buf[start:stop], "utf-8")
    except UnicodeDecodeError as exc:
        raise WireError("string field is not valid UTF-8") from exc


def as_int32(value: int) -> int:
    """An int32 (enum) field's value from its varint: the low 32 bits, sign-extended."""
    value &= MASK32
    return value - (1 << 32) if value >> 31 else value


def le_array(typecode: str, data: bytes | memoryview) -> array[int]:
    """A native ``array`` from little-endian bytes (length already checked)."""
    out = array(typecode)
    out.frombytes(data)
    if not LITTLE:
        out.byteswap()
    return out


# ---- writers ----------------------------------------------------------------------------


def put_varint(out: bytearray, value: int) -> None:
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)


def put_bytes(out: bytearray, tag: int, data: bytes) -> None:
    """A length-delimited field with a one-byte ``tag``, omitted when empty (proto3)."""
    if data:
        out.append(tag)
        put_varint(out, len(data))
        out += data


def put_uint(out: bytearray, tag: int, value: int) -> None:
    """A varint field with a one-byte ``tag``, omitted when 0 (proto3)."""
    if value:
        out.append(tag)
        put_varint(out, value & MASK64)  # negative int32 enums: 10 bytes, as protobuf


def pack_token_ids(token_ids: Sequence[int]) -> bytes:
    """``token_ids_le``: uint32 little-endian. ``OverflowError`` outside ``[0, 2**32-1]``."""
    packed = token_ids if isinstance(token_ids, array) and token_ids.typecode == "I" else None
    packed = array("I", token_ids) if packed is None else packed
    if not LITTLE:
        packed = array("I", packed)
        packed.byteswap()
    return packed.tobytes()


def pack_block_keys(block_keys: Sequence[int]) -> bytes:
    """``block_keys_le`` (and every ``*keys_le``): uint64 little-endian, 8 bytes a key."""
    packed = block_keys if isinstance(block_keys, array) and block_keys.typecode == "Q" else None
    packed = array("Q", block_keys) if packed is None else packed
    if not LITTLE:
        packed = array("Q", packed)
        packed.byteswap()
    return packed.tobytes()
