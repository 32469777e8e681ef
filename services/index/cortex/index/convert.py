"""Translation between ``cortex.index.v1`` messages and the core's value types.

Validation lives here: anything malformed becomes :class:`InvalidArgument` with a message
naming the field. Requests arrive already decoded by :mod:`cortex.index.wire`: Match as a
:class:`MatchQuery` (:func:`match_args` is the one place a query becomes core arguments),
Sync as :class:`WireUpdate` records (:func:`update_from_wire` validates one update into a
core :class:`LedgerUpdate`). Replies are built as generated messages, except Match's.
"""

from __future__ import annotations

import functools
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from cortex.api.index import v1 as pb
from cortex.hashing import Engine, HashDomain
from cortex.index.changes import ChangeSet
from cortex.index.errors import InvalidArgument
from cortex.index.model import (
    ClearBlocks,
    LedgerState,
    LedgerUpdate,
    Op,
    RemoveBlocks,
    RemoveSource,
    SetState,
    Snapshot,
    Source,
    StoreBlocks,
)
from cortex.index.prefix_index import IndexStats, MatchResult, WorkerView
from cortex.index.wire import (
    MatchDomain,
    MatchQuery,
    MatchReply,
    WireClear,
    WireDomain,
    WireOp,
    WireRemove,
    WireRemoveSource,
    WireSetState,
    WireSnapshot,
    WireSource,
    WireStore,
    WireUpdate,
    WorkerHit,
)
from cortex.index.wire.codec import le_array

__all__ = [
    "MatchArgs",
    "change_batch",
    "domain_from_wire",
    "domain_to_pb",
    "engine_from_value",
    "match_args",
    "match_reply",
    "source_from_wire",
    "stats_response",
    "update_from_wire",
    "workers_response",
]

# EngineKind values of the proto
_ENGINES: dict[int, Engine] = {1: Engine.SGLANG, 2: Engine.VLLM}
_ENGINE_KINDS: dict[Engine, int] = {Engine.SGLANG: 1, Engine.VLLM: 2}
_MAX_DP_RANK = (1 << 32) - 1


def engine_from_value(value: int, *, required: bool) -> Engine | None:
    """The engine of an ``EngineKind`` value; None for UNSPECIFIED unless ``required``."""
    if value == 0 and not required:
        return None
    engine = _ENGINES.get(int(value))
    if engine is None:
        raise InvalidArgument(f"engine must be ENGINE_KIND_SGLANG or ENGINE_KIND_VLLM, got {value}")
    return engine


# ---- Match ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class MatchArgs:
    """Keyword arguments of :meth:`PrefixIndex.match`, validated."""

    model: str
    block_keys: Sequence[int] | None
    token_ids: Sequence[int] | None
    block_size: int
    engine: Engine | None
    candidate_workers: tuple[str, ...]
    max_blocks: int
    lora_name: str
    cache_salt: str

    def as_kwargs(self) -> dict[str, Any]:
        return {
            "block_keys": self.block_keys,
            "token_ids": self.token_ids,
            "block_size": self.block_size,
            "engine": self.engine,
            "candidate_workers": self.candidate_workers,
            "max_blocks": self.max_blocks,
            "lora_name": self.lora_name,
            "cache_salt": self.cache_salt,
        }


def match_args(query: MatchQuery) -> MatchArgs:
    """The one request -> query conversion: a decoded MatchRequest as core arguments."""
    if not query.model:
        raise InvalidArgument("model is required")
    return MatchArgs(
        model=query.model,
        block_keys=query.block_keys if len(query.block_keys) else None,
        token_ids=query.token_ids if len(query.token_ids) else None,
        block_size=query.block_size,
        engine=engine_from_value(query.engine, required=False),
        candidate_workers=tuple(w for w in query.candidate_workers if w),
        max_blocks=query.max_blocks,
        lora_name=query.lora_name,
        cache_salt=query.cache_salt,
    )


def match_reply(result: MatchResult, requested: MatchArgs) -> MatchReply:
    """The MatchResponse of ``result`` (``matched_tokens = matched_blocks * block_size``)."""
    domain = result.domain
    if domain is None:
        engine = requested.engine
        reply_domain = MatchDomain(
            requested.model,
            requested.block_size,
            _ENGINE_KINDS[engine] if engine is not None else 0,
        )
        return MatchReply((), result.version, result.query_blocks, reply_domain)
    size = domain.block_size
    hits = [
        WorkerHit(source[0], blocks, blocks * size, state, source[1])
        for source, blocks, state in result.matches
    ]
    return MatchReply(
        hits,
        result.version,
        result.query_blocks,
        MatchDomain(domain.model, size, _ENGINE_KINDS[domain.engine]),
    )


# ---- ledger updates ---------------------------------------------------------------------


def source_from_wire(source: WireSource | None) -> Source:
    if source is None or not source.worker_id:
        raise InvalidArgument("source.worker_id is required")
    return Source(source.worker_id, source.dp_rank)


@functools.lru_cache(maxsize=256)
def domain_from_wire(domain: WireDomain | None) -> HashDomain:
    """The hash domain of a ``Domain`` (cached: every update names one, and a
    ``HashDomain`` hashes its fields into a seed when created)."""
    if domain is None or not domain.model:
        raise InvalidArgument("domain.model is required")
    if domain.block_size < 1:
        raise InvalidArgument("domain.block_size must be >= 1")
    engine = engine_from_value(domain.engine, required=True)
    assert engine is not None
    return HashDomain(domain.model, domain.block_size, engine)


def domain_to_pb(domain: HashDomain) -> pb.Domain:
    return pb.Domain(model=domain.model, block_size=domain.block_size,
                     engine=pb.EngineKind(_ENGINE_KINDS[domain.engine]))


def _keys(repeated: array[int], packed: bytes, name: str) -> list[int]:
    """A key list from its ``*_le`` twin (wins when set) or the repeated field."""
    if packed:
        if len(packed) % 8:
            raise InvalidArgument(f"{name}_le length {len(packed)} is not a multiple of 8")
        return le_array("Q", packed).tolist()
    return repeated.tolist()


def _state(value: int, field: str) -> LedgerState:
    try:
        return LedgerState(value)
    except ValueError as exc:
        raise InvalidArgument(f"{field} has an unknown ledger state {value}") from exc


def _op(op: WireOp | None) -> Op:
    if isinstance(op, WireStore):
        return StoreBlocks(op.parent_key, _keys(op.keys, op.keys_le, "keys"))
    if isinstance(op, WireRemove):
        return RemoveBlocks(_keys(op.keys, op.keys_le, "keys"))
    if isinstance(op, WireClear):
        return ClearBlocks(op.reason)
    if isinstance(op, WireSetState):
        state = _state(op.state, "state.state")
        if state is LedgerState.UNSPECIFIED:
            raise InvalidArgument("state.state is unspecified")
        return SetState(state, op.reason)
    if isinstance(op, WireSnapshot):
        parents = _keys(op.parent_keys, op.parent_keys_le, "parent_keys")
        keys = _keys(op.keys, op.keys_le, "keys")
        if len(parents) != len(keys):
            raise InvalidArgument(
                f"snapshot has {len(parents)} parent keys for {len(keys)} keys"
            )
        state = _state(op.state, "snapshot.state")
        if state is LedgerState.UNSPECIFIED:
            state = LedgerState.READY  # an in-sync ledger unless ingest says otherwise
        if state is LedgerState.REMOVED:
            raise InvalidArgument("a snapshot cannot be in state REMOVED (use remove_source)")
        return Snapshot(parents, keys, state, op.reason)
    if isinstance(op, WireRemoveSource):
        return RemoveSource(op.reason)
    raise InvalidArgument("ledger update has no op (unset)")


def update_from_wire(update: WireUpdate) -> LedgerUpdate:
    """A validated core update; :class:`InvalidArgument` names the first bad field."""
    return LedgerUpdate(
        source=source_from_wire(update.source),
        domain=domain_from_wire(update.domain),
        epoch=update.epoch,
        seq=update.seq,
        op=_op(update.op),
    )


# ---- replies ----------------------------------------------------------------------------


def _source_pb(source: Source) -> pb.Source:
    return pb.Source(worker_id=source.worker_id, dp_rank=source.dp_rank)


def workers_response(views: list[WorkerView], version: int) -> pb.WorkersResponse:
    return pb.WorkersResponse(
        workers=[
            pb.WorkerInfo(
                source=_source_pb(v.source),
                domain=domain_to_pb(v.domain),
                state=pb.LedgerState(int(v.state)),
                reason=v.reason,
                blocks=v.blocks,
                epoch=v.epoch,
                seq=v.seq,
                updated_unix_s=v.updated_unix_s,
            )
            for v in views
        ],
        index_version=version,
    )


def stats_response(stats: IndexStats, index_id: str) -> pb.StatsResponse:
    return pb.StatsResponse(
        blocks=stats.blocks,
        holdings=stats.holdings,
        bytes_estimate=stats.bytes_estimate,
        bytes_budget=stats.bytes_budget,
        evictions=stats.evictions,
        index_version=stats.version,
        domains=[
            pb.DomainStats(
                domain=domain_to_pb(d.domain),
                blocks=d.blocks,
                holdings=d.holdings,
                sources=d.sources,
            )
            for d in stats.domains
        ],
        index_id=index_id,
    )


def change_batch(change: ChangeSet) -> pb.ChangeBatch:
    """A feed message; removed keys travel in ``removed_keys_le`` only (uint64 LE)."""
    keys = change.keys()
    batch = pb.ChangeBatch(
        from_version=change.from_version,
        to_version=change.to_version,
        removed_blocks_sources=(
            [_source_pb(change.removed_source)] if change.removed_source is not None else []
        ),
        removed_keys_le=keys.astype("<u8", copy=False).tobytes() if keys.size else b"",
        cleared_sources=[_source_pb(s) for s in change.cleared],
        reset=change.reset,
    )
    if change.domain is not None:
        batch.domain = domain_to_pb(change.domain)
    return batch


def keys_from_le(data: bytes) -> list[int]:
    """Keys of a ``*_le`` field (for clients and tests)."""
    keys: list[int] = np.frombuffer(data, "<u8").tolist()
    return keys
