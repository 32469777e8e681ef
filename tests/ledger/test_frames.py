"""Cortex frames (cortex.ledger.frames) and the GrpcServer that sniffs them, on 127.0.0.1:
the frame reader over any split of the bytes; one port answering gRPC and frames calls with
the same handlers; streams in order both ways; a token check, a malformed message, a message
over the bound and an unknown method refused with gRPC's statuses, nothing reaching the
handler; a server that speaks only gRPC refusing the preface; a shutdown ending open calls."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
from grpclib.client import Channel
from grpclib.const import Cardinality, Handler, Status
from grpclib.exceptions import GRPCError, ProtocolError, StreamTerminatedError
from grpclib.server import Server

from cortex.ledger.codec import pb
from cortex.ledger.frames import (
    PREFACE,
    FrameReader,
    FramesChannel,
    FramesRefused,
    FrameTooLarge,
    Kind,
    frame,
)
from cortex.ledger.grpc import LedgerCodec, TokenCheck, bearer, method
from cortex.ledger.grpc_server import GrpcServer

pytestmark = pytest.mark.timeout(30)

SYNC = method("Sync")
WORKERS = method("Workers")


class Echo:
    """Sync answers each batch with the count so far; Workers answers one request."""

    def __init__(self) -> None:
        self.batches: list[pb.UpdateBatch] = []
        self.transports: list[str] = []
        self.running = 0
        self.release = asyncio.Event()
        self.release.set()

    def __mapping__(self) -> dict[str, Handler]:
        return {
            SYNC: Handler(self.sync, Cardinality.STREAM_STREAM, pb.UpdateBatch, pb.SyncReply),
            WORKERS: Handler(self.workers, Cardinality.UNARY_UNARY, pb.WorkersRequest,
                             pb.WorkersResponse),
        }

    async def sync(self, stream: Any) -> None:
        self.transports.append(type(stream).__name__)
        self.running += 1
        try:
            async for batch in stream:
                await self.release.wait()
                self.batches.append(batch)
                await stream.send_message(pb.SyncReply(applied_batches=len(self.batches),
                                                       index_id=batch.ingest_id))
        finally:
            self.running -= 1

    async def workers(self, stream: Any) -> None:
        request = await stream.recv_message()
        await stream.send_message(pb.WorkersResponse(
            workers=[pb.WorkerInfo(source=pb.Source(worker_id=request.model or "none"))]))


@contextlib.asynccontextmanager
async def serving(server: Server) -> AsyncIterator[int]:
    await server.start("127.0.0.1", 0)
    try:
        yield server._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    finally:
        if isinstance(server, GrpcServer):
            await server.shutdown()
        else:
            server.close()
            await server.wait_closed()


def test_frames_come_out_whole_from_any_split_of_the_bytes() -> None:
    wire = b"".join([frame(Kind.CALL, b"/a/B\n"), frame(Kind.MESSAGE, b"x" * 300),
                     frame(Kind.MESSAGE), frame(Kind.END), frame(Kind.STATUS, b"\x00")])
    expected = [(Kind.CALL, b"/a/B\n"), (Kind.MESSAGE, b"x" * 300), (Kind.MESSAGE, b""),
                (Kind.END, b""), (Kind.STATUS, b"\x00")]
    for step in (1, 2, 5, 7, 64, len(wire)):
        reader = FrameReader()
        got = []
        for at in range(0, len(wire), step):
            got += reader.feed(wire[at:at + step])
        assert got == expected, step


def test_a_frame_over_the_bound_is_refused_from_its_header_and_unknown_kinds_are_errors() -> None:
    with pytest.raises(FrameTooLarge, match="exceeds 1024"):
        FrameReader(1024).feed(frame(Kind.MESSAGE, b"y" * 2048)[:5])  # the header alone
    assert FrameReader(1024).feed(frame(Kind.MESSAGE, b"y" * 1024)) == [
        (Kind.MESSAGE, b"y" * 1024)]
    with pytest.raises(ProtocolError, match="kind 9"):
        FrameReader().feed(b"\x00\x00\x00\x00\x09")


async def test_one_port_serves_grpc_and_frames_with_the_same_handlers_in_order() -> None:
    echo = Echo()
    async with serving(GrpcServer([echo], codec=LedgerCodec())) as port:
        async with FramesChannel("127.0.0.1", port, codec=LedgerCodec()) as channel:
            async with channel.request(SYNC, Cardinality.STREAM_STREAM, pb.UpdateBatch,
                                       pb.SyncReply) as call:
                await call.send_request()
                for i in range(200):
                    await call.send_message(pb.UpdateBatch(ingest_id=f"f{i}"))
                replies = [await call.recv_message() for _ in range(200)]
                await call.end()
                assert await call.recv_message() is None  # the handler returned: OK
            assert [(r.applied_batches, r.index_id) for r in replies] == [
                (i + 1, f"f{i}") for i in range(200)]
            async with channel.request(WORKERS, Cardinality.UNARY_UNARY, pb.WorkersRequest,
                                       pb.WorkersResponse) as unary:
                await unary.send_message(pb.WorkersRequest(model="m"), end=True)
                answer = await unary.recv_message()
            assert answer.workers[0].source.worker_id == "m"
        grpc = Channel("127.0.0.1", port, codec=LedgerCodec())
        try:
            async with grpc.request(SYNC, Cardinality.STREAM_STREAM, pb.UpdateBatch,
                                    pb.SyncReply) as stream:
                await stream.send_message(pb.UpdateBatch(ingest_id="g"), end=True)
                reply = await stream.recv_message()
            assert reply is not None and (reply.applied_batches, reply.index_id) == (201, "g")
        finally:
            grpc.close()
    assert echo.transports == ["ServedCall", "Stream"]


async def test_refused_calls_end_with_grpc_statuses_and_reach_no_handler() -> None:
    echo = Echo()
    server = GrpcServer([echo], codec=LedgerCodec(1 << 20))
    tokens = TokenCheck(peer="s3cret", query=None)
    tokens.install(server)
    async with serving(server) as port:
        channel = FramesChannel("127.0.0.1", port, codec=LedgerCodec())

        async def sync(*messages: Any, token: str | None = "s3cret") -> Any:
            async with channel.request(SYNC, Cardinality.STREAM_STREAM, pb.UpdateBatch,
                                       pb.SyncReply, metadata=bearer(token)) as call:
                for message in messages:
                    await call.send_message(message)
                await call.end()
                return await call.recv_message()

        for token in (None, "wrong"):
            with pytest.raises(GRPCError) as refused:
                await sync(pb.UpdateBatch(ingest_id="x"), token=token)
            assert refused.value.status is Status.UNAUTHENTICATED
        assert tokens.refused == 2
        with pytest.raises(GRPCError) as malformed:
            await sync(b"\xff\xff\xff")  # not an UpdateBatch
        assert malformed.value.status is Status.INVALID_ARGUMENT
        with pytest.raises(GRPCError) as large:
            await sync(pb.UpdateBatch(ingest_id="z" * (2 << 20)))
        assert large.value.status is Status.RESOURCE_EXHAUSTED
        async with channel.request(method("Nope"), Cardinality.UNARY_UNARY, pb.WorkersRequest,
                                   pb.WorkersResponse) as unknown:
            await unknown.send_message(pb.WorkersRequest(), end=True)
            with pytest.raises(GRPCError) as missing:
                await unknown.recv_message()
        assert missing.value.status is Status.UNIMPLEMENTED
        assert echo.batches == []  # nothing got through
        assert (await sync(pb.UpdateBatch(ingest_id="ok"))).index_id == "ok"


async def test_a_server_that_speaks_only_grpc_refuses_the_preface() -> None:
    async with serving(Server([Echo()], codec=LedgerCodec())) as port:
        channel = FramesChannel("127.0.0.1", port, codec=LedgerCodec())
        async with channel.request(SYNC, Cardinality.STREAM_STREAM, pb.UpdateBatch,
                                   pb.SyncReply) as call:
            with pytest.raises(FramesRefused):
                await call.send_request()
    assert PREFACE[:1] != b"P"  # HTTP/2's client preface begins "PRI * HTTP/2.0"


async def test_a_shutdown_ends_open_frames_calls_and_their_handlers() -> None:
    echo = Echo()
    server = GrpcServer([echo], codec=LedgerCodec())
    await server.start("127.0.0.1", 0)
    port = server._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    channel = FramesChannel("127.0.0.1", port, codec=LedgerCodec())
    async with channel.request(SYNC, Cardinality.STREAM_STREAM, pb.UpdateBatch,
                               pb.SyncReply) as call:
        await call.send_message(pb.UpdateBatch(ingest_id="a"))
        assert (await call.recv_message()).applied_batches == 1
        echo.release.clear()  # the next batch waits inside the handler
        await call.send_message(pb.UpdateBatch(ingest_id="b"))
        await server.shutdown(timeout_s=5.0)
        with pytest.raises(StreamTerminatedError):
            await call.recv_message()
    assert echo.running == 0 and server.connections == 0
