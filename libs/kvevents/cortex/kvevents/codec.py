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
from array import array
from collections.abc import Callable, Mapping
from functools import partial
from typing import Final

import msgpack

from cortex.hashing import Engine
from cortex.kvevents.encoding import ENCODER_VERSIONS, encode_batch
from cortex.kvevents.events import (
    CLEARED_TAG,
    REMOVED_ORDER,
    REMOVED_TAG,
    STORED_ORDER,
    STORED_TAG,
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    CodecError,
    Event,
    EventBatch,
    describe_error,
)

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
        raise CodecError(f"payload is not valid msgpack: {describe_error(exc)}") from exc
    try:
        return _batch(obj, kind)
    except CodecError:
        raise
    except Exception as exc:  # a boundary guarantee; the fuzz tests prove it is never reached
        raise CodecError(f"internal: malformed batch ({describe_error(exc)})") from exc


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

    stored_order = STORED_ORDER[engine]
    removed_order = REMOVED_ORDER[engine]
    out: list[Event] = []
    skipped = 0
    for index, raw in enumerate(events):
        try:
            if type(raw) is tuple:
                if not raw or type(raw[0]) is not str:
                    raise CodecError("array event must start with its type tag (str)")
                tag = raw[0]
                if tag == STORED_TAG:
                    out.append(_stored(dict(zip(stored_order, raw[1:], strict=False))))
                elif tag == REMOVED_TAG:
                    out.append(_removed(dict(zip(removed_order, raw[1:], strict=False))))
                elif tag == CLEARED_TAG:
                    out.append(_ALL_CLEARED)
                else:
                    skipped += 1
            elif type(raw) is dict:
                type_tag = raw.get("type")
                if type_tag == STORED_TAG:
                    out.append(_stored(raw))
                elif type_tag == REMOVED_TAG:
                    out.append(_removed(raw))
                elif type_tag == CLEARED_TAG:
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
