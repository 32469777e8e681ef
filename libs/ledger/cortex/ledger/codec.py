"""The one translation between ``cortex.index.v1`` protobuf messages and ledger values.

Messages are the official protobuf classes generated from ``index.proto`` (``cortex.api``;
the upb runtime parses and serializes them in C). Long key lists travel in the packed
``*_le`` twins (uint64 little-endian, one memcpy each way); a repeated field is accepted
where the proto has one. Validation lives here: anything malformed raises
:class:`InvalidArgument` naming the field, and nothing is applied.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from array import array
from collections.abc import Iterable
from typing import Any

import numpy as np
import numpy.typing as npt
from google.protobuf.message import DecodeError

from cortex.api.index.v1 import index_pb2 as pb
from cortex.hashing import Engine, HashDomain, pack_keys
from cortex.ledger.errors import InvalidArgument
from cortex.ledger.match import Match, SourceMatch
from cortex.ledger.model import (
    ClearBlocks,
    KeyList,
    LedgerState,
    LedgerUpdate,
    Op,
    RemoveBlocks,
    RemoveSource,
    SetState,
    Snapshot,
    Source,
    StoreBlocks,
    Tier,
)
from cortex.ledger.tiers import OFFLOAD_TIERS
from cortex.ledger.view import (
    Attach,
    Clear,
    Detach,
    Evict,
    Keys,
    Remove,
    Store,
    StorePairs,
    ViewOp,
    WireOps,
)

__all__ = [
    "ENGINE_KIND",
    "domain_from_bytes",
    "domain_from_pb",
    "domain_to_pb",
    "engine_from_kind",
    "keys_from_le",
    "keys_to_le",
    "lenient_state",
    "match_from_pb",
    "match_to_pb",
    "op_from_pb",
    "op_to_pb",
    "ops_from_wire",
    "ops_to_pb",
    "pb",
    "source_from_bytes",
    "source_from_pb",
    "source_to_pb",
    "state_from_pb",
    "tier_from_pb",
    "update_from_pb",
    "update_to_pb",
]

ENGINE_KIND: dict[Engine, int] = {Engine.SGLANG: pb.ENGINE_KIND_SGLANG,
                                  Engine.VLLM: pb.ENGINE_KIND_VLLM}
_ENGINES: dict[int, Engine] = {kind: engine for engine, kind in ENGINE_KIND.items()}


def engine_from_kind(value: int, *, required: bool) -> Engine | None:
    """The engine of an ``EngineKind`` value; None for UNSPECIFIED unless ``required``."""
    if value == 0 and not required:
        return None
    engine = _ENGINES.get(int(value))
    if engine is None:
        raise InvalidArgument(f"engine must be ENGINE_KIND_SGLANG or ENGINE_KIND_VLLM, got {value}")
    return engine


_BIG_ENDIAN = sys.byteorder == "big"

# ---- scalars ------------------------------------------------------------------------------


def keys_to_le(keys: Keys) -> bytes:
    """Block keys as the ``*_le`` twin: uint64 little-endian (lists through
    :func:`cortex.hashing.pack_keys`, key arrays as they are)."""
    if isinstance(keys, np.ndarray):
        return keys.astype("<u8", copy=False).tobytes()
    if isinstance(keys, array) and keys.typecode == "Q" and not _BIG_ENDIAN:
        return keys.tobytes()  # a decoded update's keys, forwarded as they came
    return pack_keys(keys)


def keys_from_le(data: bytes, field: str) -> npt.NDArray[np.uint64]:
    """The keys of a ``*_le`` twin (a read-only view of ``data``)."""
    if len(data) % 8:
        raise InvalidArgument(f"{field} length {len(data)} is not a multiple of 8")
    keys: npt.NDArray[np.uint64] = np.frombuffer(data, "<u8")
    return keys


def _key_list(msg: Any, packed: bytes, field: str) -> KeyList:
    """The keys of an update from its ``*_le`` twin (wins when set: one copy into an
    ``array('Q')``, no int object per key) or the repeated field ``field`` of ``msg`` (read
    only when the twin is empty: even an empty repeated field costs a container)."""
    if packed:
        if len(packed) % 8:
            raise InvalidArgument(f"{field}_le length {len(packed)} is not a multiple of 8")
        keys = array("Q")
        keys.frombytes(packed)
        if _BIG_ENDIAN:  # pragma: no cover - the wire is little-endian
            keys.byteswap()
        return keys
    return list(getattr(msg, field.rpartition(".")[2]))


def state_from_pb(value: int, field: str) -> LedgerState:
    try:
        return LedgerState(value)
    except ValueError:
        raise InvalidArgument(f"{field} has an unknown ledger state {value}") from None


def lenient_state(value: int) -> LedgerState:
    """A ledger state from a newer peer: an unknown value reads as UNSPECIFIED (never
    credited) instead of failing the message."""
    try:
        return LedgerState(value)
    except ValueError:
        return LedgerState.UNSPECIFIED


def tier_from_pb(value: int, field: str) -> Tier:
    try:
        return Tier(value)
    except ValueError:
        raise InvalidArgument(f"{field} has an unknown tier {value}") from None


def source_from_pb(msg: pb.Source, field: str = "source") -> Source:
    if not msg.worker_id:
        raise InvalidArgument(f"{field}.worker_id is required")
    if not msg.tier:
        return Source(msg.worker_id, msg.dp_rank)
    return Source(msg.worker_id, msg.dp_rank, tier_from_pb(msg.tier, f"{field}.tier"))


def source_to_pb(source: Source, out: pb.Source) -> None:
    out.worker_id = source.worker_id
    out.dp_rank = source.dp_rank
    if source.tier:
        out.tier = int(source.tier)  # type: ignore[assignment]


@functools.lru_cache(maxsize=1024)
def _domain(model: str, block_size: int, engine: int) -> HashDomain:
    # cached: every update names one, and a HashDomain hashes its fields into a seed
    if not model:
        raise InvalidArgument("domain.model is required")
    if block_size < 1:
        raise InvalidArgument("domain.block_size must be >= 1")
    kind = engine_from_kind(engine, required=True)
    assert kind is not None
    return HashDomain(model, block_size, kind)


def domain_from_pb(msg: pb.Domain) -> HashDomain:
    return _domain(msg.model, msg.block_size, msg.engine)


@functools.lru_cache(maxsize=4096)
def source_from_bytes(raw: bytes) -> Source | None:
    """The source of a ``Source`` message's bytes (an update planned from the wire); None
    when they are not a valid one (the update then takes the path that reports it)."""
    try:
        return source_from_pb(pb.Source.FromString(raw))
    except (DecodeError, InvalidArgument):
        return None


@functools.lru_cache(maxsize=1024)
def domain_from_bytes(raw: bytes) -> HashDomain | None:
    """The hash domain of a ``Domain`` message's bytes; None when they are not a valid one."""
    try:
        return domain_from_pb(pb.Domain.FromString(raw))
    except (DecodeError, InvalidArgument):
        return None


def domain_to_pb(domain: HashDomain, out: pb.Domain) -> None:
    out.model = domain.model
    out.block_size = domain.block_size
    out.engine = ENGINE_KIND[domain.engine]  # type: ignore[assignment]


# ---- ledger updates (ingest -> index) -----------------------------------------------------


def _op(update: pb.LedgerUpdate) -> Op:
    which = update.WhichOneof("op")
    if which == "store":
        m = update.store
        return StoreBlocks(m.parent_key, _key_list(m, m.keys_le, "store.keys"))
    if which == "remove":
        m2 = update.remove
        return RemoveBlocks(_key_list(m2, m2.keys_le, "remove.keys"))
    if which == "clear":
        return ClearBlocks(update.clear.reason)
    if which == "state":
        state = state_from_pb(update.state.state, "state.state")
        if state is LedgerState.UNSPECIFIED:
            raise InvalidArgument("state.state is unspecified")
        return SetState(state, update.state.reason)
    if which == "snapshot":
        s = update.snapshot
        parents = _key_list(s, s.parent_keys_le, "snapshot.parent_keys")
        keys = _key_list(s, s.keys_le, "snapshot.keys")
        if len(parents) != len(keys):
            raise InvalidArgument(f"snapshot has {len(parents)} parent keys for {len(keys)} keys")
        state = state_from_pb(s.state, "snapshot.state")
        if state is LedgerState.UNSPECIFIED:
            state = LedgerState.READY  # an in-sync ledger unless ingest says otherwise
        if state is LedgerState.REMOVED:
            raise InvalidArgument("a snapshot cannot be in state REMOVED (use remove_source)")
        return Snapshot(parents, keys, state, s.reason)
    if which == "remove_source":
        return RemoveSource(update.remove_source.reason)
    raise InvalidArgument("ledger update has no op (unset)")


def update_from_pb(update: pb.LedgerUpdate) -> LedgerUpdate:
    """A validated update; :class:`InvalidArgument` names the first bad field."""
    if not update.HasField("source"):
        raise InvalidArgument("source.worker_id is required")
    if not update.HasField("domain"):
        raise InvalidArgument("domain.model is required")
    return LedgerUpdate(
        source=source_from_pb(update.source),
        domain=domain_from_pb(update.domain),
        epoch=update.epoch,
        seq=update.seq,
        op=_op(update),
    )


def update_to_pb(update: LedgerUpdate, out: pb.LedgerUpdate) -> None:
    """Fill ``out`` (e.g. ``batch.updates.add()``) with ``update``."""
    source_to_pb(update.source, out.source)
    domain_to_pb(update.domain, out.domain)
    out.epoch = update.epoch
    out.seq = update.seq
    op = update.op
    if isinstance(op, StoreBlocks):
        out.store.parent_key = op.parent_key
        out.store.keys_le = keys_to_le(op.keys)
    elif isinstance(op, RemoveBlocks):
        out.remove.keys_le = keys_to_le(op.keys)
    elif isinstance(op, ClearBlocks):
        out.clear.reason = op.reason
    elif isinstance(op, SetState):
        out.state.state = int(op.state)  # type: ignore[assignment]
        out.state.reason = op.reason
    elif isinstance(op, Snapshot):
        snap = out.snapshot
        snap.parent_keys_le = keys_to_le(op.parent_keys)
        snap.keys_le = keys_to_le(op.keys)
        snap.state = int(op.state)  # type: ignore[assignment]
        snap.reason = op.reason
    else:
        out.remove_source.reason = op.reason


# ---- replica ops (index -> gateways) ------------------------------------------------------


def op_to_pb(op: ViewOp, out: pb.ReplicaOp) -> None:
    """Fill ``out`` (e.g. ``batch.ops.add()``) with one journal record."""
    if isinstance(op, Evict):
        domain_to_pb(op.domain, out.evict.domain)
        out.evict.keys_le = keys_to_le(op.keys)
        return
    source_to_pb(op.source, out.source)
    if isinstance(op, Attach):
        a = out.attach
        domain_to_pb(op.domain, a.domain)
        a.state = int(op.state)  # type: ignore[assignment]
        a.reason = op.reason
    elif isinstance(op, Store):
        out.store.parent_key = op.parent_key
        out.store.keys_le = keys_to_le(op.keys)
    elif isinstance(op, StorePairs):
        out.store_pairs.parent_keys_le = keys_to_le(op.parent_keys)
        out.store_pairs.keys_le = keys_to_le(op.keys)
    elif isinstance(op, Remove):
        out.remove.keys_le = keys_to_le(op.keys)
    elif isinstance(op, Clear):
        out.clear.SetInParent()
    else:
        out.detach.SetInParent()


def op_from_pb(msg: pb.ReplicaOp) -> ViewOp:
    """The journal record of ``msg``; :class:`InvalidArgument` when it is malformed."""
    which = msg.WhichOneof("op")
    if which == "evict":
        return Evict(domain_from_pb(msg.evict.domain),
                     keys_from_le(msg.evict.keys_le, "evict.keys_le"))
    source = source_from_pb(msg.source)
    if which == "attach":
        a = msg.attach
        state = state_from_pb(a.state, "attach.state")
        return Attach(source, domain_from_pb(a.domain), state, a.reason)
    if which == "store":
        return Store(source, msg.store.parent_key, keys_from_le(msg.store.keys_le,
                                                                "store.keys_le"))
    if which == "store_pairs":
        p = msg.store_pairs
        parents = keys_from_le(p.parent_keys_le, "store_pairs.parent_keys_le")
        keys = keys_from_le(p.keys_le, "store_pairs.keys_le")
        if len(parents) != len(keys):
            raise InvalidArgument("store_pairs has parent and key lists of different lengths")
        return StorePairs(source, parents, keys)
    if which == "remove":
        return Remove(source, keys_from_le(msg.remove.keys_le, "remove.keys_le"))
    if which == "clear":
        return Clear(source)
    if which == "detach":
        return Detach(source)
    raise InvalidArgument("replica op has no op (unset)")


def ops_to_pb(ops: Iterable[ViewOp | WireOps], out: pb.ReplicaBatch) -> None:
    """Append ``ops`` to ``out.ops`` in order (encoded records as they are)."""
    for op in ops:
        if isinstance(op, WireOps):
            out.MergeFromString(op.data)  # repeated ``ops`` entries: appended in order
        else:
            op_to_pb(op, out.ops.add())


def ops_from_wire(ops: WireOps) -> list[ViewOp]:
    """The journal records of encoded ``ReplicaBatch.ops`` entries."""
    return [op_from_pb(op) for op in pb.ReplicaBatch.FromString(ops.data).ops]


# ---- matches (index -> gateway) -----------------------------------------------------------

_OFFLOAD = frozenset(int(t) for t in OFFLOAD_TIERS)


def match_to_pb(match: Match, out: pb.MatchResponse) -> None:
    """Write ``match`` into ``out``: per worker rank its device match with its offload tiers
    beside it (``matched_tokens = matched_blocks * block_size``), and the shared tier's
    prefix. A match without a domain writes only the version and the query's size."""
    out.index_version = match.version
    out.query_blocks = match.query_blocks
    domain = match.domain
    if domain is None:
        return
    size = domain.block_size
    domain_to_pb(domain, out.domain)
    add = out.matches.add
    ranks: dict[tuple[str, int], pb.WorkerMatch] = {}
    offload: list[SourceMatch] = []
    for m in match.sources:
        source = m.source
        if source.tier is Tier.DEVICE:
            ranks[source.worker_id, source.dp_rank] = add(
                worker_id=source.worker_id, dp_rank=source.dp_rank, matched_blocks=m.blocks,
                matched_tokens=m.blocks * size, state=int(m.state))
        elif source.tier in OFFLOAD_TIERS:
            offload.append(m)
    for m in offload:
        if not m.blocks:
            continue
        source = m.source
        rank = ranks.get((source.worker_id, source.dp_rank))
        if rank is None:  # offload sources only: the device prefix is 0
            rank = ranks[source.worker_id, source.dp_rank] = add(
                worker_id=source.worker_id, dp_rank=source.dp_rank)
        rank.tiers.add(tier=int(source.tier), blocks=m.blocks, tokens=m.blocks * size,
                       state=int(m.state))
    out.shared_blocks = match.shared_blocks


def match_from_pb(reply: pb.MatchResponse) -> Match:
    """The :class:`Match` of a MatchResponse: each rank's device match, then its offload
    tiers (an unknown tier or state value from a newer index is skipped / UNSPECIFIED: it
    cannot be credited). ``domain`` is ``None`` when the reply names no valid one."""
    sources: list[SourceMatch] = []
    for hit in reply.matches:
        sources.append(SourceMatch(Source(hit.worker_id, hit.dp_rank), hit.matched_blocks,
                                   lenient_state(hit.state)))
        for tier in hit.tiers:
            if tier.tier in _OFFLOAD:
                sources.append(SourceMatch(Source(hit.worker_id, hit.dp_rank, Tier(tier.tier)),
                                           tier.blocks, lenient_state(tier.state)))
    domain = None
    with contextlib.suppress(InvalidArgument):
        domain = domain_from_pb(reply.domain)
    return Match(tuple(sources), reply.index_version, reply.query_blocks, domain,
                 reply.shared_blocks)
