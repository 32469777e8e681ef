"""KV-cache event codec: every released vLLM / SGLang payload in, one normalized model out.

Pure and socket-free. :func:`decode_batch` turns one ZMQ payload (the third frame of a PUB
message, spec ``kv-events.md`` §2) into an :class:`EventBatch`; :func:`encode_batch` does the
reverse byte-for-byte as a given engine version would, for the simulator.

Decoding accepts both wire eras (positional arrays up to vLLM 0.23 / SGLang 0.5.19, tagged maps
after), 2- or 3-element batches, int or ``bin`` block hashes, any integer width and any map
header. Unknown event tags are skipped and counted; unknown keys and extra positional fields are
ignored. Anything else that is malformed raises :class:`CodecError` and nothing else: the
payload comes from the network and must never take the ingest down.
"""

from __future__ import annotations

import math
import struct
from array import array
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Final, Literal, TypeAlias

import msgpack

from cortex.hashing import Engine

__all__ = [
    "ENCODER_VERSIONS",
    "MAX_PAYLOAD_BYTES",
    "AllBlocksCleared",
    "BlockHash",
    "BlockRemoved",
    "BlockStored",
    "CodecError",
    "Event",
    "EventBatch",
    "decode_batch",
    "encode_batch",
]

MAX_PAYLOAD_BYTES: Final = 64 * 1024 * 1024
"""Largest payload decoded (bytes). A scheduler step storing 1M pages with page size 1 is
about 14 MiB; anything past this bound is refused before msgpack allocates for it."""

_MAX_NESTING: Final = 16
"""Deepest nesting accepted inside ``extra_keys`` (engines send flat tuples)."""

_MAX_HASH_BYTES: Final = 64
_MAX_UINT32: Final = 2**32 - 1
_MAX_UINT64: Final = 2**64 - 1


class CodecError(ValueError):
    """The payload is not a KV-event batch of the named engine, or cannot be encoded.

    The only exception :func:`decode_batch` raises. The ingest reacts by counting the batch as
    malformed and dropping it (its ``seq`` still counts, so no replay is triggered for it).
    """


BlockHash: TypeAlias = int | bytes
"""An engine block hash: a signed/unsigned 64-bit int, or a raw digest (vLLM's 32-byte bin).
Opaque per-worker id; never compare hashes of different workers or engines."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Full blocks newly cached by the engine, in order.

    ``token_ids`` concatenates the tokens of all blocks (``len == len(block_hashes) *
    block_size`` for plain models; placeholder stores carry ``()`` and ``block_size == 0``).
    ``parent_block_hash`` is the hash of the block just before the first one, ``None`` at the
    start of a sequence. ``medium`` names the tier (``"GPU"``, ``"CPU"``, ``"CPU_PINNED"``,
    ``"DISK"``, ...); ``None`` from engines that predate the field (GPU). ``group_idx`` is the
    KV-cache group (hybrid models have several); the engine sends nil for single-group models,
    which reads as 0 and sets ``group_idx_nil`` (a wire detail kept only so
    :func:`encode_batch` can reproduce the bytes; it takes no part in equality).

    Speculative decoding: ``lookahead_token_ids`` holds, per block, the tokens after it that
    the engine's reuse of the block also needs. vLLM sends them (EAGLE block hashes,
    ``list[list[int]]``); SGLang's EAGLE radix cache sends each page's ``token_ids`` as
    bigrams ``[[t0, t1], [t1, t2], ...]``, which decode to ``token_ids = (t0, t1, ...)``
    (one token per position), ``lookahead_token_ids`` = each page's last pair's second
    token, and ``bigram=True`` (how :func:`encode_batch` writes them back).
    """

    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    cache_salt: str | None = None
    extra_keys: tuple[object, ...] | None = None
    group_idx: int = 0
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: tuple[tuple[int, ...], ...] | None = None
    bigram: bool = False
    group_idx_nil: bool = field(default=False, compare=False)

    @property
    def lookahead(self) -> int:
        """Tokens after each block its reuse needs (0: none; ``-1``: uneven lists)."""
        lists = self.lookahead_token_ids
        if not lists:
            return 0
        width = len(lists[0])
        return width if all(len(item) == width for item in lists) else -1


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks evicted from ``medium`` (vLLM: one hash per event; SGLang: one radix node)."""

    block_hashes: tuple[BlockHash, ...]
    medium: str | None = None
    group_idx: int = 0
    locality: str | None = None
    ownership: str | None = None
    group_idx_nil: bool = field(default=False, compare=False)


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The engine dropped its whole prefix cache (flush, weight update, SGLang start-up)."""


Event: TypeAlias = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    """One scheduler step's events.

    ``ts``: the engine's wall clock when the batch was built (seconds since the epoch).
    ``dp_rank``: the data-parallel rank that published it, ``None`` when not sent (vLLM 0.9).
    ``skipped_unknown``: events with a tag this codec does not know, dropped from ``events``.
    """

    ts: float
    events: tuple[Event, ...]
    dp_rank: int | None = None
    skipped_unknown: int = 0


# --------------------------------------------------------------------------------------------
# Wire field order (spec kv-events.md §2). Array-era events are positional in exactly this
# order; fields were only ever appended, so a shorter array is an older engine.

_VLLM_STORED: Final = (
    "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
    "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window",
    "locality", "ownership", "session_id", "lookahead_token_ids",
)  # fmt: skip
_SGLANG_STORED: Final = (
    "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
    "cache_salt", "session_id", "lora_name",
)  # fmt: skip
_VLLM_REMOVED: Final = ("block_hashes", "medium", "group_idx", "locality", "ownership")
_SGLANG_REMOVED: Final = ("block_hashes", "medium")

_STORED_ORDER: Final = {Engine.VLLM: _VLLM_STORED, Engine.SGLANG: _SGLANG_STORED}
_REMOVED_ORDER: Final = {Engine.VLLM: _VLLM_REMOVED, Engine.SGLANG: _SGLANG_REMOVED}

_STORED: Final = "BlockStored"
_REMOVED: Final = "BlockRemoved"
_CLEARED: Final = "AllBlocksCleared"


# --------------------------------------------------------------------------------------------
# Decoding


def decode_batch(payload: bytes, engine: Engine | str) -> EventBatch:
    """Decode one KV-event payload published by ``engine`` (any released version).

    ``payload`` is the msgpack frame as received (at most :data:`MAX_PAYLOAD_BYTES`).
    ``engine`` picks the meaning of positional fields past ``medium`` in array-era events.
    Raises :class:`CodecError` (only) when the payload is not a valid batch: the message says
    which event and field is wrong.
    """
    try:
        kind = Engine(engine)
    except ValueError:
        raise CodecError(f"unknown engine {engine!r} (expected 'vllm' or 'sglang')") from None
    if not isinstance(payload, bytes | bytearray | memoryview):
        raise CodecError(f"payload must be bytes, got {type(payload).__name__}")
    size = len(payload)
    if size == 0:
        raise CodecError("empty payload")
    if size > MAX_PAYLOAD_BYTES:
        raise CodecError(f"payload of {size} bytes exceeds the {MAX_PAYLOAD_BYTES}-byte limit")
    try:
        # Every declared length is bounded by the payload size, so a hostile header cannot
        # make msgpack allocate more than the payload could hold; nesting is bounded by
        # msgpack's fixed parse stack (StackError).
        obj = msgpack.unpackb(
            payload,
            raw=False,
            use_list=False,
            strict_map_key=False,
            max_str_len=size,
            max_bin_len=size,
            max_array_len=size,
            max_map_len=size,
            max_ext_len=size,
        )
    except Exception as exc:  # msgpack raises a zoo of types (ValueError, StackError, ...)
        raise CodecError(f"payload is not valid msgpack: {_describe(exc)}") from exc
    try:
        return _batch(obj, kind)
    except CodecError:
        raise
    except Exception as exc:  # a boundary guarantee; the fuzz tests prove it is never reached
        raise CodecError(f"internal: malformed batch ({_describe(exc)})") from exc


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text[:200]}" if text else type(exc).__name__


def _kind(value: object) -> str:
    """A wire-level name for a decoded value's type, for error messages."""
    return _KIND_NAMES.get(type(value), type(value).__name__)


_KIND_NAMES: Final[dict[type, str]] = {
    type(None): "nil", bool: "bool", int: "int", float: "float", str: "str", bytes: "bin",
    tuple: "array", dict: "map",
}  # fmt: skip


def _batch(obj: object, engine: Engine) -> EventBatch:
    if type(obj) is tuple:
        if len(obj) < 2:
            raise CodecError(f"batch must be [ts, events, dp_rank?], got {len(obj)} element(s)")
        ts, events = obj[0], obj[1]
        rank = obj[2] if len(obj) > 2 else None
    elif type(obj) is dict:
        # Not sent by any released engine; a struct-shaped batch costs nothing to accept.
        if "ts" not in obj or "events" not in obj:
            raise CodecError("batch map needs 'ts' and 'events'")
        ts, events = obj["ts"], obj["events"]
        rank = obj.get("data_parallel_rank", obj.get("attn_dp_rank"))
    else:
        raise CodecError(f"batch must be an array, got {_kind(obj)}")

    if type(ts) is float:
        if not math.isfinite(ts):
            raise CodecError(f"batch ts must be finite, got {ts}")
    elif type(ts) is int:
        ts = float(ts)
    else:
        raise CodecError(f"batch ts must be a float, got {_kind(ts)}")
    if rank is not None and (type(rank) is not int or not 0 <= rank <= _MAX_UINT32):
        raise CodecError(f"batch dp_rank must be nil or a uint32, got {rank!r:.40}")
    if type(events) is not tuple:
        raise CodecError(f"batch events must be an array, got {_kind(events)}")

    stored_order = _STORED_ORDER[engine]
    removed_order = _REMOVED_ORDER[engine]
    out: list[Event] = []
    skipped = 0
    for index, raw in enumerate(events):
        try:
            if type(raw) is tuple:
                if not raw or type(raw[0]) is not str:
                    raise CodecError("array event must start with its type tag (str)")
                tag = raw[0]
                if tag == _STORED:
                    out.append(_stored(dict(zip(stored_order, raw[1:], strict=False))))
                elif tag == _REMOVED:
                    out.append(_removed(dict(zip(removed_order, raw[1:], strict=False))))
                elif tag == _CLEARED:
                    out.append(_ALL_CLEARED)
                else:
                    skipped += 1
            elif type(raw) is dict:
                type_tag = raw.get("type")
                if type_tag == _STORED:
                    out.append(_stored(raw))
                elif type_tag == _REMOVED:
                    out.append(_removed(raw))
                elif type_tag == _CLEARED:
                    out.append(_ALL_CLEARED)
                elif type(type_tag) is str:
                    skipped += 1
                else:
                    raise CodecError(f"map event needs a str 'type', got {_kind(type_tag)}")
            else:
                raise CodecError(f"event must be an array or a map, got {_kind(raw)}")
        except CodecError as exc:
            raise CodecError(f"event {index}: {exc}") from None
    return EventBatch(ts=ts, events=tuple(out), dp_rank=rank, skipped_unknown=skipped)


_ALL_CLEARED: Final = AllBlocksCleared()


_STORED_STRS: Final = ("medium", "lora_name", "kv_cache_spec_kind", "locality", "ownership")
_REMOVED_STRS: Final = ("medium", "locality", "ownership")
_NIL: Final = type(None)
_STR_OR_NIL: Final = frozenset({str, _NIL})


def _stored(f: Mapping[object, object]) -> BlockStored:
    # The hot path of the ingest: plain fields are fetched and type-checked in bulk (C loops);
    # the rarely present ones are validated only when set.
    get = f.get
    hashes, tokens, size = get("block_hashes"), get("token_ids"), get("block_size")
    if hashes is None or tokens is None or size is None:
        raise CodecError("BlockStored needs block_hashes, token_ids and block_size")
    medium, lora_name, spec_kind, locality, ownership = strs = tuple(map(get, _STORED_STRS))
    if not set(map(type, strs)) <= _STR_OR_NIL:
        _raise_first_bad_str(_STORED_STRS, strs)
    parent = get("parent_block_hash")
    if parent is not None and type(parent) is not int:
        _hash(parent, "parent_block_hash")
    block_size = _uint(size, "block_size", _MAX_UINT32)
    lora_id = get("lora_id")
    if lora_id is not None and type(lora_id) is not int:
        raise CodecError(f"lora_id must be nil or an int, got {_kind(lora_id)}")
    group = get("group_idx")
    salt = get("cache_salt")
    session = get("session_id")
    extra = get("extra_keys")
    window = get("kv_cache_spec_sliding_window")
    lookahead = get("lookahead_token_ids")
    bigram = type(tokens) is tuple and bool(tokens) and type(tokens[0]) is tuple
    lookahead_ids: tuple[tuple[int, ...], ...] | None
    if bigram:
        if lookahead is not None:
            raise CodecError("bigram token_ids and lookahead_token_ids cannot both be set")
        token_ids, lookahead_ids = _bigrams(tokens, len(hashes), block_size)  # type: ignore[arg-type]
    else:
        token_ids = _tokens(tokens, "token_ids")
        lookahead_ids = None if lookahead is None else _token_lists(lookahead)
    return BlockStored(
        _hashes(hashes),
        parent,  # type: ignore[arg-type]  # checked above
        token_ids,
        block_size,
        lora_id,
        medium,  # type: ignore[arg-type]  # checked in bulk above
        lora_name,  # type: ignore[arg-type]
        None if salt is None else _cache_salt(salt),
        None if extra is None else _extra_keys(extra),
        0 if group is None else _uint(group, "group_idx", _MAX_UINT32),
        spec_kind,  # type: ignore[arg-type]
        None if window is None else _uint(window, "kv_cache_spec_sliding_window", _MAX_UINT64),
        locality,  # type: ignore[arg-type]
        ownership,  # type: ignore[arg-type]
        None if session is None else _opt_str(session, "session_id"),
        lookahead_ids,
        bigram,
        group is None,
    )


def _token_lists(value: object) -> tuple[tuple[int, ...], ...]:
    """vLLM's ``lookahead_token_ids``: one token list per block."""
    if type(value) is not tuple:
        raise CodecError(f"lookahead_token_ids must be an array, got {_kind(value)}")
    for position, item in enumerate(value):
        _tokens(item, f"lookahead_token_ids[{position}]")
    return value  # checked item by item


def _bigrams(
    pairs: tuple[object, ...], blocks: int, block_size: int
) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
    """SGLang EAGLE pages (``mem_cache/events.py::record_store``): pair ``j`` is
    ``(raw[j], raw[j + 1])``, so consecutive pairs share a token. Returns the raw tokens of
    the positions and, per page, the token after it."""
    for position, pair in enumerate(pairs):
        if type(pair) is not tuple or len(pair) != 2:
            raise CodecError(f"token_ids[{position}] must be a [token, next token] pair")
    firsts = tuple(pair[0] for pair in pairs)  # type: ignore[index]
    seconds = tuple(pair[1] for pair in pairs)  # type: ignore[index]
    _tokens(firsts, "token_ids")
    _tokens(seconds, "token_ids")
    if firsts[1:] != seconds[:-1]:
        bad = next(j for j in range(len(pairs) - 1) if seconds[j] != firsts[j + 1])
        raise CodecError(f"bigram token_ids[{bad}] and [{bad + 1}] do not share a token")
    if block_size <= 0 or len(pairs) != blocks * block_size:
        raise CodecError(
            f"bigram token_ids hold {len(pairs)} pairs for {blocks} pages of {block_size}"
        )
    lookahead = tuple((seconds[(k + 1) * block_size - 1],) for k in range(blocks))
    return firsts, lookahead


def _removed(f: Mapping[object, object]) -> BlockRemoved:
    get = f.get
    hashes = get("block_hashes")
    if hashes is None:
        raise CodecError("BlockRemoved needs block_hashes")
    medium, locality, ownership = strs = tuple(map(get, _REMOVED_STRS))
    if not set(map(type, strs)) <= _STR_OR_NIL:
        _raise_first_bad_str(_REMOVED_STRS, strs)
    group = get("group_idx")
    return BlockRemoved(
        _hashes(hashes),
        medium,  # type: ignore[arg-type]  # checked in bulk above
        0 if group is None else _uint(group, "group_idx", _MAX_UINT32),
        locality,  # type: ignore[arg-type]
        ownership,  # type: ignore[arg-type]
        group is None,
    )


def _raise_first_bad_str(names: tuple[str, ...], values: tuple[object, ...]) -> None:
    for name, value in zip(names, values, strict=True):
        _opt_str(value, name)


_INT_ONLY: Final = frozenset({int})


def _hashes(value: object) -> tuple[BlockHash, ...]:
    if type(value) is not tuple:
        raise CodecError(f"block_hashes must be an array, got {_kind(value)}")
    # The common case (all ints) is checked in C; msgpack bounds ints to [-2**63, 2**64).
    if value and not set(map(type, value)) <= _INT_ONLY:
        for position, item in enumerate(value):
            _hash(item, f"block_hashes[{position}]")
    return value


def _hash(value: object, name: str) -> BlockHash:
    if type(value) is int:
        return value
    if type(value) is bytes:
        if not 0 < len(value) <= _MAX_HASH_BYTES:
            raise CodecError(f"{name} is a bin of {len(value)} bytes (expected 1..64)")
        return value
    raise CodecError(f"{name} must be an int or bin hash, got {_kind(value)}")


def _tokens(value: object, name: str) -> tuple[int, ...]:
    if type(value) is not tuple:
        raise CodecError(f"{name} must be an array, got {_kind(value)}")
    # Both checks run in C: the type set rejects bools, floats, nils and strs, and the uint32
    # array conversion rejects anything outside [0, 2**32-1].
    if value and not set(map(type, value)) <= _INT_ONLY:
        bad = next(v for v in value if type(v) is not int)
        raise CodecError(f"{name} must hold ints, found {_kind(bad)}")
    try:
        _UINT32_ARRAY(value)
    except OverflowError:
        bad = next(v for v in value if not 0 <= v <= _MAX_UINT32)
        raise CodecError(f"{name} holds {bad}, outside uint32") from None
    return value


def _uint32_array_factory() -> Callable[[tuple[int, ...]], array[int]]:
    # The typecode whose items are exactly 32 bits ("I" on every mainstream ABI): converting
    # to it rejects any token outside uint32 in C. Checked, not assumed.
    for code in ("I", "L"):
        if array(code).itemsize == 4:
            return partial(array, code)
    raise ImportError("no 32-bit unsigned array type on this platform")


_UINT32_ARRAY: Final = _uint32_array_factory()


def _uint(value: object, name: str, high: int) -> int:
    if type(value) is not int:
        raise CodecError(f"{name} must be an int, got {_kind(value)}")
    if not 0 <= value <= high:
        raise CodecError(f"{name} = {value} is outside [0, {high}]")
    return value


def _opt_str(value: object, name: str) -> str | None:
    if value is None or type(value) is str:
        return value
    raise CodecError(f"{name} must be nil or a str, got {_kind(value)}")


def _cache_salt(value: object) -> str | None:
    # Some SGLang builds carry the salt in a trailing metadata struct {"cache_salt": ...}
    # at the same position; accept both shapes.
    salt: object = value.get("cache_salt") if type(value) is dict else value
    return _opt_str(salt, "cache_salt")


def _extra_keys(value: object) -> tuple[object, ...] | None:
    if value is None:
        return None
    if type(value) is not tuple:
        raise CodecError(f"extra_keys must be nil or an array, got {_kind(value)}")
    if set(map(type, value)) <= _STR_OR_NIL:  # vLLM's usual [nil, nil, ...]
        return value
    # Iterative depth check: consumers (JSON output, hashing) may recurse into these.
    stack: list[tuple[object, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > _MAX_NESTING:
            raise CodecError(f"extra_keys nested deeper than {_MAX_NESTING}")
        if type(item) is tuple:
            stack.extend((child, depth + 1) for child in item)
        elif type(item) is dict:
            stack.extend((child, depth + 1) for pair in item.items() for child in pair)
    return value


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
    return _Schema(era, rank, _VLLM_STORED[:stored], 7, _VLLM_REMOVED[:removed], 2)


def _sglang(era: _Era, stored: int, removed: int) -> _Schema:
    # SGLang declares medium (and everything after it) with a None default.
    return _Schema(era, True, _SGLANG_STORED[:stored], 5, _SGLANG_REMOVED[:removed], 1, True)


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
    for name in dict.fromkeys(_VLLM_STORED[5:] + _SGLANG_STORED[5:])
}
_REMOVED_DEFAULTS: Final[dict[str, object]] = {
    name: (0 if name == "group_idx" else None) for name in _VLLM_REMOVED[1:]
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
        raise CodecError(f"cannot encode batch: {_describe(exc)}") from exc
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
        tag, names, required = _STORED, schema.stored, schema.stored_required
        defaults = _STORED_DEFAULTS
    elif isinstance(event, BlockRemoved):
        tag, names, required = _REMOVED, schema.removed, schema.removed_required
        defaults = _REMOVED_DEFAULTS
    elif isinstance(event, AllBlocksCleared):
        if schema.era == "array":
            return b"\x91" + pack(_CLEARED)
        return b"\x81" + pack("type") + pack(_CLEARED)
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
