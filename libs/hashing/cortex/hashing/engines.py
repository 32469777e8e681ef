"""Bit-exact replicas of vLLM's and SGLang's own block hashes (spec/kv-events.md §3).

Cortex never keys its index on these (engine hashes depend on the engine's
version, hash algorithm and ``PYTHONHASHSEED``). They exist so the simulator can
publish the hashes a real engine would, and so ingest can check that the
``token_ids`` in a ``BlockStored`` really produce the ``block_hashes`` beside
them (an alignment check).

Both engines chain from the first token, block by block, full blocks only; the
whole digest (not the 64-bit event int) is the parent of the next block.

vLLM (>= 0.29; ``--prefix-caching-hash-algo``)::

    H         = sha256(pickle.dumps(obj, protocol=5))            "sha256" (default)
              | sha256(cbor2.dumps(obj, canonical=True))         "sha256_cbor"
              | xxh3_128(pickle / CBOR as above)                 "xxhash" / "xxhash_cbor"
    NONE_HASH = H(seed)   seed = $PYTHONHASHSEED if set, else "vllm-none-hash"
    block_i   = H((parent_digest, tuple(tokens_of_block_i), extra_keys_i or None))
    event int = last 8 bytes of the digest, unsigned

SGLang (>= 0.5.6)::

    page_i    = sha256(parent_digest (absent for the first page) || page tokens as u32 LE)
                (a page holding a token > 2**32-1: 0xFF, then its tokens as u64 LE)
    cache salt: the chain starts from sha256(b"sglang-cache-salt-v1\\0" || utf8(salt))
    event int = first 8 bytes of the digest, signed
"""

from __future__ import annotations

import hashlib
import pickle
import sys
from array import array
from collections.abc import Callable, Iterable, Sequence
from functools import lru_cache
from itertools import repeat

import cbor2
import xxhash

from cortex.hashing.keys import Engine
from cortex.hashing.packing import MAX_TOKEN, TokenInput, pack_tokens, token_list

__all__ = [
    "SGLANG_SALT_PREFIX",
    "VLLM_DEFAULT_SEED",
    "VLLM_HASH_ALGOS",
    "ExtraKeys",
    "engine_event_ints",
    "sglang_event_int",
    "sglang_page_hashes",
    "sglang_salt_root",
    "vllm_block_hashes",
    "vllm_event_int",
    "vllm_extra_keys",
    "vllm_none_hash",
]

VLLM_HASH_ALGOS: tuple[str, ...] = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
"""Values of vLLM's ``--prefix-caching-hash-algo`` this module replicates."""

VLLM_DEFAULT_SEED = "vllm-none-hash"
"""What vLLM >= 0.29 hashes into NONE_HASH when ``PYTHONHASHSEED`` is unset."""

SGLANG_SALT_PREFIX = b"sglang-cache-salt-v1\0"

ExtraKeys = tuple[object, ...] | list[object] | None
"""One block's vLLM extra keys: LoRA name, multimodal ``(id, offset)``, cache salt.

vLLM hashes tuples; lists (what msgpack makes of them in an event) are hashed as
the tuples they were.
"""

# vLLM pickles with pickle.HIGHEST_PROTOCOL, which is 5 on every Python it runs on.
_PICKLE_PROTOCOL = 5
_CBOR_NULL = b"\xf6"
_CBOR_ARRAY3 = b"\x83"
_BIG_ENDIAN = sys.byteorder == "big"


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


_DIGESTS: dict[str, Callable[[bytes], bytes]] = {
    "sha256": _sha256,
    "sha256_cbor": _sha256,
    "xxhash": xxhash.xxh3_128_digest,
    "xxhash_cbor": xxhash.xxh3_128_digest,
}


def _check_algo(algo: str) -> Callable[[bytes], bytes]:
    digest = _DIGESTS.get(algo)
    if digest is None:
        raise ValueError(f"unknown vLLM hash algo {algo!r}; expected one of {VLLM_HASH_ALGOS}")
    return digest


def _as_tuples(value: object) -> object:
    if isinstance(value, (list, tuple)):
        return tuple(_as_tuples(item) for item in value)
    return value


def _check_block_size(block_size: int) -> None:
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1 tokens, got {block_size}")


@lru_cache(maxsize=64)
def _none_hash(algo: str, seed: str) -> bytes:
    digest = _check_algo(algo)
    if algo.endswith("_cbor"):
        return digest(cbor2.dumps(seed, canonical=True))
    return digest(pickle.dumps(seed, protocol=_PICKLE_PROTOCOL))


def vllm_none_hash(algo: str = "sha256", seed: str | None = None) -> bytes:
    """vLLM's NONE_HASH: the parent digest of a sequence's first block.

    ``seed`` plays the role of ``$PYTHONHASHSEED`` (vLLM hashes the variable's
    string value); ``None`` means unset, i.e. ``"vllm-none-hash"``. vLLM 0.10.2
    to 0.28 used ``os.urandom(32)`` when the variable was unset: such a worker's
    hashes cannot be reproduced. Raises ``ValueError`` for an unknown ``algo``.
    """
    return _none_hash(algo, VLLM_DEFAULT_SEED if seed is None else seed)


@lru_cache(maxsize=8)
def _cbor_bytes_head(length: int) -> bytes:
    # A 3-element array header, then the header of a byte string of this length
    # (digests are 16 or 32 bytes; a caller's parent may be anything non-empty).
    return _CBOR_ARRAY3 + bytes(cbor2.dumps(bytes(length)))[:-length]


def vllm_block_hashes(
    tokens: TokenInput,
    block_size: int,
    *,
    algo: str = "sha256",
    seed: str | None = None,
    parent: bytes | None = None,
    extra_keys: Sequence[ExtraKeys] | None = None,
) -> list[bytes]:
    """vLLM's digests of the full blocks of ``tokens`` (32 bytes; 16 for xxhash algos).

    ``parent`` is the digest of the block before ``tokens[0]``; ``None`` (or
    empty) starts from NONE_HASH of ``algo`` and ``seed``. ``extra_keys`` has one
    entry per full block (see :func:`vllm_extra_keys`, or an event's
    ``extra_keys`` field as decoded); an empty one counts as ``None``, as vLLM
    never hashes an empty tuple. Tokens are hashed as exact Python ints.
    Raises ``ValueError`` for an unknown algo, a block size below 1, a token
    outside ``[0, 2**64-1]`` or an ``extra_keys`` of the wrong length.
    """
    digest = _check_algo(algo)
    _check_block_size(block_size)
    ints = token_list(tokens)
    blocks = len(ints) // block_size
    if extra_keys is not None and len(extra_keys) != blocks:
        raise ValueError(f"extra_keys has {len(extra_keys)} entries for {blocks} full blocks")
    # bytes exactly: a bytearray parent would pickle as another type.
    prev = bytes(parent) if parent else vllm_none_hash(algo, seed)
    starts = range(0, blocks * block_size, block_size)
    extras: Iterable[object] = (
        repeat(None) if extra_keys is None else [_as_tuples(e) if e else None for e in extra_keys]
    )
    out: list[bytes] = []
    append = out.append
    if algo.endswith("_cbor"):
        # CBOR has no back-references, so the 3-array is framed by hand around
        # the token list: only the tokens (and any extra keys) go through cbor2.
        dumps = cbor2.dumps
        for start, extra in zip(starts, extras, strict=False):
            tail = _CBOR_NULL if extra is None else dumps(extra, canonical=True)
            head = _cbor_bytes_head(len(prev))
            prev = digest(head + prev + dumps(ints[start : start + block_size]) + tail)
            append(prev)
        return out
    # pickle memoizes by object identity, so hand framing would be fragile: pickle
    # the exact tuple vLLM pickles (measured as fast as hand framing anyway).
    dumps_pickle = pickle.dumps
    for start, extra in zip(starts, extras, strict=False):
        block = tuple(ints[start : start + block_size])
        prev = digest(dumps_pickle((prev, block, extra), _PICKLE_PROTOCOL))
        append(prev)
    return out


def vllm_extra_keys(
    num_blocks: int,
    *,
    lora_name: str | None = None,
    cache_salt: str | None = None,
    first_block: int = 0,
) -> list[ExtraKeys]:
    """Per-block extra keys of a plain-text vLLM request, as vLLM assembles them.

    The LoRA name goes into every block; the cache salt only into the block at
    index 0 of the sequence (it reaches later blocks through the chain).
    ``first_block`` is the sequence index of the first block these are for.
    """
    out: list[ExtraKeys] = []
    for index in range(first_block, first_block + num_blocks):
        keys: list[object] = []
        if lora_name is not None:
            keys.append(lora_name)
        if cache_salt and index == 0:
            keys.append(cache_salt)
        out.append(tuple(keys) if keys else None)
    return out


def vllm_event_int(digest: bytes) -> int:
    """The unsigned 64-bit int vLLM publishes for a block: the digest's last 8 bytes."""
    if len(digest) < 8:
        raise ValueError(f"a vLLM block digest has at least 8 bytes, got {len(digest)}")
    return int.from_bytes(digest[-8:], "big")


def sglang_salt_root(cache_salt: str) -> bytes:
    """The digest a salted SGLang chain starts from."""
    return hashlib.sha256(SGLANG_SALT_PREFIX + cache_salt.encode()).digest()


def _u64_le(values: list[int]) -> bytes:
    wide = array("Q", values)
    if _BIG_ENDIAN:  # pragma: no cover - big-endian hosts only
        wide.byteswap()
    return wide.tobytes()


def _sglang_wide_pages(ints: list[int], page_size: int, prior: bytes) -> list[bytes]:
    out: list[bytes] = []
    sha = hashlib.sha256
    for start in range(0, len(ints) - len(ints) % page_size, page_size):
        page = ints[start : start + page_size]
        # SGLang widens only the pages that need it: 0xFF marks the u64 form.
        payload = b"\xff" + _u64_le(page) if max(page) > MAX_TOKEN else pack_tokens(page)
        prior = sha(prior + payload).digest()
        out.append(prior)
    return out


def sglang_page_hashes(
    tokens: TokenInput,
    page_size: int,
    *,
    parent: bytes | None = None,
    cache_salt: str | None = None,
) -> list[bytes]:
    """SGLang's 32-byte digests of the full pages of ``tokens``.

    ``parent`` is the digest of the page before ``tokens[0]``; without one the
    chain starts empty, or from :func:`sglang_salt_root` when ``cache_salt`` is
    set (an empty salt counts as none, and a salt is ignored when ``parent`` is
    given: the parent already carries it). Raises ``ValueError`` for a page size
    below 1 or a token outside ``[0, 2**64-1]``.
    """
    _check_block_size(page_size)
    prior = parent or (sglang_salt_root(cache_salt) if cache_salt else b"")
    try:
        data = pack_tokens(tokens)
    except ValueError:
        # Either an invalid token (token_list raises) or a token above 2**32-1,
        # which SGLang hashes in its wide form.
        return _sglang_wide_pages(token_list(tokens), page_size, prior)
    step = page_size * 4
    sha = hashlib.sha256
    end = len(data) - len(data) % step
    return [
        prior := sha(prior + data[offset : offset + step]).digest()
        for offset in range(0, end, step)
    ]


def sglang_event_int(digest: bytes) -> int:
    """The signed 64-bit int SGLang publishes for a page: the digest's first 8 bytes."""
    if len(digest) < 8:
        raise ValueError(f"an SGLang page digest has at least 8 bytes, got {len(digest)}")
    return int.from_bytes(digest[:8], "big", signed=True)


def engine_event_ints(
    engine: Engine | str,
    tokens: TokenInput,
    block_size: int,
    *,
    algo: str | None = None,
    seed: str | None = None,
    parent: bytes | None = None,
    extra_keys: Sequence[ExtraKeys] | None = None,
    lora_name: str | None = None,
    cache_salt: str | None = None,
) -> list[int]:
    """The ints ``engine`` publishes in ``BlockStored.block_hashes`` for ``tokens``.

    ``parent`` is the previous block's *digest* (an event int cannot be chained
    from). vLLM: ``algo`` (default ``"sha256"``), ``seed``, and either
    ``extra_keys`` or ``lora_name`` / ``cache_salt`` (turned into extra keys as
    vLLM does; the salt only when the chain starts here). SGLang: ``cache_salt``;
    a ``lora_name`` is accepted and ignored (SGLang does not fold it into its
    event hashes); ``algo``, ``seed`` and ``extra_keys`` are ``ValueError``.
    """
    kind = Engine(engine)
    if kind is Engine.SGLANG:
        if algo is not None or seed is not None or extra_keys is not None:
            raise ValueError("algo, seed and extra_keys apply to vLLM only")
        pages = sglang_page_hashes(tokens, block_size, parent=parent, cache_salt=cache_salt)
        return [sglang_event_int(digest) for digest in pages]
    if extra_keys is not None and (lora_name is not None or cache_salt):
        raise ValueError("give either extra_keys or lora_name / cache_salt, not both")
    ints = token_list(tokens)
    if extra_keys is None and (lora_name is not None or cache_salt):
        _check_block_size(block_size)
        extra_keys = vllm_extra_keys(
            len(ints) // block_size,
            lora_name=lora_name,
            cache_salt=cache_salt,
            first_block=0 if not parent else 1,
        )
    blocks = vllm_block_hashes(
        ints, block_size, algo=algo or "sha256", seed=seed, parent=parent, extra_keys=extra_keys
    )
    return [vllm_event_int(digest) for digest in blocks]
