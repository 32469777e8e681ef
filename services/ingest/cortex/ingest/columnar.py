"""A KV-event payload's common shapes decoded in C, as columns (issue 27).

:func:`decode_columnar` hands a payload to the ledger's compiled core
(``cortex.ledger._core.decode_kv_events``), which reads vLLM's and SGLang's usual batches --
``BlockStored`` with int hashes, uint32 tokens and no LoRA / salt / multimodal / lookahead
extras, ``BlockRemoved``, ``AllBlocksCleared`` -- straight from the msgpack bytes: the tokens
become one packed ``uint32`` little-endian ``bytes`` (no int object per token), the block hashes
an ``array`` of 64-bit ints (``'q'`` when one is negative: SGLang's int64 hashes; else
``'Q'``: vLLM's uint64), which the key map reads in place, consecutive
removals of one medium one tuple (vLLM sends an event per evicted block). For any other
payload, valid or not, it returns ``None`` and the caller decodes it with
:func:`cortex.kvevents.codec.decode_batch`, the specification: what that raises or returns is
exactly what the ingest sees, so malformed payloads are counted and skipped as before.

:func:`materialize` turns a columnar batch back into the :class:`EventBatch` the codec would
have produced (the differential test holds the two equal, ``tests/ingest/test_columnar.py``);
the tracker does so per event for the rare ones its fast path does not place.
:func:`packed_block_keys` chains the Cortex keys of packed tokens in C (XXH3, blocks of up to
60 tokens), the same keys as :func:`cortex.hashing.block_keys`.

The fast path runs only when the compiled core is built and active
(:func:`cortex.ledger.cores.active`) and the tracker's ``columnar_decode`` is on.
"""

from __future__ import annotations

from array import array
from typing import Any, Final, TypeAlias

from cortex.hashing import Engine, block_keys
from cortex.kvevents.codec import AllBlocksCleared, BlockRemoved, BlockStored, Event, EventBatch
from cortex.ledger import cores

try:
    from cortex.ledger._core import block_keys_packed, decode_kv_events
except ImportError:  # the compiled core is not built (cores logs it): Python decoding only
    _BUILT = False
else:
    _BUILT = True

__all__ = [
    "CLEARED",
    "REMOVED",
    "STORED",
    "Columnar",
    "ColumnarEvent",
    "decode_columnar",
    "materialize",
    "materialize_event",
    "materialize_stored",
    "packed_block_keys",
]

STORED: Final = 0
"""``(0, hashes, parent, tokens (bytes, uint32 LE), block_size, medium, kv_cache_spec_kind,
group_idx | None, locality, ownership, session_id, extra_keys_len (-1: nil))``; hashes: an
``array('q')`` when one is negative, else ``array('Q')`` (so are a removal's)"""
REMOVED: Final = 1
"""``(1, hashes, medium, group_idx | None, locality, ownership, sizes (bytes, uint32: hashes
per event))``"""
CLEARED: Final = 2
"""``(2,)``"""

ColumnarEvent: TypeAlias = tuple[Any, ...]
Columnar: TypeAlias = tuple[float, int | None, list[ColumnarEvent]]
"""``(ts, dp_rank, events)``."""

_ALL_CLEARED: Final = AllBlocksCleared()


def decode_columnar(payload: bytes, engine: Engine) -> Columnar | None:
    """The payload's batch as columns, or ``None``: not a shape the compiled decoder takes
    (decode it with ``decode_batch``), or the compiled core is not built or not active."""
    if not _BUILT or cores.active() is not cores.Core.NATIVE:
        return None
    result: Columnar | None = decode_kv_events(payload, engine is Engine.SGLANG)
    return result


def packed_block_keys(tokens: bytes, block_size: int, parent: int) -> list[int]:
    """:func:`cortex.hashing.block_keys` of packed tokens: XXH3 in the compiled core for
    blocks of up to 60 tokens, the xxhash package otherwise (or without the core)."""
    if _BUILT:
        keys = block_keys_packed(tokens, block_size, parent)
        if keys is not None:
            return keys
    return block_keys(tokens, block_size, parent)


def _tokens(packed: bytes) -> tuple[int, ...]:
    values = array("I")
    values.frombytes(packed)
    return tuple(values)


def materialize_stored(event: ColumnarEvent) -> BlockStored:
    """The codec's ``BlockStored`` for a columnar store."""
    (_, hashes, parent, tokens, block_size, medium, kind, group, locality, ownership, session,
     extra_len) = event
    return BlockStored(
        tuple(hashes), parent, _tokens(tokens), block_size, None, medium, None, None,
        None if extra_len < 0 else (None,) * extra_len,
        0 if group is None else group, kind, None, locality, ownership, session, None,
        False, group is None,
    )


def materialize_event(event: ColumnarEvent) -> list[Event]:
    """The codec's events for one columnar event (a removal run gives one per event)."""
    tag = event[0]
    if tag == STORED:
        return [materialize_stored(event)]
    if tag == REMOVED:
        _, hashes, medium, group, locality, ownership, sizes = event
        out: list[Event] = []
        start = 0
        for size in array("I", sizes):
            out.append(BlockRemoved(tuple(hashes[start:start + size]), medium,
                                    0 if group is None else group, locality, ownership,
                                    group is None))
            start += size
        return out
    return [_ALL_CLEARED]


def materialize(batch: Columnar) -> EventBatch:
    """The :class:`EventBatch` ``decode_batch`` gives for the same payload."""
    ts, rank, events = batch
    return EventBatch(ts, tuple(e for event in events for e in materialize_event(event)),
                      rank, 0)
