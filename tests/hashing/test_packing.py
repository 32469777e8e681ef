"""Token and key byte layouts."""

from __future__ import annotations

import struct
from array import array

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from cortex.hashing.packing import (
    pack_keys,
    pack_tokens,
    token_count,
    token_list,
    unpack_keys,
    unpack_tokens,
)


@given(st.lists(st.integers(0, 2**32 - 1), max_size=100))
def test_tokens_pack_as_uint32_little_endian(tokens: list[int]) -> None:
    packed = pack_tokens(tokens)
    assert packed == struct.pack(f"<{len(tokens)}I", *tokens)
    assert unpack_tokens(packed) == tokens
    assert token_count(packed) == token_count(tokens) == len(tokens)


@given(st.lists(st.integers(0, 2**64 - 1), max_size=100))
def test_keys_pack_as_uint64_little_endian(keys: list[int]) -> None:
    packed = pack_keys(keys)
    assert packed == struct.pack(f"<{len(keys)}Q", *keys)
    assert unpack_keys(packed) == keys
    assert unpack_keys(memoryview(packed)) == keys


def test_token_list_gives_exact_python_ints() -> None:
    forms: list[object] = [
        [np.int64(3), np.uint32(2**32 - 1), True],
        np.array([3, 2**32 - 1, 1], dtype=np.uint64),
        array("q", [3, 2**32 - 1, 1]),
        pack_tokens([3, 2**32 - 1, 1]),
    ]
    for form in forms:
        values = token_list(form)  # type: ignore[arg-type]
        assert values == [3, 2**32 - 1, 1]
        assert all(type(value) is int for value in values)


def test_token_list_takes_64_bit_ids_and_refuses_the_rest() -> None:
    assert token_list([2**64 - 1]) == [2**64 - 1]
    bad: list[object] = [[2**64], [-1], [0.5], array("q", [-1]), array("f", [1.0]), np.array([-1])]
    for form in bad:
        with pytest.raises(ValueError):
            token_list(form)  # type: ignore[arg-type]


def test_packed_lengths_must_be_whole() -> None:
    with pytest.raises(ValueError, match="multiple of 4"):
        unpack_tokens(b"\x00" * 6)
    with pytest.raises(ValueError, match="multiple of 8"):
        unpack_keys(b"\x00" * 12)
    with pytest.raises(ValueError):
        pack_keys([2**64])
    with pytest.raises(ValueError):
        pack_keys([-1])
