"""``Index.Match`` messages without betterproto: ``MatchRequest`` decoded into a
:class:`MatchQuery`, ``MatchResponse`` written from (and read into) a :class:`MatchReply`.

Why: betterproto needs ~8 ms to decode a ``MatchRequest`` carrying 4,096 ``repeated uint32
token_ids`` and ~1 ms to encode a 32-worker ``MatchResponse``; other schedulers call Match
from grpcio clients with exactly that encoding (numbers: ``docs/bench/wire.md``).

Decoding follows protobuf's rules (:mod:`cortex.index.wire.codec`): repeated scalars packed
or not (even mixed), the last value of a singular field wins, a known field with an
unexpected wire type is skipped like an unknown field, uint32 values are truncated to 32
bits and int32 enums sign-extended. One rule is Cortex's own: a ``*_le`` twin whose length
is not a whole number of items is a :class:`WireError`.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from cortex.api.index.v1 import MatchRequest, MatchResponse
from cortex.index.wire.codec import (
    MASK32,
    WireError,
    as_int32,
    le_array,
    pack_block_keys,
    pack_token_ids,
    put_bytes,
    put_uint,
    put_varint,
    read_fixed64,
    read_packed_varints,
    read_span,
    read_tag,
    read_text,
    read_varint,
    skip_field,
    unpacked_varints,
)

__all__ = [
    "MatchDomain",
    "MatchQuery",
    "MatchReply",
    "WorkerHit",
    "decode_match_request",
    "decode_match_response",
    "encode_match_request",
    "encode_match_response",
    "match_request",
]


# ---- typed views ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class MatchQuery:
    """A decoded ``MatchRequest``, with the ``*_le`` twins already resolved.

    ``token_ids`` (``array('I')``, tokens) and ``block_keys`` (``array('Q')``, Cortex keys)
    hold the ``_le`` bytes when those were set, else the repeated field; an ``array`` is a
    ``Sequence[int]`` that ``cortex.hashing.block_keys`` packs with one memcpy. Treat both as
    read-only. ``engine`` is the raw ``EngineKind`` value: unknown values are kept, as proto3
    requires, for the index to reject.
    """

    model: str = ""
    token_ids: array[int] = field(default_factory=lambda: array("I"))
    block_keys: array[int] = field(default_factory=lambda: array("Q"))
    candidate_workers: tuple[str, ...] = ()
    max_blocks: int = 0
    block_size: int = 0
    engine: int = 0
    lora_name: str = ""
    cache_salt: str = ""

    @classmethod
    def from_message(cls, message: MatchRequest) -> MatchQuery:
        """The query a generated ``MatchRequest`` stands for (in-process callers, tests)."""
        return decode_match_request(bytes(message))


class WorkerHit(NamedTuple):
    """One ``WorkerMatch``: consecutive leading blocks a source holds (blocks, tokens).

    A NamedTuple rather than a dataclass: replies carry one per worker, and a tuple is
    built 4x faster than a frozen dataclass.
    """

    worker_id: str
    matched_blocks: int
    matched_tokens: int
    state: int  # a LedgerState value
    dp_rank: int = 0


@dataclass(frozen=True, slots=True)
class MatchDomain:
    """The ``Domain`` a Match was answered in (model, tokens per block, EngineKind value)."""

    model: str
    block_size: int
    engine: int


@dataclass(frozen=True, slots=True)
class MatchReply:
    """A ``MatchResponse``: every source of the domain, the index version, the query size."""

    matches: Sequence[WorkerHit] = ()
    index_version: int = 0
    query_blocks: int = 0
    domain: MatchDomain | None = None

    @classmethod
    def from_message(cls, message: MatchResponse) -> MatchReply:
        return decode_match_response(bytes(message))


# ---- MatchRequest -----------------------------------------------------------------------


def decode_match_request(data: bytes | bytearray | memoryview) -> MatchQuery:
    """Decode ``MatchRequest`` bytes into a :class:`MatchQuery`; :class:`WireError` if invalid.

    Cost: ~40 µs for 4,096 packed ``token_ids``, a few µs for packed keys or ``*_le`` twins.
    """
    buf = data if type(data) is bytes else bytes(data)
    view = memoryview(buf)
    end = len(buf)
    pos = 0
    model = lora_name = cache_salt = ""
    max_blocks = block_size = engine = 0
    candidates: list[str] = []
    tokens = array("I")
    keys = array("Q")
    tokens_le: tuple[int, int] | None = None
    keys_le: tuple[int, int] | None = None
    while pos < end:
        tag_at = pos
        tag = buf[pos]
        if tag < 0x80:
            pos += 1
            if tag < 8:
                raise WireError("invalid field number 0")
        else:
            tag, pos = read_tag(buf, pos, end)
        if tag == 0x12:  # token_ids, packed
            start, pos = read_span(buf, pos, end)
            read_packed_varints(buf, start, pos, tokens)
        elif tag == 0x1A or tag == 0x19:  # block_keys, packed or not
            pos = read_fixed64(buf, tag_at, pos, end, tag, keys)
        elif tag == 0x52:  # token_ids_le
            tokens_le = read_span(buf, pos, end)
            pos = tokens_le[1]
        elif tag == 0x5A:  # block_keys_le
            keys_le = read_span(buf, pos, end)
            pos = keys_le[1]
        elif tag == 0x0A:
            start, pos = read_span(buf, pos, end)
            model = read_text(buf, start, pos)
        elif tag == 0x22:
            start, pos = read_span(buf, pos, end)
            candidates.append(read_text(buf, start, pos))
        elif tag == 0x28:
            max_blocks, pos = read_varint(buf, pos, end)
            max_blocks &= MASK32
        elif tag == 0x30:
            block_size, pos = read_varint(buf, pos, end)
            block_size &= MASK32
        elif tag == 0x38:
            engine, pos = read_varint(buf, pos, end)
            engine = as_int32(engine)
        elif tag == 0x42:
            start, pos = read_span(buf, pos, end)
            lora_name = read_text(buf, start, pos)
        elif tag == 0x4A:
            start, pos = read_span(buf, pos, end)
            cache_salt = read_text(buf, start, pos)
        elif tag == 0x10:  # token_ids, unpacked: decode the run from this tag on at once
            run = unpacked_varints(buf, tag_at, end, 0x10) if pos == tag_at + 1 else None
            if run is not None and run[0].size:
                tokens.frombytes(run[0].astype(np.uint32).tobytes())
                pos = run[1]
            else:  # a non-minimal tag or a bad value: one element, the scalar way
                value, pos = read_varint(buf, pos, end)
                tokens.append(value & MASK32)
        else:
            pos = skip_field(buf, pos, end, tag)
    if tokens_le is not None and tokens_le[0] != tokens_le[1]:
        if (tokens_le[1] - tokens_le[0]) % 4:
            raise WireError("token_ids_le length is not a multiple of 4")
        tokens = le_array("I", view[tokens_le[0] : tokens_le[1]])
    if keys_le is not None and keys_le[0] != keys_le[1]:
        if (keys_le[1] - keys_le[0]) % 8:
            raise WireError("block_keys_le length is not a multiple of 8")
        keys = le_array("Q", view[keys_le[0] : keys_le[1]])
    return MatchQuery(
        model=model,
        token_ids=tokens,
        block_keys=keys,
        candidate_workers=tuple(candidates),
        max_blocks=max_blocks,
        block_size=block_size,
        engine=engine,
        lora_name=lora_name,
        cache_salt=cache_salt,
    )


def encode_match_request(
    model: str,
    *,
    block_keys: Sequence[int] = (),
    token_ids: Sequence[int] = (),
    candidate_workers: Sequence[str] = (),
    max_blocks: int = 0,
    block_size: int = 0,
    engine: int = 0,
    lora_name: str = "",
    cache_salt: str = "",
) -> bytes:
    """``MatchRequest`` bytes, lists sent through the ``*_le`` twins (~5 µs for 256 keys).

    Give ``block_keys`` (precomputed Cortex keys) or ``token_ids``; the index uses the keys
    when both are set. Fields at their default are omitted, as protobuf does.
    """
    out = bytearray()
    put_bytes(out, 0x0A, model.encode())
    for worker in candidate_workers:
        out.append(0x22)
        encoded = worker.encode()
        put_varint(out, len(encoded))
        out += encoded
    put_uint(out, 0x28, max_blocks)
    put_uint(out, 0x30, block_size)
    put_uint(out, 0x38, engine)
    put_bytes(out, 0x42, lora_name.encode())
    put_bytes(out, 0x4A, cache_salt.encode())
    put_bytes(out, 0x52, pack_token_ids(token_ids) if token_ids else b"")
    put_bytes(out, 0x5A, pack_block_keys(block_keys) if block_keys else b"")
    return bytes(out)


def match_request(
    model: str,
    *,
    block_keys: Sequence[int] = (),
    token_ids: Sequence[int] = (),
    candidate_workers: Sequence[str] = (),
    max_blocks: int = 0,
    block_size: int = 0,
    engine: int = 0,
    lora_name: str = "",
    cache_salt: str = "",
) -> MatchRequest:
    """The generated ``MatchRequest`` (for ``IndexStub.match``), lists in the ``*_le`` twins."""
    return MatchRequest(
        model=model,
        candidate_workers=list(candidate_workers),
        max_blocks=max_blocks,
        block_size=block_size,
        engine=engine,  # type: ignore[arg-type]  # an EngineKind value
        lora_name=lora_name,
        cache_salt=cache_salt,
        token_ids_le=pack_token_ids(token_ids) if token_ids else b"",
        block_keys_le=pack_block_keys(block_keys) if block_keys else b"",
    )


# ---- MatchResponse ----------------------------------------------------------------------


def encode_match_response(reply: MatchReply) -> bytes:
    """``MatchResponse`` bytes, byte-identical to protobuf's (~1 µs a worker)."""
    out = bytearray()
    entry = bytearray()
    for hit in reply.matches:
        entry.clear()
        put_bytes(entry, 0x0A, hit.worker_id.encode())
        put_uint(entry, 0x10, hit.matched_blocks)
        put_uint(entry, 0x18, hit.matched_tokens)
        put_uint(entry, 0x20, hit.state)
        put_uint(entry, 0x28, hit.dp_rank)
        out.append(0x0A)
        put_varint(out, len(entry))
        out += entry
    put_uint(out, 0x10, reply.index_version)
    put_uint(out, 0x18, reply.query_blocks)
    if reply.domain is not None:
        entry.clear()
        put_bytes(entry, 0x0A, reply.domain.model.encode())
        put_uint(entry, 0x10, reply.domain.block_size)
        put_uint(entry, 0x18, reply.domain.engine)
        out.append(0x22)
        put_varint(out, len(entry))
        out += entry
    return bytes(out)


def _decode_worker_match(buf: bytes, pos: int, end: int) -> WorkerHit:
    worker_id = ""
    blocks = tokens = state = dp_rank = 0
    while pos < end:
        tag = buf[pos]
        if 8 <= tag < 0x80:
            pos += 1
        else:
            tag, pos = read_tag(buf, pos, end)
        if tag == 0x0A:
            start, pos = read_span(buf, pos, end)
            worker_id = read_text(buf, start, pos)
        elif tag == 0x10:
            blocks, pos = read_varint(buf, pos, end)
        elif tag == 0x18:
            tokens, pos = read_varint(buf, pos, end)
        elif tag == 0x20:
            state, pos = read_varint(buf, pos, end)
        elif tag == 0x28:
            dp_rank, pos = read_varint(buf, pos, end)
        else:
            pos = skip_field(buf, pos, end, tag, 1)
    return WorkerHit(
        worker_id, blocks & MASK32, tokens & MASK32, as_int32(state), dp_rank & MASK32
    )


def _decode_domain(buf: bytes, pos: int, end: int, into: MatchDomain | None) -> MatchDomain:
    # a repeated sub-message occurrence merges into the previous one, as protobuf does
    model, block_size, engine = (
        ("", 0, 0) if into is None else (into.model, into.block_size, into.engine)
    )
    while pos < end:
        tag, pos = read_tag(buf, pos, end)
        if tag == 0x0A:
            start, pos = read_span(buf, pos, end)
            model = read_text(buf, start, pos)
        elif tag == 0x10:
            block_size, pos = read_varint(buf, pos, end)
            block_size &= MASK32
        elif tag == 0x18:
            engine, pos = read_varint(buf, pos, end)
            engine = as_int32(engine)
        else:
            pos = skip_field(buf, pos, end, tag, 1)
    return MatchDomain(model, block_size, engine)


# Decoded WorkerMatch entries by their bytes. Most entries of a reply repeat from one reply
# to the next (every worker without a hit, the same few hits); WorkerHit is immutable.
_HITS: dict[bytes, WorkerHit] = {}
_HITS_MAX = 4096


def decode_match_response(data: bytes | bytearray | memoryview) -> MatchReply:
    """Decode ``MatchResponse`` bytes into a :class:`MatchReply`; :class:`WireError` if invalid."""
    buf = data if type(data) is bytes else bytes(data)
    end = len(buf)
    pos = 0
    matches: list[WorkerHit] = []
    version = blocks = 0
    domain: MatchDomain | None = None
    while pos < end:
        tag, pos = read_tag(buf, pos, end)
        if tag == 0x0A:
            start, pos = read_span(buf, pos, end)
            entry = buf[start:pos]
            hit = _HITS.get(entry)
            if hit is None:
                hit = _decode_worker_match(buf, start, pos)
                if len(_HITS) >= _HITS_MAX:
                    _HITS.clear()
                _HITS[entry] = hit
            matches.append(hit)
        elif tag == 0x10:
            version, pos = read_varint(buf, pos, end)
        elif tag == 0x18:
            blocks, pos = read_varint(buf, pos, end)
            blocks &= MASK32
        elif tag == 0x22:
            start, pos = read_span(buf, pos, end)
            domain = _decode_domain(buf, start, pos, domain)
        else:
            pos = skip_field(buf, pos, end, tag)
    return MatchReply(matches, version, blocks, domain)
