"""Media items in block keys: vLLM's multimodal extra keys, and the Cortex keys that carry them.

vLLM (0.32, ``v1/core/kv_cache_utils.py::_gen_mm_extra_hash_keys``) expands each media item
of a prompt to a run of placeholder tokens (``offset``, ``length``: its
``PlaceholderRange``) whose ids are all the same token (Qwen-VL: ``<|image_pad|>``), so two
images give identical token ids. What tells them apart is the item's *identifier*: every
block that overlaps an item's run gets ``("mm", identifier, offset - block_start)`` in its
extra keys (the offset is negative for a block after the run's first), in placeholder order,
after the LoRA key; KV events publish it untagged as ``(identifier, offset - block_start)``
(``to_event_extra_keys``). The identifier is the request's ``uuid`` for the item, verbatim,
when the request has no ``mm_processor_kwargs`` / ``media_io_kwargs``; else a BLAKE3 hash
the engine computes.

Cortex keys of such blocks fold the pairs in after the block's tokens (a plain block hashes
exactly ``block_size * 4`` bytes, so the two forms cannot collide)::

    key_i = xxh3_64(u32(t) for the block's tokens || b"cortex-mm" || u32(n)
                    || (field(identifier) || i64(offset)) for the n pairs, seed=key_{i-1})

A block without pairs keeps its plain key (:func:`cortex.hashing.block_keys`), so text
blocks before the first media item chain exactly as in a text-only prompt.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import xxhash

from cortex.hashing.packing import TokenInput, pack_tokens

__all__ = ["BlockMedia", "MediaSpan", "media_block_keys", "media_extra_keys",
           "media_pairs", "vllm_hash_extras"]

BlockMedia = tuple[tuple[str, int], ...]
"""One block's media pairs ``(identifier, offset of the item's first token - block start)``."""

_MARK = b"cortex-mm"
_u32 = struct.Struct("<I").pack
_i64 = struct.Struct("<q").pack
_MAX_KEY = 2**64 - 1


@dataclass(frozen=True, slots=True)
class MediaSpan:
    """One media item's placeholder run in the prompt: ``offset`` and ``length`` in tokens."""

    identifier: str
    offset: int
    length: int

    def __post_init__(self) -> None:
        if self.offset < 0 or self.length < 1:
            raise ValueError(f"a media span needs offset >= 0 and length >= 1, got {self}")


def media_extra_keys(spans: Sequence[MediaSpan], num_blocks: int, block_size: int,
                     first_block: int = 0) -> dict[int, BlockMedia]:
    """The media pairs of blocks ``first_block .. first_block + num_blocks - 1`` (sequence
    indices), as vLLM assigns them: every span overlapping the block's token range, in
    prompt order. Blocks without media are absent. Spans must not overlap."""
    ordered = sorted(spans, key=lambda s: s.offset)
    out: dict[int, BlockMedia] = {}
    at = 0
    for index in range(first_block, first_block + num_blocks):
        start, end = index * block_size, (index + 1) * block_size
        while at < len(ordered) and ordered[at].offset + ordered[at].length <= start:
            at += 1
        pairs = []
        for span in ordered[at:]:
            if span.offset >= end:
                break
            pairs.append((span.identifier, span.offset - start))
        if pairs:
            out[index] = tuple(pairs)
    return out


def media_pairs(block_extras: Iterable[object] | None, lora_name: str | None = None
                ) -> BlockMedia | None:
    """The media pairs in one block's published extra keys (a vLLM event's entry), or
    ``None`` if the entry holds something else Cortex cannot key (prompt embeds, a salt or
    LoRA name it does not expect, a malformed pair). ``()``: no media."""
    if block_extras is None:
        return ()
    pairs: list[tuple[str, int]] = []
    for key in block_extras:
        if lora_name is not None and key == lora_name:
            continue
        if (isinstance(key, tuple | list) and len(key) == 2 and isinstance(key[0], str)
                and isinstance(key[1], int) and not isinstance(key[1], bool)):
            pairs.append((key[0], key[1]))
            continue
        return None
    return tuple(pairs)


def vllm_hash_extras(pairs: BlockMedia, lora: tuple[str, str] | None = None
                     ) -> tuple[object, ...] | None:
    """A block's extra keys as vLLM 0.32 hashes them (tagged): ``("lora", name, path)``
    first, then ``("mm", identifier, offset)`` per pair."""
    keys: list[object] = [("lora", *lora)] if lora is not None else []
    keys.extend(("mm", identifier, offset) for identifier, offset in pairs)
    return tuple(keys) if keys else None


def _media_bytes(pairs: BlockMedia) -> bytes:
    data = bytearray(_MARK + _u32(len(pairs)))
    for identifier, offset in pairs:
        raw = identifier.encode()
        data += _u32(len(raw)) + raw + _i64(offset)
    return bytes(data)


def media_block_keys(tokens: TokenInput, block_size: int, parent: int,
                     media: Mapping[int, BlockMedia], first_block: int = 0) -> list[int]:
    """Cortex keys of the full blocks of ``tokens`` chained from ``parent``, where block
    ``first_block + i`` carries ``media[first_block + i]`` (absent: a plain block). With an
    empty ``media`` this is :func:`cortex.hashing.block_keys`. Raises ``ValueError`` like it.
    """
    if not 1 <= block_size <= 2**32 - 1:
        raise ValueError(f"block_size must be in [1, {2**32 - 1}] tokens, got {block_size}")
    if not 0 <= parent <= _MAX_KEY:
        raise ValueError(f"parent key must be in [0, {_MAX_KEY}], got {parent}")
    data = pack_tokens(tokens)
    step = block_size * 4
    key = parent
    xxh3 = xxhash.xxh3_64_intdigest
    out: list[int] = []
    for i, offset in enumerate(range(0, len(data) - len(data) % step, step)):
        block = data[offset : offset + step]
        pairs = media.get(first_block + i)
        key = xxh3(block + _media_bytes(pairs) if pairs else block, key)
        out.append(key)
    return out
