"""grpclib glue shared by every Cortex gRPC peer: the message codec and the method paths.

:class:`LedgerCodec` is grpclib's protobuf codec with three changes: a message whose bytes
were encoded once for many streams (``bytes``) passes through unchanged; bytes that do not
parse become ``INVALID_ARGUMENT`` for that call only (protobuf's ``DecodeError`` would
surface as an internal error); and a message over ``max_message_bytes`` is refused with
``RESOURCE_EXHAUSTED`` before it is parsed.
"""

from __future__ import annotations

from typing import Any

from google.protobuf.message import DecodeError
from grpclib.const import Status
from grpclib.encoding.proto import ProtoCodec
from grpclib.exceptions import GRPCError

__all__ = ["DEFAULT_MAX_MESSAGE_BYTES", "LedgerCodec", "method"]

DEFAULT_MAX_MESSAGE_BYTES = 64 << 20
"""Largest message a Cortex peer accepts (bytes): a snapshot travels in 1 MiB batches, an
ingest batch is a few hundred KiB, a Match request at most 1 MiB of keys."""

_SERVICE = "/cortex.index.v1.Index/"


def method(name: str) -> str:
    """The path of an ``Index`` method, e.g. ``method("Match")``."""
    return _SERVICE + name


class LedgerCodec(ProtoCodec):
    def __init__(self, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> None:
        self.max_message_bytes = max_message_bytes

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
