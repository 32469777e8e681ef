"""``UpdateBatch`` encoding for the ingest → index ``Sync`` stream, with the protobuf classes of
``index.proto`` (:mod:`cortex.ledger.codec`).

Each update is encoded once, when it is taken for a batch, as a one-update ``UpdateBatch``
(the update built in place with the source's cached ``source`` / ``domain`` fields); a batch
is its ``ingest_id`` header followed by those parts, since concatenated protobuf messages
parse as one with the repeated ``updates`` appended, and the byte size of each part is known
for batching limits.

The two updates of every block -- ``store`` and ``remove`` -- are framed here rather than
through protobuf objects (a message object, two sub-message copies and a serialization cost
~6 µs per update): the ``source`` / ``domain`` fields serialized once by protobuf, then
``epoch``, ``seq`` and the op in field order, exactly the bytes ``SerializeToString`` gives
(``tests/ingest/test_wire.py`` holds the two equal). The other updates use the messages.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Final

from cortex.hashing import HashDomain, pack_keys
from cortex.ledger.codec import domain_to_pb, pb, source_to_pb
from cortex.ledger.model import LedgerState, Source

__all__ = ["UpdateEncoder", "encode_batch_bytes"]


_FIXED64: Final = struct.Struct("<Q").pack
# tags (field number << 3 | wire type) of the fields framed here (index.proto)
_UPDATES: Final = b"\x12"  # UpdateBatch.updates = 2, length-delimited
_EPOCH: Final = b"\x18"  # LedgerUpdate.epoch = 3, varint
_SEQ: Final = b"\x20"  # LedgerUpdate.seq = 4, varint
_STORE: Final = b"\x52"  # LedgerUpdate.store = 10, length-delimited
_REMOVE: Final = b"\x5a"  # LedgerUpdate.remove = 11, length-delimited
_STORE_PARENT: Final = b"\x09"  # StoreBlocks.parent_key = 1, fixed64
_STORE_KEYS: Final = b"\x1a"  # StoreBlocks.keys_le = 3, length-delimited
_REMOVE_KEYS: Final = b"\x12"  # RemoveBlocks.keys_le = 2, length-delimited


def _varint(value: int) -> bytes:
    """A protobuf base-128 varint of an unsigned 64-bit value."""
    if value < 0x80:
        return bytes((value,))
    if value < 0x4000:
        return bytes((value & 0x7F | 0x80, value >> 7))
    if value < 0x200000:
        return bytes((value & 0x7F | 0x80, (value >> 7) & 0x7F | 0x80, value >> 14))
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


class UpdateEncoder:
    """Encodes ``LedgerUpdate`` messages of one source in one domain (each as a one-update
    ``UpdateBatch``, see the module docstring)."""

    __slots__ = ("_domain", "_epoch", "_head", "_source", "domain", "source")

    def __init__(self, source: Source, domain: HashDomain) -> None:
        self.source = source
        self.domain = domain
        self._source = pb.Source()
        source_to_pb(source, self._source)
        self._domain = pb.Domain()
        domain_to_pb(domain, self._domain)
        # a LedgerUpdate's fields 1 and 2: what every framed update starts with
        self._head = pb.LedgerUpdate(source=self._source, domain=self._domain).SerializeToString()
        self._epoch = (0, b"")  # the last epoch and its field: epochs are microsecond clocks

    def _framed(self, epoch: int, seq: int, op_tag: bytes, op: bytes) -> bytes:
        """A one-update UpdateBatch: the head, epoch, seq (proto3: omitted when 0) and op."""
        last, field = self._epoch
        if epoch != last:
            field = _EPOCH + _varint(epoch) if epoch else b""
            self._epoch = (epoch, field)
        update = b"".join((
            self._head,
            field,
            _SEQ + _varint(seq) if seq else b"",
            op_tag, _varint(len(op)), op,
        ))
        return _UPDATES + _varint(len(update)) + update

    def __repr__(self) -> str:
        return f"UpdateEncoder({self.source}, {self.domain})"

    def _update(self, epoch: int, seq: int) -> tuple[pb.UpdateBatch, pb.LedgerUpdate]:
        batch = pb.UpdateBatch()
        update = batch.updates.add(epoch=epoch, seq=seq)
        update.source.CopyFrom(self._source)
        update.domain.CopyFrom(self._domain)
        return batch, update

    def store(self, epoch: int, seq: int, parent_key: int, keys: Sequence[int]) -> bytes:
        packed = pack_keys(keys)
        op = b"".join((
            _STORE_PARENT + _FIXED64(parent_key) if parent_key else b"",
            _STORE_KEYS + _varint(len(packed)) + packed if packed else b"",
        ))
        return self._framed(epoch, seq, _STORE, op)

    def remove(self, epoch: int, seq: int, keys: Sequence[int]) -> bytes:
        packed = pack_keys(keys)
        op = _REMOVE_KEYS + _varint(len(packed)) + packed if packed else b""
        return self._framed(epoch, seq, _REMOVE, op)

    def store_pb(self, epoch: int, seq: int, parent_key: int, keys: Sequence[int]) -> bytes:
        """:meth:`store` through the protobuf messages (the specification of its bytes)."""
        batch, update = self._update(epoch, seq)
        update.store.parent_key = parent_key
        update.store.keys_le = pack_keys(keys)
        return batch.SerializeToString()

    def remove_pb(self, epoch: int, seq: int, keys: Sequence[int]) -> bytes:
        """:meth:`remove` through the protobuf messages (the specification of its bytes)."""
        batch, update = self._update(epoch, seq)
        update.remove.keys_le = pack_keys(keys)
        return batch.SerializeToString()

    def clear(self, epoch: int, seq: int, reason: str) -> bytes:
        batch, update = self._update(epoch, seq)
        update.clear.reason = reason
        return batch.SerializeToString()

    def state(self, epoch: int, seq: int, state: LedgerState, reason: str) -> bytes:
        batch, update = self._update(epoch, seq)
        update.state.state = int(state)  # type: ignore[assignment]
        update.state.reason = reason
        return batch.SerializeToString()

    def snapshot(
        self,
        epoch: int,
        seq: int,
        parent_keys: list[int],
        keys: list[int],
        state: LedgerState,
        reason: str,
    ) -> bytes:
        batch, update = self._update(epoch, seq)
        snap = update.snapshot
        snap.SetInParent()  # an empty snapshot is still a snapshot
        snap.parent_keys_le = pack_keys(parent_keys)
        snap.keys_le = pack_keys(keys)
        snap.state = int(state)  # type: ignore[assignment]
        snap.reason = reason
        return batch.SerializeToString()

    def remove_source(self, epoch: int, seq: int, reason: str) -> bytes:
        batch, update = self._update(epoch, seq)
        update.remove_source.SetInParent()
        update.remove_source.reason = reason
        return batch.SerializeToString()


def encode_batch_bytes(ingest_id: str, updates: list[bytes], quiet: bool = False) -> bytes:
    """An ``UpdateBatch`` of ``ingest_id`` from :class:`UpdateEncoder` parts (``quiet``: it
    asks for no reply)."""
    head = pb.UpdateBatch(ingest_id=ingest_id, quiet=quiet).SerializeToString()
    return head + b"".join(updates)
