"""Hand-written protobuf encoding of ``UpdateBatch`` (ingest → index ``Sync`` stream).

Why: betterproto's pure-Python encoder costs tens of microseconds per ``LedgerUpdate``; at
100,000 block events per second the ingest would spend its whole CPU budget there. An update
here is a cached per-source prefix (``source`` and ``domain`` fields), two varints and the op,
with block keys in the packed ``*_keys_le`` twins (one memcpy). The bytes are plain proto3:
any protobuf decoder reads them (the tests decode them with the generated betterproto
classes). :class:`RawCodec` lets grpclib send the pre-encoded bytes as an ``UpdateBatch``.
"""

from __future__ import annotations

from typing import Any

from grpclib.encoding.proto import ProtoCodec

from cortex.hashing import Engine, HashDomain, pack_keys
from cortex.ingest.ops import LedgerState, SourceId

__all__ = [
    "EncodedBatch",
    "RawCodec",
    "UpdateEncoder",
    "encode_batch_bytes",
]

_VARINT = 0
_FIXED64 = 1
_LEN = 2

_ENGINE_KIND = {Engine.SGLANG: 1, Engine.VLLM: 2}

# LedgerUpdate oneof op field numbers
_STORE = 10
_REMOVE = 11
_CLEAR = 12
_STATE = 13
_SNAPSHOT = 14
_REMOVE_SOURCE = 15


_SMALL = [bytes((i,)) for i in range(0x80)]


def _varint(value: int) -> bytes:
    if value < 0x80:
        return _SMALL[value]
    if value < 0x4000:
        return bytes(((value & 0x7F) | 0x80, value >> 7))
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _tag(field: int, wire_type: int) -> bytes:
    return _varint((field << 3) | wire_type)


def _len_field(field: int, data: bytes) -> bytes:
    return _tag(field, _LEN) + _varint(len(data)) + data


def _str_field(field: int, text: str) -> bytes:
    return _len_field(field, text.encode()) if text else b""


def _uint_field(field: int, value: int) -> bytes:
    return _tag(field, _VARINT) + _varint(value) if value else b""


_TAG_EPOCH = _tag(3, _VARINT)
_TAG_SEQ = _tag(4, _VARINT)
_TAG_STORE_PARENT = _tag(1, _FIXED64)
_TAG_UPDATE = _tag(2, _LEN)


class UpdateEncoder:
    """Encodes ``LedgerUpdate`` messages of one source in one domain."""

    __slots__ = ("_epoch", "_prefix", "domain", "source")

    def __init__(self, source: SourceId, domain: HashDomain) -> None:
        self.source = source
        self.domain = domain
        source_msg = _str_field(1, source.worker_id) + _uint_field(2, source.dp_rank)
        domain_msg = (
            _str_field(1, domain.model)
            + _uint_field(2, domain.block_size)
            + _uint_field(3, _ENGINE_KIND[domain.engine])
        )
        self._prefix = _len_field(1, source_msg) + _len_field(2, domain_msg)
        self._epoch: tuple[int, bytes] = (-1, b"")  # the last epoch and its varint

    def __repr__(self) -> str:
        return f"UpdateEncoder({self.source}, {self.domain})"

    def _update(self, epoch: int, seq: int, op_field: int, body: bytes) -> bytes:
        cached, encoded = self._epoch
        if cached != epoch:
            encoded = _varint(epoch)
            self._epoch = (epoch, encoded)
        return b"".join(
            (
                self._prefix,
                _TAG_EPOCH,
                encoded,
                _TAG_SEQ,
                _varint(seq),
                _tag(op_field, _LEN),
                _varint(len(body)),
                body,
            )
        )

    def store(self, epoch: int, seq: int, parent_key: int, keys: list[int]) -> bytes:
        body = _TAG_STORE_PARENT + parent_key.to_bytes(8, "little") + _len_field(
            3, pack_keys(keys)
        )
        return self._update(epoch, seq, _STORE, body)

    def remove(self, epoch: int, seq: int, keys: list[int]) -> bytes:
        return self._update(epoch, seq, _REMOVE, _len_field(2, pack_keys(keys)))

    def clear(self, epoch: int, seq: int, reason: str) -> bytes:
        return self._update(epoch, seq, _CLEAR, _str_field(1, reason))

    def state(self, epoch: int, seq: int, state: LedgerState, reason: str) -> bytes:
        return self._update(
            epoch, seq, _STATE, _uint_field(1, int(state)) + _str_field(2, reason)
        )

    def snapshot(
        self,
        epoch: int,
        seq: int,
        parent_keys: list[int],
        keys: list[int],
        state: LedgerState,
        reason: str,
    ) -> bytes:
        body = b"".join(
            (
                _len_field(3, pack_keys(parent_keys)) if parent_keys else b"",
                _len_field(4, pack_keys(keys)) if keys else b"",
                _uint_field(5, int(state)),
                _str_field(6, reason),
            )
        )
        return self._update(epoch, seq, _SNAPSHOT, body)

    def remove_source(self, epoch: int, seq: int, reason: str) -> bytes:
        return self._update(epoch, seq, _REMOVE_SOURCE, _str_field(1, reason))


def encode_batch_bytes(ingest_id: str, updates: list[bytes]) -> bytes:
    """An ``UpdateBatch`` from encoded ``LedgerUpdate`` messages."""
    parts = [_str_field(1, ingest_id)]
    for update in updates:
        parts.append(_TAG_UPDATE)
        parts.append(_varint(len(update)))
        parts.append(update)
    return b"".join(parts)


class EncodedBatch:
    """Pre-encoded ``UpdateBatch`` bytes, sent as they are by :class:`RawCodec`."""

    __slots__ = ("data", "updates")

    def __init__(self, data: bytes, updates: int) -> None:
        self.data = data
        self.updates = updates

    def __repr__(self) -> str:
        return f"EncodedBatch({self.updates} updates, {len(self.data)} bytes)"


class RawCodec(ProtoCodec):
    """grpclib's proto codec, passing :class:`EncodedBatch` bytes through untouched."""

    def encode(self, message: Any, message_type: Any) -> bytes:
        if isinstance(message, EncodedBatch):
            return message.data
        data: bytes = super().encode(message, message_type)
        return data
