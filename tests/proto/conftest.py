"""Fixtures of the contract tests: grpcio modules built from the committed .proto, and a
minimal grpclib Index server on 127.0.0.1 built on ``cortex.index.wire.IndexServiceBase``."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator

import pytest
from grpclib.const import Status
from grpclib.exceptions import GRPCError

from cortex.api.index.v1 import (
    ChangeBatch,
    ChangesRequest,
    Domain,
    EngineKind,
    LedgerState,
    MatchResponse,
    Source,
    SyncReply,
    WorkerMatch,
)
from cortex.index.grpc_server import GrpcServer
from cortex.index.grpcio_stubs import GrpcioStubs, load_grpcio_stubs
from cortex.index.wire import (
    IndexServiceBase,
    MatchDomain,
    MatchQuery,
    MatchReply,
    WireBatch,
    WorkerHit,
    pack_block_keys,
)

MASK64 = 2**64 - 1


@pytest.fixture(scope="session")
def grpcio_modules(tmp_path_factory: pytest.TempPathFactory) -> GrpcioStubs:
    """grpcio's ``index_pb2`` / ``index_pb2_grpc``, loaded once per process (protobuf's
    descriptor pool takes each message name once, so every test shares one loader)."""
    return load_grpcio_stubs(tmp_path_factory.mktemp("grpcio"))


def digest(query: MatchQuery) -> int:
    """What EchoIndex reports as index_version: proves the values, not just the counts."""
    return (sum(query.token_ids) * 31 + sum(query.block_keys)) & MASK64


class EchoIndex(IndexServiceBase):
    """Match reports what it decoded, per candidate worker; Sync (decoded by the wire hook)
    acks every batch with the sum of its seqs and resyncs epoch-0 sources; Changes streams
    two batches. Model ``bad`` is refused with INVALID_ARGUMENT."""

    async def match_query(self, query: MatchQuery) -> MatchReply | MatchResponse:
        if query.model == "bad":
            raise GRPCError(Status.INVALID_ARGUMENT, "unknown model 'bad'")
        workers = query.candidate_workers or ("w0",)
        if query.lora_name == "betterproto":  # the generated message is accepted too
            return MatchResponse(
                matches=[WorkerMatch(worker_id=w, matched_blocks=1) for w in workers],
                index_version=digest(query),
            )
        return MatchReply(
            matches=[
                WorkerHit(w, len(query.block_keys), len(query.token_ids), LedgerState.READY, i)
                for i, w in enumerate(workers)
            ],
            index_version=digest(query),
            query_blocks=query.max_blocks,
            domain=MatchDomain(query.model, query.block_size, query.engine),
        )

    async def sync_batches(self, batches: AsyncIterator[WireBatch]) -> AsyncIterator[SyncReply]:
        applied = 0
        async for batch in batches:
            applied += 1
            yield SyncReply(
                applied_batches=applied,
                index_version=sum(update.seq for update in batch.updates),
                resync=[
                    Source(worker_id=u.source.worker_id, dp_rank=u.source.dp_rank)
                    for u in batch.updates
                    if u.epoch == 0 and u.source is not None
                ],
                index_id=f"echo:{batch.ingest_id}",
            )

    async def changes(self, changes_request: ChangesRequest) -> AsyncIterator[ChangeBatch]:
        since = changes_request.since_version
        yield ChangeBatch(
            from_version=since,
            to_version=since + 1,
            domain=Domain(model=changes_request.model, block_size=16, engine=EngineKind.SGLANG),
            removed_blocks_sources=[Source(worker_id="w1", dp_rank=1)],
            removed_keys_le=pack_block_keys([MASK64, 1]),
        )
        yield ChangeBatch(from_version=since + 1, to_version=since + 2, reset=True)


@pytest.fixture
async def index_port() -> AsyncIterator[int]:
    """An EchoIndex served by grpclib on 127.0.0.1, on a port the OS picked."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port: int = sock.getsockname()[1]
    server = GrpcServer([EchoIndex()])  # closes accepted connections on shutdown
    await server.start(sock=sock)
    try:
        yield port
    finally:
        await server.shutdown()
