"""Cortex block keys: the one chained 64-bit hash every Cortex service shares.

Byte by byte (``u32``/``u64`` little-endian, ``str`` as UTF-8, and
``field(s) = u32(len(utf8(s))) || utf8(s)``)::

    seed    = xxh3_64(b"cortex-domain" || u32(HASH_VERSION) || field(engine)
                      || field(model) || u32(block_size), seed=0)
    root    = seed                                   when no LoRA name and no cache salt
            = xxh3_64(b"cortex-root" || opt(lora_name) || opt(cache_salt), seed=seed)
              where opt(None or "") = b"\\x00" and opt(s) = b"\\x01" || field(s)
    key_i   = xxh3_64(u32(t) for the block_size tokens t of block i, seed=key_{i-1})
    key_-1  = root

Only full blocks are keyed. The length prefixes make every field boundary
unambiguous, so no LoRA name / cache salt pair (salts are client-controlled)
can forge another pair's root. Anything that could change a key value must
bump :data:`HASH_VERSION` and commit ``golden/keys_v<HASH_VERSION>.json``.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from enum import StrEnum

import xxhash

from cortex.hashing.packing import TokenInput, pack_tokens

__all__ = ["HASH_VERSION", "Engine", "HashDomain", "block_keys", "domain_seed", "root_key"]

HASH_VERSION = 1
"""Version of the key function, seed derivation and byte layout."""

_MAX_KEY = 2**64 - 1
_MAX_BLOCK_SIZE = 2**32 - 1
_xxh3 = xxhash.xxh3_64_intdigest
_u32 = struct.Struct("<I").pack


class Engine(StrEnum):
    """Engine kind: part of the hash domain (SGLang and vLLM never share a tree)."""

    SGLANG = "sglang"
    VLLM = "vllm"


def _field(text: str) -> bytes:
    raw = text.encode()
    return _u32(len(raw)) + raw


def _check_block_size(block_size: int) -> None:
    if not 1 <= block_size <= _MAX_BLOCK_SIZE:
        raise ValueError(f"block_size must be in [1, {_MAX_BLOCK_SIZE}] tokens, got {block_size}")


def domain_seed(model: str, block_size: int, engine: Engine | str) -> int:
    """The 64-bit seed of a hash domain (model + block size in tokens + engine kind).

    Raises ``ValueError`` for an unknown engine or a block size outside
    ``[1, 2**32-1]``.
    """
    _check_block_size(block_size)
    data = (
        b"cortex-domain"
        + _u32(HASH_VERSION)
        + _field(Engine(engine).value)
        + _field(model)
        + _u32(block_size)
    )
    return _xxh3(data)


def root_key(seed: int, lora_name: str | None = None, cache_salt: str | None = None) -> int:
    """``key_{-1}``: the domain seed, mixed with the request's chain extras.

    An empty LoRA name or cache salt counts as absent (the engines treat an
    empty salt as no salt too).
    """
    if not lora_name and not cache_salt:
        return seed
    data = bytearray(b"cortex-root")
    for extra in (lora_name, cache_salt):
        data += b"\x01" + _field(extra) if extra else b"\x00"
    return _xxh3(bytes(data), seed)


def block_keys(tokens: TokenInput, block_size: int, parent: int) -> list[int]:
    """Keys of the full blocks of ``tokens``, chained from ``parent``.

    ``tokens`` is any :data:`~cortex.hashing.packing.TokenInput`; packed
    ``bytes`` / numpy ``uint32`` input skips the per-token conversion.
    ``parent`` is the root key for a sequence that starts at the prompt's first
    token, or the key of the block just before ``tokens[0]``. A trailing partial
    block is not keyed (its tokens are still validated). Raises ``ValueError``
    for a block size outside ``[1, 2**32-1]``, a parent outside ``[0, 2**64-1]``
    or a token outside ``[0, 2**32-1]``.
    """
    _check_block_size(block_size)
    if not 0 <= parent <= _MAX_KEY:
        raise ValueError(f"parent key must be in [0, {_MAX_KEY}], got {parent}")
    data = pack_tokens(tokens)
    step = block_size * 4
    end = len(data) - len(data) % step
    key = parent
    xxh3 = _xxh3
    # A comprehension with a walrus is the fastest pure-Python chain: no
    # attribute lookups or append calls per block.
    return [key := xxh3(data[offset : offset + step], key) for offset in range(0, end, step)]


@dataclass(frozen=True, slots=True)
class HashDomain:
    """Model + block size (tokens) + engine kind: the unit that owns one radix tree."""

    model: str
    block_size: int
    engine: Engine
    seed: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model must be a non-empty name")
        _check_block_size(self.block_size)
        object.__setattr__(self, "engine", Engine(self.engine))
        object.__setattr__(self, "seed", domain_seed(self.model, self.block_size, self.engine))

    def root_key(self, lora_name: str | None = None, cache_salt: str | None = None) -> int:
        """The chain root of a request with these extras (see :func:`root_key`)."""
        return root_key(self.seed, lora_name, cache_salt)

    def keys(
        self, tokens: TokenInput, lora_name: str | None = None, cache_salt: str | None = None
    ) -> list[int]:
        """Keys of the full blocks of a whole prompt."""
        return block_keys(tokens, self.block_size, self.root_key(lora_name, cache_salt))
