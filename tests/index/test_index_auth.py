"""Who may call what on the index: a peer token guards the ledger's write and copy paths
(Sync, Replicate), an optional query token the reads; health stays open; a refused call
changes nothing. Real gRPC on 127.0.0.1."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from grpclib.client import Channel
from grpclib.const import Cardinality, Status
from grpclib.exceptions import GRPCError
from grpclib.health.v1.health_grpc import HealthStub
from grpclib.health.v1.health_pb2 import HealthCheckRequest, HealthCheckResponse

from cortex.hashing import Engine, HashDomain
from cortex.index.config import IndexConfig
from cortex.index.server import IndexServer
from cortex.ledger.client import IndexStub, match_request
from cortex.ledger.codec import pb
from cortex.ledger.grpc import LedgerCodec, bearer, method
from cortex.testing.index_sync import LedgerUpdates, SyncSession

pytestmark = pytest.mark.timeout(30)
DOMAIN = HashDomain("m", 16, Engine.SGLANG)
PEER, QUERY = "peer-secret-4f1c", "query-secret-9a2e"


@pytest.fixture
async def guarded(tmp_path: Path) -> AsyncIterator[tuple[IndexServer, Channel]]:
    (tmp_path / "peer").write_text(PEER + "\n")
    (tmp_path / "query").write_text(QUERY)
    config = IndexConfig(host="127.0.0.1", port=0, metrics_port=None,
                         peer_token_file=str(tmp_path / "peer"),
                         query_token_file=str(tmp_path / "query"))
    async with IndexServer(config) as server:
        host, _, port = server.target.rpartition(":")
        channel = Channel(host, int(port), codec=LedgerCodec())
        try:
            yield server, channel
        finally:
            channel.close()


async def test_an_unauthenticated_sync_changes_no_ledger(
        guarded: tuple[IndexServer, Channel]) -> None:
    server, channel = guarded
    keys = DOMAIN.keys(list(range(64)))
    real = LedgerUpdates("w0", DOMAIN)
    async with SyncSession(channel, token=PEER) as session:
        reply = await session.send([real.chain_snapshot([(DOMAIN.root_key(), keys)])])
    assert reply.applied_batches == 1
    # the reported attack: a snapshot with a future epoch for a real worker
    fake = LedgerUpdates("w0", DOMAIN, epoch=real.epoch + 10)
    for token in (None, "wrong", QUERY):
        with pytest.raises(GRPCError) as refused:
            async with SyncSession(channel, token=token) as session:
                await session.send([fake.chain_snapshot([(DOMAIN.root_key(), keys[:1])])])
        assert refused.value.status is Status.UNAUTHENTICATED
    match = await IndexStub(channel, token=QUERY).match(
        match_request(DOMAIN.model, block_keys=keys))
    assert [(m.worker_id, m.matched_blocks) for m in match.matches] == [("w0", 4)]
    assert server.tokens.refused == 3


async def test_replicas_need_the_peer_token_and_queries_a_query_token(
        guarded: tuple[IndexServer, Channel]) -> None:
    _, channel = guarded

    async def replicate(token: str | None) -> pb.ReplicaBatch | None:
        async with channel.request(method("Replicate"), Cardinality.STREAM_STREAM,
                                   pb.ReplicaRequest, pb.ReplicaBatch,
                                   metadata=bearer(token)) as stream:
            await stream.send_message(pb.ReplicaRequest(replica_id="t"))
            batch = await stream.recv_message()
            await stream.cancel()
            return batch

    with pytest.raises(GRPCError) as refused:
        await replicate(QUERY)
    assert refused.value.status is Status.UNAUTHENTICATED
    first = await replicate(PEER)
    assert first is not None and first.snapshot and first.synced
    request = match_request(DOMAIN.model, block_keys=[1, 2])
    with pytest.raises(GRPCError) as refused:
        await IndexStub(channel).match(request)
    assert refused.value.status is Status.UNAUTHENTICATED
    for token in (QUERY, PEER):  # the peer token reads too
        assert (await IndexStub(channel, token=token).match(request)).query_blocks == 2
    health = await HealthStub(channel).Check(HealthCheckRequest(service=""))
    assert health.status == HealthCheckResponse.SERVING  # probes need no secret


async def test_an_unreadable_or_empty_token_file_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "empty").write_text("  \n")
    for path, message in ((tmp_path / "missing", "cannot read"), (tmp_path / "empty", "empty")):
        with pytest.raises(ValueError, match=message):
            IndexServer(IndexConfig(host="127.0.0.1", port=0, metrics_port=None,
                                    peer_token_file=str(path)))
