"""The grpclib side of cortex.index.wire: the server hook, the client helpers, the guards.

The server is conftest's EchoIndex on 127.0.0.1 (Match: index_version = tokens*31 + keys,
mod 2**64; Sync: index_version = the sum of the batch's seqs).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable

import pytest
from grpclib.client import Channel
from grpclib.const import Cardinality, Status
from grpclib.exceptions import GRPCError

from cortex.api.index.v1 import (
    ChangesRequest,
    IndexStub,
    LedgerUpdate,
    MatchRequest,
    MatchResponse,
    SyncReply,
    UpdateBatch,
)
from cortex.index.client import SyncSession
from cortex.index.wire import (
    MATCH_METHOD,
    SYNC_METHOD,
    EncodedMessage,
    IndexServiceBase,
    MatchDomain,
    MatchQuery,
    MatchReply,
    UpdateBatchWire,
    WireBatch,
    WorkerHit,
    call_match,
    encode_match_request,
    match_request,
)

pytestmark = pytest.mark.timeout(30)
MASK64 = 2**64 - 1
TIMEOUT = 10.0  # s


@pytest.fixture
async def channel(index_port: int) -> AsyncIterator[Channel]:
    async with Channel("127.0.0.1", index_port) as channel:
        yield channel


async def test_call_match_with_precomputed_keys(channel: Channel) -> None:
    keys = [MASK64 - i for i in range(256)]
    request = encode_match_request(
        "llama", block_keys=keys, candidate_workers=["w1"], block_size=16, engine=1
    )
    reply = await call_match(channel, request, timeout=TIMEOUT)
    assert reply == MatchReply(
        matches=[WorkerHit("w1", 256, 0, 2, 0)],
        index_version=sum(keys) & MASK64,
        query_blocks=0,
        domain=MatchDomain("llama", 16, 1),
    )


async def test_call_match_with_tokens_and_metadata(channel: Channel) -> None:
    tokens = list(range(0, 2**32, 2**20))
    request = encode_match_request("m", token_ids=tokens, max_blocks=7)
    reply = await call_match(channel, request, timeout=TIMEOUT, metadata={"x-request-id": "r1"})
    assert reply.matches[0].matched_tokens == len(tokens)
    assert reply.index_version == sum(tokens) * 31 & MASK64
    assert reply.query_blocks == 7


async def test_generated_stub_round_trip(channel: Channel) -> None:
    """betterproto's IndexStub works against the hook, with either list encoding."""
    stub = IndexStub(channel, timeout=TIMEOUT)
    reply = await stub.match(match_request("m", block_keys=[MASK64, 5]))
    assert isinstance(reply, MatchResponse)
    assert (reply.matches[0].matched_blocks, reply.index_version) == (2, (MASK64 + 5) & MASK64)
    reply = await stub.match(MatchRequest(model="m", token_ids=[1, 2**31, 2**32 - 1]))
    assert reply.matches[0].matched_tokens == 3
    assert reply.index_version == (1 + 2**31 + 2**32 - 1) * 31 & MASK64


async def test_client_errors_come_back_as_invalid_argument(channel: Channel) -> None:
    with pytest.raises(GRPCError) as raised:
        await call_match(channel, encode_match_request("bad"), timeout=TIMEOUT)
    assert (raised.value.status, raised.value.message) == (
        Status.INVALID_ARGUMENT,
        "unknown model 'bad'",
    )
    with pytest.raises(GRPCError) as raised:
        await call_match(channel, b"\x5a\x03abc", timeout=TIMEOUT)
    assert raised.value.status is Status.INVALID_ARGUMENT
    assert raised.value.message == (
        "malformed MatchRequest: block_keys_le length is not a multiple of 8"
    )


async def test_other_rpcs_keep_their_generated_handlers(channel: Channel) -> None:
    stub = IndexStub(channel, timeout=TIMEOUT)
    batches = [batch async for batch in stub.changes(ChangesRequest(since_version=3))]
    assert [(b.from_version, b.to_version, b.reset) for b in batches] == [
        (3, 4, False),
        (4, 5, True),
    ]


class Counting(IndexServiceBase):
    async def match_query(self, query: MatchQuery) -> MatchReply:
        return MatchReply([WorkerHit("w", len(query.block_keys), len(query.token_ids), 2)])


async def test_in_process_match_takes_the_same_path() -> None:
    response = await Counting().match(match_request("m", token_ids=[1, 2, 3]))
    assert isinstance(response, MatchResponse)
    assert (response.matches[0].worker_id, response.matches[0].matched_tokens) == ("w", 3)


def test_mapping_swaps_only_match() -> None:
    mapping = Counting().__mapping__()
    assert len(mapping) == 5
    handler = mapping[MATCH_METHOD]
    assert handler.reply_type is EncodedMessage
    assert isinstance(handler.request_type.FromString(b"\x0a\x01m"), MatchQuery)
    assert mapping["/cortex.index.v1.Index/Sync"].request_type.__name__ == "UpdateBatch"


def test_overriding_match_is_refused() -> None:
    with pytest.raises(TypeError, match="implement match_query"):

        class Wrong(IndexServiceBase):  # pragma: no cover - never created
            async def match(self, match_request: MatchRequest) -> MatchResponse:
                return MatchResponse()


async def test_unimplemented_match_query() -> None:
    with pytest.raises(GRPCError) as raised:
        await IndexServiceBase().match_query(MatchQuery())
    assert raised.value.status is Status.UNIMPLEMENTED


# ---- Sync -----------------------------------------------------------------------------------


class Batches(IndexServiceBase):
    """Sync through the hook: each reply counts the batch's updates."""

    async def sync_batches(self, batches: AsyncIterator[WireBatch]) -> AsyncIterator[SyncReply]:
        applied = 0
        async for batch in batches:
            applied += 1
            yield SyncReply(applied_batches=applied, index_version=len(batch.updates),
                            index_id=batch.ingest_id)


class Generated(IndexServiceBase):
    """Sync with the generated signature: betterproto messages, as before the hook."""

    async def sync(
        self, update_batch_iterator: AsyncIterator[UpdateBatch]
    ) -> AsyncIterator[SyncReply]:
        async for batch in update_batch_iterator:
            yield SyncReply(index_id=type(batch).__name__)


async def each(batches: Iterable[UpdateBatch]) -> AsyncIterator[UpdateBatch]:
    for batch in batches:
        yield batch


def test_mapping_swaps_sync_only_for_sync_batches() -> None:
    handler = Batches().__mapping__()[SYNC_METHOD]
    assert (handler.request_type, handler.reply_type) == (UpdateBatchWire, SyncReply)
    assert handler.cardinality is Cardinality.STREAM_STREAM
    assert Generated().__mapping__()[SYNC_METHOD].request_type is UpdateBatch
    with pytest.raises(GRPCError) as raised:
        UpdateBatchWire.FromString(b"\x12\x02\x0a\x05")
    assert (raised.value.status, raised.value.message) == (
        Status.INVALID_ARGUMENT,
        "malformed UpdateBatch: updates[0]: length-delimited field overruns the message",
    )


def test_overriding_sync_and_sync_batches_is_refused() -> None:
    with pytest.raises(TypeError, match="both sync\\(\\) and sync_batches"):

        class Wrong(Batches):  # pragma: no cover - never created
            async def sync(
                self, update_batch_iterator: AsyncIterator[UpdateBatch]
            ) -> AsyncIterator[SyncReply]:
                yield SyncReply()


async def test_in_process_sync_takes_the_same_path() -> None:
    batches = [UpdateBatch(ingest_id="i", updates=[LedgerUpdate(seq=1)] * n) for n in (2, 0)]
    replies = [reply async for reply in Batches().sync(each(batches))]
    assert [(r.applied_batches, r.index_version, r.index_id) for r in replies] == [
        (1, 2, "i"), (2, 0, "i")]
    generated = [reply async for reply in Generated().sync(each(batches))]
    assert [r.index_id for r in generated] == ["UpdateBatch"] * 2
    with pytest.raises(GRPCError) as raised:
        await anext(IndexServiceBase().sync(each(batches)))
    assert raised.value.status is Status.UNIMPLEMENTED


async def test_malformed_batch_ends_only_its_stream(channel: Channel) -> None:
    """A batch that does not decode ends its stream with INVALID_ARGUMENT; another stream on
    the same connection carries on."""
    update = LedgerUpdate(seq=5)
    async with SyncSession(channel, ingest_id="good") as good:
        first = await good.send([update])
        async with channel.request(
            SYNC_METHOD, Cardinality.STREAM_STREAM, EncodedMessage, SyncReply, timeout=TIMEOUT
        ) as bad:
            await bad.send_message(EncodedMessage(bytes(UpdateBatch(updates=[update]))))
            accepted = await bad.recv_message()
            await bad.send_message(EncodedMessage(b"\x12\x03\x20\xff\xff"), end=True)
            assert await bad.recv_message() is None  # the stream ended ...
            with pytest.raises(GRPCError) as raised:  # ... with this status
                await bad.recv_trailing_metadata()
        second = await good.send([update, update])
    assert accepted is not None and accepted.applied_batches == 1
    assert raised.value.status is Status.INVALID_ARGUMENT
    assert raised.value.message == "malformed UpdateBatch: updates[0]: truncated varint"
    assert [(r.applied_batches, r.index_version, r.index_id) for r in (first, second)] == [
        (1, 5, "echo:good"), (2, 10, "echo:good")]
