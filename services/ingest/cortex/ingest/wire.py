"""``UpdateBatch`` encoding for the ingest → index ``Sync`` stream, with the protobuf classes of
``index.proto`` (:mod:`cortex.ledger.codec`).

Each update is encoded once, when it is taken for a batch, as a one-update ``UpdateBatch``
(the update built in place with the source's cached ``source`` / ``domain`` fields); a batch
is its ``ingest_id`` header followed by those parts, since concatenated protobuf messages
parse as one with the repeated ``updates`` appended. No hand-written wire format, and the
byte size of each part is known for batching limits.
"""

from __future__ import annotations

from collections.abc import Sequence

from cortex.hashing import HashDomain, pack_keys
from cortex.ledger.codec import domain_to_pb, pb, source_to_pb
from cortex.ledger.model import LedgerState, Source

__all__ = ["UpdateEncoder", "encode_batch_bytes"]


class UpdateEncoder:
    """Encodes ``LedgerUpdate`` messages of one source in one domain (each as a one-update
    ``UpdateBatch``, see the module docstring)."""

    __slots__ = ("_domain", "_source", "domain", "source")

    def __init__(self, source: Source, domain: HashDomain) -> None:
        self.source = source
        self.domain = domain
        self._source = pb.Source()
        source_to_pb(source, self._source)
        self._domain = pb.Domain()
        domain_to_pb(domain, self._domain)

    def __repr__(self) -> str:
        return f"UpdateEncoder({self.source}, {self.domain})"

    def _update(self, epoch: int, seq: int) -> tuple[pb.UpdateBatch, pb.LedgerUpdate]:
        batch = pb.UpdateBatch()
        update = batch.updates.add(epoch=epoch, seq=seq)
        update.source.CopyFrom(self._source)
        update.domain.CopyFrom(self._domain)
        return batch, update

    def store(self, epoch: int, seq: int, parent_key: int, keys: Sequence[int]) -> bytes:
        batch, update = self._update(epoch, seq)
        update.store.parent_key = parent_key
        update.store.keys_le = pack_keys(keys)
        return batch.SerializeToString()

    def remove(self, epoch: int, seq: int, keys: Sequence[int]) -> bytes:
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


def encode_batch_bytes(ingest_id: str, updates: list[bytes]) -> bytes:
    """An ``UpdateBatch`` of ``ingest_id`` from :class:`UpdateEncoder` parts."""
    return pb.UpdateBatch(ingest_id=ingest_id).SerializeToString() + b"".join(updates)
