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

Lookahead keys (speculative decoding, ``lookahead`` = L >= 1 tokens): the engine reuses a
block only when the request also has the block's next L tokens (vLLM EAGLE block hashes,
``v1/core/kv_cache_utils.py::get_request_block_hasher``; SGLang's bigram radix keys, L = 1),
so those tokens are part of the block's key and a block is keyed only once they exist::

    root_L  = xxh3_64(b"cortex-lookahead" || u32(L), seed=root)
    key_i   = xxh3_64(u32(t) for the block_size + L tokens from block i's start,
                      seed=key_{i-1})                key_-1 = root_L

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

__all__ = ["HASH_VERSION", "Engine", "HashDomain", "block_keys", "domain_seed",
           "lookahead_block_keys", "lookahead_root", "root_key"]

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


def lookahead_root(root: int, lookahead: int) -> int:
    """The chain root of lookahead keys (``lookahead`` >= 1 tokens; 0 returns ``root``)."""
    if lookahead == 0:
        return root
    if not 1 <= lookahead <= _MAX_BLOCK_SIZE:
        raise ValueError(f"lookahead must be in [0, {_MAX_BLOCK_SIZE}] tokens, got {lookahead}")
    return _xxh3(b"cortex-lookahead" + _u32(lookahead), root)


def lookahead_block_keys(
    tokens: TokenInput, block_size: int, lookahead: int, parent: int, tail: TokenInput = ()
) -> list[int]:
    """Lookahead keys of the full blocks of ``tokens`` whose next ``lookahead`` tokens are
    known: from ``tokens`` itself, then ``tail`` (tokens known to follow ``tokens``; the
    ingest passes a store's last lookahead list). ``parent``: :func:`lookahead_root` of the
    chain's root, or the previous block's lookahead key. ``lookahead`` 0 is
    :func:`block_keys`. Raises ``ValueError`` like :func:`block_keys`.
    """
    if lookahead == 0:
        return block_keys(tokens, block_size, parent)
    _check_block_size(block_size)
    if not 0 <= parent <= _MAX_KEY:
        raise ValueError(f"parent key must be in [0, {_MAX_KEY}], got {parent}")
    data = pack_tokens(tokens)
    if len(tail):
        data += pack_tokens(tail)
    step = block_size * 4
    window = step + lookahead * 4
    end = len(data) - window  # last start offset whose window fits
    key = parent
    xxh3 = _xxh3
    return [key := xxh3(data[offset : offset + window], key)
            for offset in range(0, end + 1, step)] if end >= 0 else []


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

    def root_key(
        self, lora_name: str | None = None, cache_salt: str | None = None, lookahead: int = 0
    ) -> int:
        """The chain root of a request with these extras (see :func:`root_key`), for keys
        with ``lookahead`` tokens (:func:`lookahead_root`)."""
        return lookahead_root(root_key(self.seed, lora_name, cache_salt), lookahead)

    def keys(
        self,
        tokens: TokenInput,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        lookahead: int = 0,
    ) -> list[int]:
        """Keys of the full blocks of a whole prompt (with ``lookahead``: of the blocks
        whose next ``lookahead`` tokens are in the prompt)."""
        root = self.root_key(lora_name, cache_salt, lookahead)
        return lookahead_block_keys(tokens, self.block_size, lookahead, root)
