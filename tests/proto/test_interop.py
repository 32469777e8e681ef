"""A plain grpcio client, generated from the same .proto, against the grpclib Index server.

The server (conftest.EchoIndex) decodes Match and Sync through cortex.index.wire; grpcio's
blocking client runs in a worker thread so the event loop keeps serving.
"""

from __future__ import annotations

import asyncio
import queue
import struct
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest

from cortex.index.grpcio_stubs import GrpcioStubs

pytestmark = pytest.mark.timeout(30)
MASK64 = 2**64 - 1
TIMEOUT = 10.0  # s, per call


def digest(tokens: list[int], keys: list[int]) -> int:
    return (sum(tokens) * 31 + sum(keys)) & MASK64


async def call(grpcio: GrpcioStubs, port: int, fn: Any) -> Any:
    """Run ``fn(stub, pb2)`` with a fresh grpcio channel, off the event loop."""

    def run() -> Any:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            return fn(grpcio.grpc.IndexStub(channel), grpcio.pb2)

    return await asyncio.to_thread(run)


@pytest.fixture
def tokens() -> list[int]:
    # 4,096 tokens, a third of them >= 2**21 (4-5 byte varints on the wire)
    rng = np.random.default_rng(11)
    small = rng.integers(0, 2**17, 4096, dtype=np.uint64)
    large = rng.integers(2**21, 2**32, 4096, dtype=np.uint64)
    mixed: list[int] = np.where(np.arange(4096) % 3 == 0, large, small).tolist()
    return mixed


@pytest.fixture
def keys() -> list[int]:
    return [MASK64 - i for i in range(256)]


async def test_match_with_token_ids(
    grpcio_modules: GrpcioStubs, index_port: int, tokens: list[int]
) -> None:
    def match(stub: Any, pb2: Any) -> Any:
        request = pb2.MatchRequest(
            model="llama",
            token_ids=tokens,
            candidate_workers=["w1", "w2"],
            max_blocks=256,
            block_size=16,
            engine=pb2.ENGINE_KIND_VLLM,
        )
        return stub.Match(request, timeout=TIMEOUT)

    reply = await call(grpcio_modules, index_port, match)
    assert [
        (m.worker_id, m.matched_tokens, m.matched_blocks, m.dp_rank) for m in reply.matches
    ] == [
        ("w1", 4096, 0, 0),
        ("w2", 4096, 0, 1),
    ]
    assert reply.matches[0].state == grpcio_modules.pb2.LEDGER_STATE_READY
    assert reply.index_version == digest(tokens, [])
    assert reply.query_blocks == 256
    assert (reply.domain.model, reply.domain.block_size, reply.domain.engine) == ("llama", 16, 2)


async def test_match_with_block_keys_near_2_64(
    grpcio_modules: GrpcioStubs, index_port: int, keys: list[int]
) -> None:
    def match(stub: Any, pb2: Any) -> Any:
        return stub.Match(pb2.MatchRequest(model="m", block_keys=keys), timeout=TIMEOUT)

    reply = await call(grpcio_modules, index_port, match)
    assert [(m.worker_id, m.matched_blocks) for m in reply.matches] == [("w0", 256)]
    assert reply.index_version == digest([], keys)


async def test_match_with_le_twins_winning(
    grpcio_modules: GrpcioStubs, index_port: int, tokens: list[int], keys: list[int]
) -> None:
    def match(stub: Any, pb2: Any) -> Any:
        request = pb2.MatchRequest(
            model="m",
            token_ids=[1, 2, 3],  # both forms set: the bytes twins win
            block_keys=[4],
            token_ids_le=struct.pack(f"<{len(tokens)}I", *tokens),
            block_keys_le=struct.pack(f"<{len(keys)}Q", *keys),
        )
        return stub.Match(request, timeout=TIMEOUT)

    reply = await call(grpcio_modules, index_port, match)
    assert (reply.matches[0].matched_tokens, reply.matches[0].matched_blocks) == (4096, 256)
    assert reply.index_version == digest(tokens, keys)


async def test_match_answered_with_a_generated_message(
    grpcio_modules: GrpcioStubs, index_port: int
) -> None:
    def match(stub: Any, pb2: Any) -> Any:
        request = pb2.MatchRequest(model="m", token_ids=[7], lora_name="betterproto")
        return stub.Match(request, timeout=TIMEOUT)

    reply = await call(grpcio_modules, index_port, match)
    assert [(m.worker_id, m.matched_blocks) for m in reply.matches] == [("w0", 1)]
    assert reply.index_version == 7 * 31


async def test_server_invalid_argument_reaches_grpcio(
    grpcio_modules: GrpcioStubs, index_port: int
) -> None:
    def match(stub: Any, pb2: Any) -> Any:
        with pytest.raises(grpc.RpcError) as raised:
            stub.Match(pb2.MatchRequest(model="bad"), timeout=TIMEOUT)
        return raised.value

    error = await call(grpcio_modules, index_port, match)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == "unknown model 'bad'"


async def test_malformed_bytes_are_invalid_argument(
    grpcio_modules: GrpcioStubs, index_port: int
) -> None:
    """Raw bytes through a generic grpcio call: the wire decoder's error, not UNKNOWN."""

    def match(stub: Any, pb2: Any) -> Any:
        with grpc.insecure_channel(f"127.0.0.1:{index_port}") as channel:
            raw = channel.unary_unary("/cortex.index.v1.Index/Match")
            with pytest.raises(grpc.RpcError) as raised:
                raw(b"\x12\x05\x80\x80", timeout=TIMEOUT)  # packed field cut short
            return raised.value

    error = await call(grpcio_modules, index_port, match)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details().startswith("malformed MatchRequest:")


async def test_sync_bidirectional_round_trip(grpcio_modules: GrpcioStubs, index_port: int) -> None:
    """Send a batch, wait for its ack, send the next: a true interleaved stream."""

    def sync(stub: Any, pb2: Any) -> Any:
        outbox: queue.Queue[Any] = queue.Queue()

        def requests() -> Iterator[Any]:
            while (batch := outbox.get(timeout=TIMEOUT)) is not None:
                yield batch

        def batch(seqs: list[int], epoch: int) -> Any:
            updates = [
                pb2.LedgerUpdate(
                    source=pb2.Source(worker_id=f"w{seq}", dp_rank=seq),
                    domain=pb2.Domain(model="m", block_size=16, engine=pb2.ENGINE_KIND_SGLANG),
                    epoch=epoch,
                    seq=seq,
                    store=pb2.StoreBlocks(parent_key=MASK64, keys_le=b"\xff" * 16),
                )
                for seq in seqs
            ]
            return pb2.UpdateBatch(ingest_id="ingest-0", updates=updates)

        replies = stub.Sync(requests(), timeout=TIMEOUT)
        outbox.put(batch([1, 2], epoch=1))
        first = next(replies)
        outbox.put(batch([3], epoch=0))
        second = next(replies)
        outbox.put(None)
        rest = list(replies)
        return first, second, rest

    first, second, rest = await call(grpcio_modules, index_port, sync)
    assert (first.applied_batches, first.index_version, list(first.resync)) == (1, 3, [])
    assert first.index_id == "echo:ingest-0"
    assert (second.applied_batches, second.index_version) == (2, 3)
    assert [(s.worker_id, s.dp_rank) for s in second.resync] == [("w3", 3)]
    assert rest == []


async def test_changes_server_stream(grpcio_modules: GrpcioStubs, index_port: int) -> None:
    def changes(stub: Any, pb2: Any) -> Any:
        request = pb2.ChangesRequest(since_version=41, model="m")
        return list(stub.Changes(request, timeout=TIMEOUT))

    first, second = await call(grpcio_modules, index_port, changes)
    assert (first.from_version, first.to_version, first.reset) == (41, 42, False)
    assert first.domain.model == "m"
    assert [(s.worker_id, s.dp_rank) for s in first.removed_blocks_sources] == [("w1", 1)]
    assert struct.unpack("<2Q", first.removed_keys_le) == (MASK64, 1)
    assert (second.from_version, second.to_version, second.reset) == (42, 43, True)


async def test_unimplemented_rpc_is_reported(grpcio_modules: GrpcioStubs, index_port: int) -> None:
    def stats(stub: Any, pb2: Any) -> Any:
        with pytest.raises(grpc.RpcError) as raised:
            stub.Stats(pb2.StatsRequest(), timeout=TIMEOUT)
        return raised.value.code()

    assert await call(grpcio_modules, index_port, stats) == grpc.StatusCode.UNIMPLEMENTED
