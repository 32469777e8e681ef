"""Token and key byte layouts: what Cortex hashes and what its services ship.

Token ids travel and get hashed as ``uint32`` little-endian (the Cortex key
layout, the proto's ``*_token_ids_le`` fields); block keys as ``uint64``
little-endian (the proto's ``*_keys_le`` fields). Callers that already hold
packed tokens (a ``bytes`` from the wire, a numpy ``uint32`` array) skip the
per-token conversion entirely.

Accepted token inputs (:data:`TokenInput`):

- a sequence of ints (``list``, ``tuple``, ``range``);
- ``bytes`` / ``bytearray`` / ``memoryview``: **already packed** ``uint32``
  little-endian token ids (length a multiple of 4) -- never one token per byte;
- an ``array.array`` of an integer typecode;
- a one-dimensional numpy array of an integer dtype.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeAlias, TypeGuard

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

    NDArrayInt: TypeAlias = npt.NDArray[np.integer[Any]]
else:
    NDArrayInt: TypeAlias = Any

__all__ = [
    "MAX_TOKEN",
    "MAX_WIDE_TOKEN",
    "TokenInput",
    "pack_keys",
    "pack_tokens",
    "token_count",
    "token_list",
    "unpack_keys",
    "unpack_tokens",
]

MAX_TOKEN = 2**32 - 1
"""Largest token id a Cortex key (and the wire) can carry."""

MAX_WIDE_TOKEN = 2**64 - 1
"""Largest token id the engine-hash replicas accept."""

TokenInput: TypeAlias = "Sequence[int] | bytes | bytearray | memoryview | array[int] | NDArrayInt"

_BIG_ENDIAN = sys.byteorder == "big"
_INT_TYPECODES = frozenset("bBhHiIlLqQ")
_BYTES_LIKE = (bytes, bytearray, memoryview)


def _is_ndarray(tokens: object) -> TypeGuard[NDArrayInt]:
    # numpy is only consulted when the caller already imported it: hashing a
    # plain list must not pay numpy's import time.
    numpy = sys.modules.get("numpy")
    return numpy is not None and isinstance(tokens, numpy.ndarray)


def _packed_view(data: bytes | bytearray | memoryview) -> bytes:
    raw = data if isinstance(data, bytes) else memoryview(data).tobytes()
    if len(raw) % 4:
        raise ValueError(f"packed token ids must be a multiple of 4 bytes, got {len(raw)}")
    return raw


def _check_ndarray(tokens: NDArrayInt, high: int) -> None:
    if tokens.ndim != 1:
        raise ValueError(f"token ids must be one-dimensional, got shape {tokens.shape}")
    if tokens.dtype.kind not in "iu":
        raise ValueError(f"token ids must be integers, got dtype {tokens.dtype}")
    # Unsigned dtypes no wider than the limit cannot be out of range: skip the scans.
    fits = tokens.dtype.kind == "u" and tokens.dtype.itemsize * 8 <= high.bit_length()
    if tokens.size and not fits and (int(tokens.min()) < 0 or int(tokens.max()) > high):
        raise ValueError(f"token ids must be in [0, {high}]")


def pack_tokens(tokens: TokenInput) -> bytes:
    """Token ids as ``uint32`` little-endian bytes (4 bytes per token).

    Raises ``ValueError`` for a token outside ``[0, 2**32-1]``, a non-integer
    token, or packed input whose length is not a multiple of 4 bytes.
    """
    if isinstance(tokens, _BYTES_LIKE):
        return _packed_view(tokens)
    if _is_ndarray(tokens):
        _check_ndarray(tokens, MAX_TOKEN)
        packed_np: bytes = tokens.astype("<u4", copy=False).tobytes()
        return packed_np
    if isinstance(tokens, array) and tokens.typecode in "IL" and tokens.itemsize == 4:
        packed = tokens
    else:
        try:
            packed = array("I", tokens)
        except OverflowError as exc:
            raise ValueError(f"token ids must be in [0, {MAX_TOKEN}]") from exc
        except TypeError as exc:
            raise ValueError(f"token ids must be integers: {exc}") from exc
        if packed.itemsize != 4:  # pragma: no cover - no such platform in use
            raise ValueError("this platform has no 4-byte unsigned array typecode")
    if _BIG_ENDIAN:  # pragma: no cover - little-endian machines only in CI
        packed = array(packed.typecode, packed)
        packed.byteswap()
    return packed.tobytes()


def unpack_tokens(data: bytes | bytearray | memoryview) -> list[int]:
    """Inverse of :func:`pack_tokens`."""
    packed = array("I")
    packed.frombytes(_packed_view(data))
    if _BIG_ENDIAN:  # pragma: no cover
        packed.byteswap()
    return packed.tolist()


def token_list(tokens: TokenInput) -> list[int]:
    """Token ids as a list of exact Python ``int`` (never numpy scalars or bools).

    The engines' hashes pickle / CBOR-encode Python ints, and a numpy integer
    pickles differently, so the engine replicas normalise through here. Raises
    ``ValueError`` for a token outside ``[0, 2**64-1]`` or a non-integer token.
    """
    if isinstance(tokens, _BYTES_LIKE):
        return unpack_tokens(tokens)
    if _is_ndarray(tokens):
        _check_ndarray(tokens, MAX_WIDE_TOKEN)
        values: list[int] = tokens.tolist()
        return values
    if isinstance(tokens, array):
        if tokens.typecode not in _INT_TYPECODES:
            raise ValueError(f"token ids must be integers, got array typecode {tokens.typecode!r}")
        if tokens and min(tokens) < 0:
            raise ValueError(f"token ids must be in [0, {MAX_WIDE_TOKEN}]")
        return tokens.tolist()
    try:
        return array("Q", tokens).tolist()
    except OverflowError as exc:
        raise ValueError(f"token ids must be in [0, {MAX_WIDE_TOKEN}]") from exc
    except TypeError as exc:
        raise ValueError(f"token ids must be integers: {exc}") from exc


def token_count(tokens: TokenInput) -> int:
    """Number of token ids in ``tokens`` (packed input counts 4 bytes per token)."""
    if isinstance(tokens, _BYTES_LIKE):
        return memoryview(tokens).nbytes // 4
    return len(tokens)


def pack_keys(keys: Sequence[int]) -> bytes:
    """Block keys as ``uint64`` little-endian bytes (8 bytes per key).

    Raises ``ValueError`` for a key outside ``[0, 2**64-1]``.
    """
    try:
        packed = array("Q", keys)
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"block keys must be integers in [0, {MAX_WIDE_TOKEN}]") from exc
    if _BIG_ENDIAN:  # pragma: no cover
        packed.byteswap()
    return packed.tobytes()


def unpack_keys(data: bytes | bytearray | memoryview) -> list[int]:
    """Inverse of :func:`pack_keys`; ``ValueError`` unless a multiple of 8 bytes."""
    raw = data if isinstance(data, bytes) else memoryview(data).tobytes()
    if len(raw) % 8:
        raise ValueError(f"packed block keys must be a multiple of 8 bytes, got {len(raw)}")
    packed = array("Q")
    packed.frombytes(raw)
    if _BIG_ENDIAN:  # pragma: no cover
        packed.byteswap()
    return packed.tolist()
