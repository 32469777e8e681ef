"""grpclib glue shared by every Cortex gRPC peer: the message codec, the method paths and
shared-secret authentication (:class:`TokenCheck` on the server, :func:`bearer` metadata on
the clients).

:class:`LedgerCodec` is grpclib's protobuf codec with three changes: a message whose bytes
were encoded once for many streams (``bytes``) passes through unchanged; bytes that do not
parse become ``INVALID_ARGUMENT`` for that call only (protobuf's ``DecodeError`` would
surface as an internal error); and a message over ``max_message_bytes`` is refused with
``RESOURCE_EXHAUSTED`` from its 5-byte length prefix, before its bytes are read (grpclib
has no such setting and reads a message whole before decoding it: its servers' and
channels' message reader is replaced, once, by :func:`_recv_bounded` when the first codec
is made; it bounds only streams whose codec is a :class:`LedgerCodec`).
"""

from __future__ import annotations

import hmac
import struct
from pathlib import Path
from typing import Any

import grpclib.client
import grpclib.server
from google.protobuf.message import DecodeError
from grpclib.const import Status
from grpclib.encoding.proto import ProtoCodec
from grpclib.events import RecvRequest, listen
from grpclib.exceptions import GRPCError
from grpclib.server import Server

from cortex.ledger.grpc_server import GrpcServer

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "PEER_METHODS",
    "QUERY_METHODS",
    "LedgerCodec",
    "TokenCheck",
    "bearer",
    "method",
    "read_token",
]

DEFAULT_MAX_MESSAGE_BYTES = 64 << 20
"""Largest message a Cortex peer accepts (bytes): a snapshot travels in 1 MiB batches, an
ingest batch is a few hundred KiB, a Match request at most 1 MiB of keys."""

_SERVICE = "/cortex.index.v1.Index/"


def method(name: str) -> str:
    """The path of an ``Index`` method, e.g. ``method("Match")``."""
    return _SERVICE + name


async def _recv_bounded(stream: Any, codec: Any, message_type: Any) -> Any:
    """grpclib's ``recv_message`` that reads the length prefix first and refuses a message
    longer than ``codec.max_message_bytes`` without reading it."""
    meta = await stream.recv_data(5)
    if not meta:
        return None
    if meta[0]:
        raise GRPCError(Status.UNIMPLEMENTED, "compressed messages are not supported")
    length: int = struct.unpack(">I", meta[1:])[0]
    limit = getattr(codec, "max_message_bytes", None)
    if limit is not None and length > limit:
        raise GRPCError(Status.RESOURCE_EXHAUSTED,
                        f"message of {length} bytes exceeds {limit}")
    data = await stream.recv_data(length)
    if len(data) != length:
        raise GRPCError(Status.INTERNAL, "the stream ended inside a message")
    return codec.decode(data, message_type)


def _bound_grpclib() -> None:
    """Install :func:`_recv_bounded` as grpclib's message reader (idempotent)."""
    grpclib.server.recv_message = _recv_bounded  # type: ignore[attr-defined]
    grpclib.client.recv_message = _recv_bounded  # type: ignore[attr-defined]


class LedgerCodec(ProtoCodec):
    def __init__(self, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> None:
        self.max_message_bytes = max_message_bytes
        _bound_grpclib()

    def encode(self, message: Any, message_type: Any) -> bytes:
        if isinstance(message, bytes):
            return message
        return super().encode(message, message_type)

    def decode(self, data: bytes, message_type: Any) -> Any:
        if len(data) > self.max_message_bytes:
            raise GRPCError(Status.RESOURCE_EXHAUSTED,
                            f"message of {len(data)} bytes exceeds {self.max_message_bytes}")
        try:
            return message_type.FromString(data)
        except DecodeError:
            name = getattr(message_type, "__name__", "message")
            raise GRPCError(Status.INVALID_ARGUMENT, f"malformed {name}") from None


# ---- shared-secret authentication -----------------------------------------------------------

PEER_METHODS = frozenset({method("Sync"), method("Replicate")})
"""Methods that change the ledger or copy all of it: Cortex's own peers (ingest, gateways)."""

QUERY_METHODS = frozenset({method("Match"), method("Workers"), method("Stats"),
                           method("Changes")})
"""Read-only queries (other schedulers, operators)."""


def read_token(path: str) -> str:
    """The secret in file ``path`` (surrounding whitespace dropped); ``ValueError`` when it is
    empty or unreadable, naming the file, never the content."""
    try:
        token = Path(path).read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ValueError(f"cannot read the token file {path}: {exc.strerror}") from None
    if not token:
        raise ValueError(f"the token file {path} is empty")
    return token


def bearer(token: str | None) -> dict[str, str] | None:
    """The call metadata that presents ``token`` (None: none to present)."""
    return {"authorization": f"Bearer {token}"} if token else None


class TokenCheck:
    """Who may call what: with a ``peer`` token, :data:`PEER_METHODS` need it; with a
    ``query`` token, :data:`QUERY_METHODS` need it or the peer token. Health and reflection
    stay open (probes). Install with :meth:`install`; a refused call ends with
    ``UNAUTHENTICATED`` before its handler runs. Comparisons are constant-time."""

    def __init__(self, peer: str | None, query: str | None) -> None:
        self.peer = peer.encode() if peer else None
        self.query = query.encode() if query else None
        self.refused = 0

    def install(self, server: Server) -> None:
        """Check every gRPC call of ``server`` (and its frames calls, on a ``GrpcServer``)."""
        listen(server, RecvRequest, self._on_request)
        if isinstance(server, GrpcServer):
            server.check = self._frames_allowed

    def _frames_allowed(self, method_name: str, presented: str | None) -> bool:
        if self.allowed(method_name, presented):
            return True
        self.refused += 1
        return False

    def allowed(self, method_name: str, presented: str | None) -> bool:
        if method_name in PEER_METHODS:
            accepted = [self.peer]
        elif method_name in QUERY_METHODS:
            if self.query is None:
                return True
            accepted = [self.query, self.peer]
        else:
            return True
        if accepted[0] is None:
            return True
        given = (presented or "").removeprefix("Bearer ").encode()
        return any(t is not None and hmac.compare_digest(given, t) for t in accepted)

    async def _on_request(self, event: RecvRequest) -> None:
        presented = None
        for key, value in event.metadata.items():
            if key == "authorization" and isinstance(value, str):
                presented = value
        if not self.allowed(event.method_name, presented):
            self.refused += 1
            raise GRPCError(Status.UNAUTHENTICATED, "a valid token is required for "
                            + event.method_name.rsplit("/", 1)[-1])
