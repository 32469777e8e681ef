"""Translation between the index's requests / replies and its core's values.

Updates and shared scalars go through :mod:`cortex.ledger.codec`; this module adds the
index's own queries. Anything malformed raises :class:`InvalidArgument` naming the field.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from cortex.hashing import Engine
from cortex.index.changes import ChangeSet
from cortex.index.prefix_index import IndexStats, WorkerView
from cortex.ledger.codec import (
    ENGINE_KIND,
    domain_to_pb,
    engine_from_kind,
    keys_from_le,
    match_to_pb,
    pb,
    source_to_pb,
)
from cortex.ledger.errors import InvalidArgument
from cortex.ledger.match import Match

__all__ = [
    "MatchArgs",
    "change_batch",
    "match_args",
    "match_reply",
    "stats_response",
    "workers_response",
]


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


def _tokens(request: pb.MatchRequest) -> Sequence[int] | None:
    if request.token_ids_le:
        if len(request.token_ids_le) % 4:
            raise InvalidArgument(
                f"token_ids_le length {len(request.token_ids_le)} is not a multiple of 4")
        tokens: list[int] = np.frombuffer(request.token_ids_le, "<u4").tolist()
        return tokens or None
    return list(request.token_ids) or None


def _block_keys(request: pb.MatchRequest) -> Sequence[int] | None:
    if request.block_keys_le:
        keys: list[int] = keys_from_le(request.block_keys_le, "block_keys_le").tolist()
        return keys or None
    return list(request.block_keys) or None


def match_args(request: pb.MatchRequest) -> MatchArgs:
    """The one request -> query conversion: a MatchRequest as core arguments."""
    if not request.model:
        raise InvalidArgument("model is required")
    return MatchArgs(
        model=request.model,
        block_keys=_block_keys(request),
        token_ids=_tokens(request),
        block_size=request.block_size,
        engine=engine_from_kind(request.engine, required=False),
        candidate_workers=tuple(w for w in request.candidate_workers if w),
        max_blocks=request.max_blocks,
        lora_name=request.lora_name,
        cache_salt=request.cache_salt,
    )


def match_reply(result: Match, requested: MatchArgs) -> pb.MatchResponse:
    """The MatchResponse of ``result``; without a domain, the one requested."""
    reply = pb.MatchResponse()
    match_to_pb(result, reply)
    if result.domain is None:
        reply.domain.model = requested.model
        reply.domain.block_size = requested.block_size
        if requested.engine is not None:
            reply.domain.engine = ENGINE_KIND[requested.engine]  # type: ignore[assignment]
    return reply


def workers_response(views: list[WorkerView], version: int) -> pb.WorkersResponse:
    reply = pb.WorkersResponse(index_version=version)
    for v in views:
        info = reply.workers.add(state=int(v.state), reason=v.reason,
                                 blocks=v.blocks, epoch=v.epoch, seq=v.seq,
                                 updated_unix_s=v.updated_unix_s)
        source_to_pb(v.source, info.source)
        domain_to_pb(v.domain, info.domain)
    return reply


def stats_response(stats: IndexStats, index_id: str) -> pb.StatsResponse:
    reply = pb.StatsResponse(
        blocks=stats.blocks,
        holdings=stats.holdings,
        bytes_estimate=stats.bytes_estimate,
        bytes_budget=stats.bytes_budget,
        evictions=stats.evictions,
        index_version=stats.version,
        index_id=index_id,
    )
    for d in stats.domains:
        msg = reply.domains.add(blocks=d.blocks, holdings=d.holdings, sources=d.sources)
        domain_to_pb(d.domain, msg.domain)
    return reply


def change_batch(change: ChangeSet) -> pb.ChangeBatch:
    """A feed message; removed keys travel in ``removed_keys_le`` only (uint64 LE)."""
    keys = change.keys()
    batch = pb.ChangeBatch(
        from_version=change.from_version,
        to_version=change.to_version,
        removed_keys_le=keys.astype("<u8", copy=False).tobytes() if keys.size else b"",
        reset=change.reset,
    )
    if change.removed_source is not None:
        source_to_pb(change.removed_source, batch.removed_blocks_sources.add())
    for source in change.cleared:
        source_to_pb(source, batch.cleared_sources.add())
    if change.domain is not None:
        domain_to_pb(change.domain, batch.domain)
    return batch
