"""Cortex block keys: the one chained 64-bit hash every Cortex service shares.

``key_i = xxh3_64(tokens_i as uint32 little-endian, seed=key_{i-1})`` and
``key_{-1}`` is the chain's root: the domain seed, mixed with LoRA name and
cache salt when the request has them. Only full blocks are keyed.

Anything that could change a key value must bump :data:`HASH_VERSION`; the
golden vectors under ``golden/`` pin the current one.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum

import xxhash

__all__ = ["HASH_VERSION", "Engine", "HashDomain", "block_keys", "domain_seed", "root_key"]

HASH_VERSION = 1
"""Version of the key function, seed derivation and byte layout."""

_MAX_TOKEN = 2**32 - 1
_xxh3 = xxhash.xxh3_64_intdigest


class Engine(StrEnum):
    """Engine kind: part of the hash domain (SGLang and vLLM never share a tree)."""

    SGLANG = "sglang"
    VLLM = "vllm"


def domain_seed(model: str, block_size: int, engine: Engine | str) -> int:
    """The 64-bit seed of a hash domain (model + block size + engine kind)."""
    text = f"cortex-block-key-v{HASH_VERSION}\0{Engine(engine).value}\0{model}\0{block_size}"
    return _xxh3(text.encode())


def root_key(seed: int, lora_name: str | None = None, cache_salt: str | None = None) -> int:
    """``key_{-1}``: the domain seed, mixed with the request's chain extras."""
    if not lora_name and not cache_salt:
        return seed
    extras = f"lora\0{lora_name or ''}\0salt\0{cache_salt or ''}"
    return _xxh3(extras.encode(), seed=seed)


def block_keys(tokens: Sequence[int], block_size: int, parent: int) -> list[int]:
    """Keys of the full blocks of ``tokens``, chained from ``parent``.

    ``parent`` is the root key for a sequence that starts at the prompt's first
    token, or the key of the block just before ``tokens[0]``. A trailing partial
    block is not keyed. Raises ``ValueError`` for a block size below 1 or a
    token outside ``[0, 2**32-1]``.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    full = len(tokens) // block_size * block_size
    if full == 0:
        return []
    try:
        packed = array("I", tokens[:full] if full != len(tokens) else tokens)
    except OverflowError as exc:
        raise ValueError(f"token ids must be in [0, {_MAX_TOKEN}]") from exc
    if sys.byteorder == "big":
        packed.byteswap()
    view = memoryview(packed.tobytes())
    step = block_size * 4
    keys: list[int] = []
    key = parent
    for offset in range(0, full * 4, step):
        key = _xxh3(view[offset : offset + step], seed=key)
        keys.append(key)
    return keys


@dataclass(frozen=True, slots=True)
class HashDomain:
    """Model + block size + engine kind: the unit that owns one radix tree."""

    model: str
    block_size: int
    engine: Engine
    seed: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model must be a non-empty name")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        object.__setattr__(self, "engine", Engine(self.engine))
        object.__setattr__(self, "seed", domain_seed(self.model, self.block_size, self.engine))

    def root_key(self, lora_name: str | None = None, cache_salt: str | None = None) -> int:
        return root_key(self.seed, lora_name, cache_salt)

    def keys(
        self, tokens: Sequence[int], lora_name: str | None = None, cache_salt: str | None = None
    ) -> list[int]:
        """Keys of the full blocks of a whole prompt."""
        return block_keys(tokens, self.block_size, self.root_key(lora_name, cache_salt))
