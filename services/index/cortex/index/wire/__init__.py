"""Hand-written protobuf codecs for ``Index.Match`` and ``Index.Sync``, and the grpclib hook
that puts them in use.

Why: betterproto's pure-Python codec needs ~8 ms to decode a ``MatchRequest`` carrying 4,096
``repeated uint32 token_ids``, ~1 ms to encode a 32-worker ``MatchResponse`` and ~16 ms to
decode a 64-update ``UpdateBatch``. Here packed varints are decoded with numpy in one pass,
packed fixed64 and the ``*_le`` twins with one memcpy, and no betterproto object is built
(numbers: ``docs/bench/wire.md``, ``docs/bench/index.md``).

Modules (this package re-exports their public names):

- :mod:`~cortex.index.wire.codec`: wire primitives, :class:`WireError`, the twin packers;
- :mod:`~cortex.index.wire.match`: ``MatchRequest`` → :class:`MatchQuery`,
  :class:`MatchReply` ⇄ ``MatchResponse``, request encoders for clients;
- :mod:`~cortex.index.wire.updates`: ``UpdateBatch`` → :class:`WireBatch` of
  :class:`WireUpdate` records (unvalidated; ``cortex.index.convert`` validates);
- :mod:`~cortex.index.wire.hook`: :class:`IndexServiceBase` and :func:`call_match`.

The index server therefore writes::

    class IndexServer(IndexServiceBase):
        async def match_query(self, query: MatchQuery) -> MatchReply | MatchResponse: ...
        async def sync_batches(self, batches: AsyncIterator[WireBatch]
                               ) -> AsyncIterator[SyncReply]: ...
        async def workers(self, workers_request: WorkersRequest) -> WorkersResponse: ...
        # stats / changes: the generated signatures, unchanged

    grpclib.server.Server([IndexServer(...)])

It must not override ``match`` (that is the in-process entry, and the class refuses it);
``sync`` likewise becomes the in-process entry once ``sync_batches`` is implemented.

Client side (gateway): :func:`encode_match_request` builds request bytes through the ``*_le``
twins, :func:`call_match` sends them over a grpclib ``Channel`` and decodes the reply with
:func:`decode_match_response`; :func:`match_request` builds the generated message instead.

Decoding follows protobuf's rules: repeated scalars packed or not (even mixed), the last value
of a singular field wins, a repeated sub-message occurrence merges, a known field with an
unexpected wire type is skipped like an unknown field, unknown fields and groups are skipped,
uint32 values are truncated to 32 bits and int32 enums sign-extended as protobuf does,
strings must be UTF-8. Anything else raises :class:`WireError`, as does a ``MatchRequest``
``*_le`` twin whose length is not a whole number of items (an ``UpdateBatch`` twin is checked
per update by the index instead, so one bad update does not cost the batch).
"""

from __future__ import annotations

from cortex.index.wire.codec import WireError, pack_block_keys, pack_token_ids
from cortex.index.wire.hook import (
    MATCH_METHOD,
    SYNC_METHOD,
    EncodedMessage,
    IndexServiceBase,
    MatchReplyWire,
    MatchRequestWire,
    UpdateBatchWire,
    call_match,
)
from cortex.index.wire.match import (
    MatchDomain,
    MatchQuery,
    MatchReply,
    WorkerHit,
    decode_match_request,
    decode_match_response,
    encode_match_request,
    encode_match_response,
    match_request,
)
from cortex.index.wire.updates import (
    WireBatch,
    WireClear,
    WireDomain,
    WireOp,
    WireRemove,
    WireRemoveSource,
    WireSetState,
    WireSnapshot,
    WireSource,
    WireStore,
    WireUpdate,
    decode_update_batch,
)

__all__ = [
    "MATCH_METHOD",
    "SYNC_METHOD",
    "EncodedMessage",
    "IndexServiceBase",
    "MatchDomain",
    "MatchQuery",
    "MatchReply",
    "MatchReplyWire",
    "MatchRequestWire",
    "UpdateBatchWire",
    "WireBatch",
    "WireClear",
    "WireDomain",
    "WireError",
    "WireOp",
    "WireRemove",
    "WireRemoveSource",
    "WireSetState",
    "WireSnapshot",
    "WireSource",
    "WireStore",
    "WireUpdate",
    "WorkerHit",
    "call_match",
    "decode_match_request",
    "decode_match_response",
    "decode_update_batch",
    "encode_match_request",
    "encode_match_response",
    "match_request",
    "pack_block_keys",
    "pack_token_ids",
]
