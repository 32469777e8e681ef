"""The normalized KV-event model every decoder produces and the encoder writes, and the
engines' wire field order (spec ``kv-events.md`` §2). See :mod:`cortex.kvevents.codec`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final, TypeAlias

from cortex.hashing import Engine

__all__ = [
    "AllBlocksCleared",
    "BlockHash",
    "BlockRemoved",
    "BlockStored",
    "CodecError",
    "Event",
    "EventBatch",
    "describe_error",
]


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

VLLM_STORED_FIELDS: Final = (
    "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
    "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window",
    "locality", "ownership", "session_id", "lookahead_token_ids",
)  # fmt: skip
SGLANG_STORED_FIELDS: Final = (
    "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
    "cache_salt", "session_id", "lora_name",
)  # fmt: skip
VLLM_REMOVED_FIELDS: Final = ("block_hashes", "medium", "group_idx", "locality", "ownership")
SGLANG_REMOVED_FIELDS: Final = ("block_hashes", "medium")

STORED_ORDER: Final = {Engine.VLLM: VLLM_STORED_FIELDS, Engine.SGLANG: SGLANG_STORED_FIELDS}
REMOVED_ORDER: Final = {Engine.VLLM: VLLM_REMOVED_FIELDS, Engine.SGLANG: SGLANG_REMOVED_FIELDS}

STORED_TAG: Final = "BlockStored"
REMOVED_TAG: Final = "BlockRemoved"
CLEARED_TAG: Final = "AllBlocksCleared"


def describe_error(exc: BaseException) -> str:
    """A short ``Type: message`` for an error raised by a third-party parser or packer."""
    text = str(exc)
    return f"{type(exc).__name__}: {text[:200]}" if text else type(exc).__name__
