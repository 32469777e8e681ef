"""The gateway's gRPC Match (used while its replica cannot answer) against a real index on
127.0.0.1: offload tiers come back as sources of their own, folded like the replica's."""

from __future__ import annotations

import time

import pytest
from grpclib.client import Channel

from cortex.gateway.config.gateway import IndexConfig as GatewayIndexConfig
from cortex.gateway.ledger.index_client import IndexClient
from cortex.gateway.ledger.replica_client import fold_sources
from cortex.gateway.metrics import GatewayMetrics
from cortex.hashing import Engine, HashDomain
from cortex.index.config import IndexConfig
from cortex.index.server import IndexServer
from cortex.ledger.codec import pb
from cortex.ledger.match import SourceMatch
from cortex.ledger.model import LedgerState, Source, Tier
from cortex.testing.index_sync import LedgerUpdates, SyncSession

pytestmark = pytest.mark.timeout(30)

DOMAIN = HashDomain("m", 4, Engine.VLLM)
READY = LedgerState.READY


async def test_grpc_match_carries_offload_tiers() -> None:
    config = IndexConfig(host="127.0.0.1", port=0, metrics_host="127.0.0.1", metrics_port=0)
    keys = DOMAIN.keys(list(range(1, 25)))
    root = DOMAIN.root_key()
    async with IndexServer(config) as server:
        channel = Channel("127.0.0.1", server.port)
        try:
            w0 = LedgerUpdates("w0", DOMAIN)
            host = LedgerUpdates("w0", DOMAIN, tier=pb.TIER_HOST)
            shared = LedgerUpdates("w1", DOMAIN, tier=pb.TIER_SHARED)
            async with SyncSession(channel) as session:
                await session.send([w0.snapshot([], []), w0.store(root, keys[:1]),
                                    host.snapshot([], []), host.store(root, keys[:4]),
                                    shared.snapshot([], []), shared.store(root, keys)])
        finally:
            channel.close()
        client_config = GatewayIndexConfig(targets=(f"127.0.0.1:{server.port}",),
                                           match_timeout_ms=2000.0)
        async with IndexClient(client_config, GatewayMetrics(), lambda _: None,
                               polling=lambda: False) as client:
            answer = await client.match(DOMAIN, keys, time.monotonic() + 5.0)
    assert answer is not None
    assert set(answer.sources) == {SourceMatch(Source("w0", 0), 1, READY),
                                   SourceMatch(Source("w0", 0, Tier.HOST), 3, READY)}
    folded = fold_sources(answer.sources)["w0"]
    assert (folded.ready_blocks, folded.host_blocks) == (1, 3)
