"""A typed grpclib client of the ``cortex.index.v1.Index`` service.

Every Cortex peer of the index (gateways, tools, tests) calls it through :class:`IndexStub`,
so no one repeats method paths, message types or the codec::

    async with Channel(host, port, codec=LedgerCodec()) as channel:  # or index_channel()
        stub = IndexStub(channel)
        reply = await stub.match(match_request("qwen", block_keys=keys), timeout=0.05)
        async for batch in stub.changes(pb.ChangesRequest()): ...

gRPC failures raise grpclib's errors (``GRPCError``, ``StreamTerminatedError``, ``OSError``);
callers translate them at their boundary.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

from grpclib.client import Channel
from grpclib.const import Cardinality

from cortex.api.index.v1 import index_grpc
from cortex.hashing import Engine, pack_keys, pack_tokens
from cortex.ledger.codec import ENGINE_KIND, pb
from cortex.ledger.frames import FramesChannel
from cortex.ledger.grpc import LedgerCodec, bearer, method

__all__ = ["IndexStub", "index_channel", "match_request", "stream_channel"]


def index_channel(target: str) -> Channel:
    """A channel to ``host:port`` (IPv6 hosts in brackets) with Cortex's codec."""
    host, _, port = target.rpartition(":")
    return Channel(host.strip("[]"), int(port), codec=LedgerCodec())


def stream_channel(target: str, *, frames: bool) -> Channel | FramesChannel:
    """A channel for Cortex's own streams (Sync, Replicate) to ``host:port``: Cortex frames
    (:mod:`cortex.ledger.frames`), or gRPC when ``frames`` is false (an index that refused
    frames, or an operator's choice)."""
    if not frames:
        return index_channel(target)
    host, _, port = target.rpartition(":")
    return FramesChannel(host.strip("[]"), int(port), codec=LedgerCodec())


def match_request(
    model: str,
    *,
    block_keys: Sequence[int] = (),
    token_ids: Sequence[int] = (),
    block_size: int = 0,
    engine: Engine | int | None = None,
    candidate_workers: Sequence[str] = (),
    max_blocks: int = 0,
    lora_name: str = "",
    cache_salt: str = "",
) -> pb.MatchRequest:
    """A MatchRequest with keys / tokens in the packed ``*_le`` twins."""
    kind = ENGINE_KIND[engine] if isinstance(engine, Engine) else int(engine or 0)
    return pb.MatchRequest(
        model=model,
        block_keys_le=pack_keys(block_keys) if len(block_keys) else b"",
        token_ids_le=pack_tokens(token_ids) if len(token_ids) else b"",
        block_size=block_size,
        engine=kind,  # type: ignore[arg-type]
        candidate_workers=list(candidate_workers),
        max_blocks=max_blocks,
        lora_name=lora_name,
        cache_salt=cache_salt,
    )


class IndexStub:
    """The Index methods on one channel; ``timeout`` in seconds (None: none); ``token``: the
    index's peer or query token, presented on every call (None: none)."""

    def __init__(self, channel: Channel, timeout: float | None = None,
                 token: str | None = None) -> None:
        self.channel = channel
        self.timeout = timeout
        self.metadata = bearer(token)
        self._stub = index_grpc.IndexStub(channel)

    def __repr__(self) -> str:
        return f"IndexStub({self.channel!r})"

    async def match(self, request: pb.MatchRequest, *, timeout: float | None = None
                    ) -> pb.MatchResponse:
        return await self._stub.Match(request, timeout=self._timeout(timeout),
                                       metadata=self.metadata)

    async def workers(self, request: pb.WorkersRequest, *, timeout: float | None = None
                      ) -> pb.WorkersResponse:
        return await self._stub.Workers(request, timeout=self._timeout(timeout),
                                       metadata=self.metadata)

    async def stats(self, request: pb.StatsRequest, *, timeout: float | None = None
                    ) -> pb.StatsResponse:
        return await self._stub.Stats(request, timeout=self._timeout(timeout),
                                       metadata=self.metadata)

    def _timeout(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout

    async def changes(self, request: pb.ChangesRequest) -> AsyncIterator[pb.ChangeBatch]:
        """The change feed until the server ends it (or the caller stops iterating)."""
        async with self.channel.request(method("Changes"), Cardinality.UNARY_STREAM,
                                        pb.ChangesRequest, pb.ChangeBatch,
                                        metadata=self.metadata) as stream:
            await stream.send_message(request, end=True)
            while (batch := await stream.recv_message()) is not None:
                yield batch
