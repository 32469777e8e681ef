"""grpclib glue: the server hook that feeds the hand-written codecs to an Index service, and
the client helpers of the Match fast path.

Server hook. grpclib decodes every request with ``request_type.FromString(data)``
(``grpclib.encoding.proto.ProtoCodec.decode``), where ``request_type`` is the third item of
the service's ``__mapping__()[path]`` ``Handler``; a reply goes through
``reply.SerializeToString()`` after an ``isinstance(reply, reply_type)`` check.
:class:`IndexServiceBase` subclasses the generated ``IndexBase`` and replaces

- the ``Match`` entry: request type :class:`MatchRequestWire`, whose ``FromString`` returns a
  :class:`MatchQuery`; reply type :class:`EncodedMessage`, carrying bytes from
  :func:`encode_match_response`;
- the ``Sync`` entry, when the subclass implements :meth:`IndexServiceBase.sync_batches`:
  request type :class:`UpdateBatchWire`, whose ``FromString`` returns a :class:`WireBatch`;
  replies stay generated ``SyncReply`` messages (one small message per batch).

Malformed request bytes become ``INVALID_ARGUMENT`` for that call or stream only.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, TypeVar, cast

import grpclib.client
import grpclib.server
from grpclib.const import Cardinality, Handler, Status
from grpclib.exceptions import GRPCError
from grpclib.metadata import Deadline, _MetadataLike

from cortex.api.index.v1 import IndexBase, MatchRequest, MatchResponse, SyncReply, UpdateBatch
from cortex.index.wire.codec import WireError
from cortex.index.wire.match import (
    MatchQuery,
    MatchReply,
    decode_match_request,
    decode_match_response,
    encode_match_response,
)
from cortex.index.wire.updates import WireBatch, decode_update_batch

__all__ = [
    "MATCH_METHOD",
    "SYNC_METHOD",
    "EncodedMessage",
    "IndexServiceBase",
    "MatchReplyWire",
    "MatchRequestWire",
    "UpdateBatchWire",
    "call_match",
]

MATCH_METHOD = "/cortex.index.v1.Index/Match"
SYNC_METHOD = "/cortex.index.v1.Index/Sync"

_T = TypeVar("_T")


class EncodedMessage:
    """Protobuf bytes that pass through grpclib's ``ProtoCodec`` unchanged, either way."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data

    def SerializeToString(self) -> bytes:  # the protobuf name grpclib calls
        return self.data

    @classmethod
    def FromString(cls, data: bytes) -> EncodedMessage:
        return cls(data)

    def __repr__(self) -> str:
        return f"EncodedMessage({len(self.data)} bytes)"


class MatchRequestWire:
    """Request type for a grpclib ``Handler``: decodes ``MatchRequest`` into a MatchQuery."""

    @staticmethod
    def FromString(data: bytes) -> MatchQuery:
        try:
            return decode_match_request(data)
        except WireError as exc:
            raise GRPCError(Status.INVALID_ARGUMENT, f"malformed MatchRequest: {exc}") from exc


class MatchReplyWire:
    """Reply type for a grpclib client call: decodes ``MatchResponse`` into a MatchReply."""

    @staticmethod
    def FromString(data: bytes) -> MatchReply:
        return decode_match_response(data)


class UpdateBatchWire:
    """Request type for a grpclib ``Handler``: decodes ``UpdateBatch`` into a WireBatch."""

    @staticmethod
    def FromString(data: bytes) -> WireBatch:
        try:
            return decode_update_batch(data)
        except WireError as exc:
            raise GRPCError(Status.INVALID_ARGUMENT, f"malformed UpdateBatch: {exc}") from exc


@asynccontextmanager
async def _closing(iterator: AsyncIterator[_T]) -> AsyncIterator[AsyncIterator[_T]]:
    """``contextlib.aclosing`` for any async iterator: an async generator's ``finally``
    blocks run when the stream ends, not whenever the generator is collected."""
    try:
        yield iterator
    finally:
        aclose = getattr(iterator, "aclose", None)
        if aclose is not None:
            await aclose()


def _overrides(cls: type, name: str) -> bool:
    return getattr(cls, name) is not getattr(IndexServiceBase, name)


class IndexServiceBase(IndexBase):
    """The generated ``IndexBase`` with Match (and Sync, on request) served by these codecs.

    Subclasses implement :meth:`match_query`, and for Sync either :meth:`sync_batches`
    (requests decoded by :func:`decode_update_batch`: the fast path) or the generated
    ``sync`` (betterproto decoding); the other RPCs keep their generated signatures.
    Overriding ``match``, or both ``sync`` and ``sync_batches``, is refused at class
    creation: gRPC calls would never reach the override.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "match" in cls.__dict__:
            raise TypeError(
                f"{cls.__name__} overrides match(); implement match_query(query: MatchQuery) "
                "instead: gRPC Match requests are decoded by cortex.index.wire"
            )
        if _overrides(cls, "sync") and _overrides(cls, "sync_batches"):
            raise TypeError(
                f"{cls.__name__} overrides both sync() and sync_batches(); gRPC Sync streams "
                "reach only sync_batches(): implement one of them"
            )

    async def match_query(self, query: MatchQuery) -> MatchReply | MatchResponse:
        """Answer one Match. Raise ``GRPCError`` for client errors (``INVALID_ARGUMENT``...)."""
        raise GRPCError(Status.UNIMPLEMENTED)

    async def match(self, match_request: MatchRequest) -> MatchResponse:
        """In-process Match with generated messages: same path as the wire, slower."""
        reply = await self.match_query(MatchQuery.from_message(match_request))
        if isinstance(reply, MatchReply):
            return MatchResponse().parse(encode_match_response(reply))
        return reply

    async def sync_batches(self, batches: AsyncIterator[WireBatch]) -> AsyncIterator[SyncReply]:
        """Answer one Sync stream: ``batches`` are the decoded requests, in order (the
        iterator raises ``GRPCError(INVALID_ARGUMENT)`` for one that does not decode).
        Raise ``GRPCError`` to end the stream with a status."""
        raise GRPCError(Status.UNIMPLEMENTED)
        yield SyncReply()  # pragma: no cover - makes this an async generator

    async def sync(
        self, update_batch_iterator: AsyncIterator[UpdateBatch]
    ) -> AsyncIterator[SyncReply]:
        """In-process Sync with generated messages: same path as the wire, slower."""

        async def batches() -> AsyncIterator[WireBatch]:
            async for batch in update_batch_iterator:
                yield WireBatch.from_message(batch)

        async with _closing(self.sync_batches(batches())) as replies:
            async for reply in replies:
                yield reply

    async def _rpc_match_query(
        self, stream: grpclib.server.Stream[MatchQuery, EncodedMessage]
    ) -> None:
        query = await stream.recv_message()
        if query is None:
            raise GRPCError(Status.INVALID_ARGUMENT, "Match needs a request message")
        reply = await self.match_query(query)
        data = encode_match_response(reply) if isinstance(reply, MatchReply) else bytes(reply)
        await stream.send_message(EncodedMessage(data))

    async def _rpc_sync_batches(self, stream: grpclib.server.Stream[WireBatch, SyncReply]) -> None:
        async with _closing(self.sync_batches(stream.__aiter__())) as replies:
            async for reply in replies:
                await stream.send_message(reply)

    def __mapping__(self) -> dict[str, Handler]:
        mapping: dict[str, Handler] = dict(super().__mapping__())
        mapping[MATCH_METHOD] = Handler(
            self._rpc_match_query, Cardinality.UNARY_UNARY, MatchRequestWire, EncodedMessage
        )
        if _overrides(type(self), "sync_batches"):
            mapping[SYNC_METHOD] = Handler(
                self._rpc_sync_batches, Cardinality.STREAM_STREAM, UpdateBatchWire, SyncReply
            )
        return mapping


async def call_match(
    channel: grpclib.client.Channel,
    request: bytes,
    *,
    timeout: float | None = None,
    deadline: Deadline | None = None,
    metadata: _MetadataLike | None = None,
) -> MatchReply:
    """One Match over a grpclib channel: ``request`` from :func:`encode_match_request`.

    ``timeout`` in seconds; the smaller of it and ``deadline`` bounds the call. Raises
    grpclib's ``GRPCError`` / ``StreamTerminatedError`` as a generated stub would, and
    :class:`WireError` for a reply that does not decode.
    """
    async with channel.request(
        MATCH_METHOD,
        Cardinality.UNARY_UNARY,
        EncodedMessage,
        MatchReplyWire,
        timeout=timeout,
        deadline=deadline,
        metadata=metadata,
    ) as stream:
        await stream.send_message(EncodedMessage(request), end=True)
        reply = await stream.recv_message()
    if reply is None:  # grpclib raises before a unary call ends without a message
        raise WireError("Match returned no message")
    return cast(MatchReply, reply)  # what MatchReplyWire.FromString returns
