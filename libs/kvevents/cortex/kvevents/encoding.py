"""``encode_batch``: events → the payload bytes a given engine version publishes (for the
simulator and the golden tests); re-exported by :mod:`cortex.kvevents.codec`."""

from __future__ import annotations

import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Final, Literal, TypeAlias

import msgpack

from cortex.hashing import Engine
from cortex.kvevents.events import (
    CLEARED_TAG,
    REMOVED_TAG,
    SGLANG_REMOVED_FIELDS,
    SGLANG_STORED_FIELDS,
    STORED_TAG,
    VLLM_REMOVED_FIELDS,
    VLLM_STORED_FIELDS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CodecError,
    Event,
    EventBatch,
    describe_error,
)

__all__ = ["ENCODER_VERSIONS", "encode_batch"]


# --------------------------------------------------------------------------------------------
# Encoding: each engine version's publisher is msgspec encoding msgspec Structs. Rules derived
# from the engines' structs and checked against every golden payload:
# - the batch is array_like: every field written, nil included (vLLM 0.9.0 had no dp field);
# - array-era events write the tag then every field of that version, trailing nils included;
# - map-era events are {"type": tag, ...} with omit_defaults: fields without a default (the
#   leading "required" ones) are always written, defaulted (None) ones only when not nil;
# - msgspec sizes a struct's map header for its largest possible entry count (fields + tag):
#   16 or more means a map16 header even when fewer entries are written (vLLM 0.33);
# - scalars use the smallest msgpack encoding (non-negative ints unsigned), floats are
#   float64, str is str (never bin), bytes are bin.

_Era: TypeAlias = Literal["array", "map"]


@dataclass(frozen=True, slots=True)
class _Schema:
    era: _Era
    batch_has_rank: bool
    stored: tuple[str, ...]
    stored_required: int  # map era: leading fields written even when nil
    removed: tuple[str, ...]
    removed_required: int
    bigram_pages: bool = False  # token_ids may be SGLang EAGLE pairs


def _vllm(era: _Era, rank: bool, stored: int, removed: int) -> _Schema:
    return _Schema(era, rank, VLLM_STORED_FIELDS[:stored], 7, VLLM_REMOVED_FIELDS[:removed], 2)


def _sglang(era: _Era, stored: int, removed: int) -> _Schema:
    # SGLang declares medium (and everything after it) with a None default.
    return _Schema(era, True, SGLANG_STORED_FIELDS[:stored], 5,
                   SGLANG_REMOVED_FIELDS[:removed], 1, True)


# Field counts are the largest proven by the golden payloads; a map-era version is never
# credited with a field it may not have had (0.24/0.26 keep 0.23's set), so encode_batch
# refuses content the engine could not have sent instead of guessing.
_SCHEMAS: Final[dict[Engine, dict[str, _Schema]]] = {
    Engine.VLLM: {
        "0.9.0": _vllm("array", False, 5, 1),
        "0.11.0": _vllm("array", True, 6, 2),
        "0.23.0": _vllm("array", True, 11, 3),
        "0.24.0": _vllm("map", True, 11, 3),
        "0.26.0": _vllm("map", True, 11, 3),
        "0.32.0": _vllm("map", True, 14, 5),  # checked against a real engine's payloads
        "0.33.0": _vllm("map", True, 15, 5),
    },
    Engine.SGLANG: {
        "0.4.7": _sglang("array", 5, 1),
        "0.5.9": _sglang("array", 6, 2),
        "0.5.18": _sglang("array", 6, 2),
        "0.5.20": _sglang("map", 6, 2),
        "0.5.21": _sglang("map", 6, 2),
        "0.5.22": _sglang("map", 6, 2),
        "0.5.23": _sglang("map", 9, 2),
    },
}

ENCODER_VERSIONS: Final[Mapping[Engine, tuple[str, ...]]] = {
    engine: tuple(versions) for engine, versions in _SCHEMAS.items()
}
"""Engine versions :func:`encode_batch` reproduces byte for byte (``"v"`` prefixes and
missing ``.0`` components are accepted, e.g. ``"v0.33"``)."""

# Fields some version lacks, with the value that version implies by not having them.
_STORED_DEFAULTS: Final[dict[str, object]] = {
    name: (0 if name == "group_idx" else None)
    for name in dict.fromkeys(VLLM_STORED_FIELDS[5:] + SGLANG_STORED_FIELDS[5:])
}
_REMOVED_DEFAULTS: Final[dict[str, object]] = {
    name: (0 if name == "group_idx" else None) for name in VLLM_REMOVED_FIELDS[1:]
}


def encode_batch(batch: EventBatch, engine: Engine | str, version: str) -> bytes:
    """Encode ``batch`` exactly as ``engine`` at ``version`` publishes it (payload frame only).

    ``version`` must be one of :data:`ENCODER_VERSIONS`. Raises :class:`CodecError` for an
    unsupported version, or for content that version could not carry (a field it lacks set
    to a non-default value, a dp_rank for vLLM 0.9.0, a value msgpack cannot hold).
    ``skipped_unknown`` is not encoded: unknown events are gone after decoding.
    """
    schema = _schema(engine, version)
    if not schema.batch_has_rank and batch.dp_rank is not None:
        raise CodecError(f"{engine} {version} batches carry no dp_rank (got {batch.dp_rank})")
    packer = msgpack.Packer(use_bin_type=True, autoreset=True)
    pack: Callable[[object], bytes] = packer.pack
    parts = [
        _array_header(3 if schema.batch_has_rank else 2),
        b"\xcb" + _F64.pack(float(batch.ts)),  # msgspec writes every float as float64
        _array_header(len(batch.events)),
    ]
    try:
        for index, event in enumerate(batch.events):
            parts.append(_encode_event(event, schema, pack, index))
        if schema.batch_has_rank:
            parts.append(pack(batch.dp_rank))
    except CodecError:
        raise
    except (TypeError, ValueError, OverflowError) as exc:
        raise CodecError(f"cannot encode batch: {describe_error(exc)}") from exc
    return b"".join(parts)


def _schema(engine: Engine | str, version: str) -> _Schema:
    try:
        kind = Engine(engine)
    except ValueError:
        raise CodecError(f"unknown engine {engine!r}") from None
    wanted = _version_key(version)
    for known, schema in _SCHEMAS[kind].items():
        if _version_key(known) == wanted:
            return schema
    supported = ", ".join(_SCHEMAS[kind])
    raise CodecError(f"no encoder for {kind} {version!r} (supported: {supported})")


def _version_key(version: str) -> tuple[str, ...]:
    parts = version.strip().removeprefix("v").split(".")
    while len(parts) < 3:
        parts.append("0")
    return tuple(parts)


_F64: Final = struct.Struct(">d")


def _encode_event(
    event: Event, schema: _Schema, pack: Callable[[object], bytes], index: int
) -> bytes:
    names: tuple[str, ...]
    defaults: dict[str, object]
    if isinstance(event, BlockStored):
        tag, names, required = STORED_TAG, schema.stored, schema.stored_required
        defaults = _STORED_DEFAULTS
    elif isinstance(event, BlockRemoved):
        tag, names, required = REMOVED_TAG, schema.removed, schema.removed_required
        defaults = _REMOVED_DEFAULTS
    elif isinstance(event, AllBlocksCleared):
        if schema.era == "array":
            return b"\x91" + pack(CLEARED_TAG)
        return b"\x81" + pack("type") + pack(CLEARED_TAG)
    else:
        raise CodecError(f"event {index}: cannot encode {type(event).__name__}")

    bigram = isinstance(event, BlockStored) and event.bigram
    if bigram and not schema.bigram_pages:
        raise CodecError(f"event {index}: vLLM stores have no bigram pages")
    for name, default in defaults.items():
        if bigram and name == "lookahead_token_ids":
            continue  # carried inside the pairs
        if name not in names and getattr(event, name) != default:
            raise CodecError(f"event {index}: this engine version's {tag} has no field {name!r}")
    values = [_wire_value(event, name) for name in names]
    if schema.era == "array":
        return b"".join([_array_header(len(values) + 1), pack(tag), *map(pack, values)])
    entries = [
        pack(name) + pack(value)
        for position, (name, value) in enumerate(zip(names, values, strict=True))
        if position < required or value is not None
    ]
    # msgspec picks the header width from the struct's largest possible size (fields + tag).
    header = _map_header(len(entries) + 1, widest=len(names) + 1)
    return b"".join([header, pack("type"), pack(tag), *entries])


def _wire_value(event: BlockStored | BlockRemoved, name: str) -> object:
    value = getattr(event, name)
    if name == "token_ids" and isinstance(event, BlockStored) and event.bigram:
        return _pairs(event)
    if name == "group_idx" and value == 0 and event.group_idx_nil:
        return None
    return value


def _pairs(event: BlockStored) -> list[tuple[int, int]]:
    """The bigram pages of a decoded SGLang EAGLE store, as the engine wrote them."""
    tokens, size = event.token_ids, event.block_size
    lookahead = event.lookahead_token_ids or ()
    if size <= 0 or len(lookahead) * size != len(tokens) or any(len(t) != 1 for t in lookahead):
        raise CodecError("a bigram store needs one lookahead token per page")
    following = [*tokens[1:], lookahead[-1][0]] if tokens else []
    for k in range(len(lookahead) - 1):
        if lookahead[k][0] != tokens[(k + 1) * size]:
            raise CodecError(f"bigram page {k}'s lookahead token is not the next page's first")
    return list(zip(tokens, following, strict=True))


def _array_header(count: int) -> bytes:
    if count < 16:
        return bytes([0x90 | count])
    if count < 2**16:
        return b"\xdc" + count.to_bytes(2, "big")
    return b"\xdd" + count.to_bytes(4, "big")


def _map_header(count: int, widest: int) -> bytes:
    if widest < 16:
        return bytes([0x80 | count])
    if widest < 2**16:
        return b"\xde" + count.to_bytes(2, "big")
    return b"\xdf" + count.to_bytes(4, "big")
