"""Cortex block keys: the documented byte layout, chain properties and input forms."""

from __future__ import annotations

import struct
from array import array
from dataclasses import FrozenInstanceError

import numpy as np
import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from cortex.hashing import keys as keys_module
from cortex.hashing.keys import (
    HASH_VERSION,
    Engine,
    HashDomain,
    block_keys,
    domain_seed,
    root_key,
)
from cortex.hashing.packing import pack_tokens

TOKENS = st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=300)
BLOCK_SIZES = st.integers(min_value=1, max_value=40)
KEYS = st.integers(min_value=0, max_value=2**64 - 1)


def _field(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<I", len(raw)) + raw


def test_keys_follow_the_documented_byte_layout() -> None:
    # An independent re-implementation of docs/hashing.md, straight on xxhash.
    model, block_size, engine = "meta-llama/Llama-3.1-8B-Instruct", 4, "vllm"
    seed = xxhash.xxh3_64_intdigest(
        b"cortex-domain"
        + struct.pack("<I", HASH_VERSION)
        + _field(engine)
        + _field(model)
        + struct.pack("<I", block_size)
    )
    root = xxhash.xxh3_64_intdigest(
        b"cortex-root" + b"\x01" + _field("lora-x") + b"\x01" + _field("salt-y"), seed=seed
    )
    tokens = [5, 6, 7, 2**32 - 1, 0, 1, 2, 3, 99]
    key0 = xxhash.xxh3_64_intdigest(struct.pack("<4I", *tokens[:4]), seed=root)
    key1 = xxhash.xxh3_64_intdigest(struct.pack("<4I", *tokens[4:8]), seed=key0)

    domain = HashDomain(model, block_size, Engine.VLLM)
    assert domain.seed == seed == domain_seed(model, block_size, engine)
    assert domain.root_key("lora-x", "salt-y") == root
    assert domain.keys(tokens, "lora-x", "salt-y") == [key0, key1]


def test_root_with_only_one_extra_marks_the_other_absent() -> None:
    seed = domain_seed("m", 16, Engine.SGLANG)
    only_salt = xxhash.xxh3_64_intdigest(b"cortex-root\x00\x01" + _field("s"), seed=seed)
    assert root_key(seed, cache_salt="s") == only_salt
    assert root_key(seed) == root_key(seed, "", "") == seed


def test_length_prefixes_keep_lora_and_salt_apart() -> None:
    seed = domain_seed("m", 16, Engine.SGLANG)
    pairs = [
        ("a\0", "b"),
        ("a", "\0b"),
        ("ab", None),
        ("a", "b"),
        (None, "ab"),
        ("a\0salt\0b", None),
        ("a", "b\0salt\0"),
    ]
    roots = {root_key(seed, lora, salt) for lora, salt in pairs}
    assert len(roots) == len(pairs)
    assert seed not in roots


@given(tokens=TOKENS, block_size=BLOCK_SIZES, cut=st.integers(min_value=0, max_value=300))
def test_keys_of_a_prefix_are_a_prefix_of_the_keys(
    tokens: list[int], block_size: int, cut: int
) -> None:
    keys = block_keys(tokens, block_size, 7)
    assert len(keys) == len(tokens) // block_size
    assert block_keys(tokens[:cut], block_size, 7) == keys[: min(cut, len(tokens)) // block_size]


@given(tokens=TOKENS, block_size=BLOCK_SIZES, parent=KEYS, data=st.data())
def test_chaining_from_the_middle_equals_the_tail(
    tokens: list[int], block_size: int, parent: int, data: st.DataObject
) -> None:
    keys = block_keys(tokens, block_size, parent)
    k = data.draw(st.integers(min_value=0, max_value=len(keys)))
    previous = parent if k == 0 else keys[k - 1]
    assert block_keys(tokens[k * block_size :], block_size, previous) == keys[k:]


@given(tokens=st.lists(st.integers(0, 2**32 - 1), min_size=8, max_size=64))
def test_every_token_input_form_gives_the_same_keys(tokens: list[int]) -> None:
    expected = block_keys(tokens, 8, 1)
    packed = pack_tokens(tokens)
    forms: list[object] = [
        tuple(tokens),
        packed,
        bytearray(packed),
        memoryview(packed),
        array("I", tokens),
        array("Q", tokens),
        np.array(tokens, dtype=np.uint32),
        np.array(tokens, dtype=np.int64),
        np.array(tokens, dtype=np.uint64),
        [np.int64(token) for token in tokens],
    ]
    for form in forms:
        assert block_keys(form, 8, 1) == expected, type(form)  # type: ignore[arg-type]


def test_a_strided_numpy_view_is_hashed_by_value() -> None:
    base = np.arange(64, dtype=np.uint32)
    assert block_keys(base[::2], 4, 0) == block_keys(list(range(0, 64, 2)), 4, 0)


@given(
    first=st.tuples(st.text(min_size=1, max_size=20), st.integers(1, 512), st.sampled_from(Engine)),
    second=st.tuples(
        st.text(min_size=1, max_size=20), st.integers(1, 512), st.sampled_from(Engine)
    ),
)
def test_different_domains_have_different_seeds(
    first: tuple[str, int, Engine], second: tuple[str, int, Engine]
) -> None:
    if first != second:
        assert HashDomain(*first).seed != HashDomain(*second).seed


def test_domains_and_roots_change_every_key() -> None:
    tokens = list(range(1, 65))
    domains = [
        HashDomain("m", 16, Engine.SGLANG),
        HashDomain("m", 16, Engine.VLLM),
        HashDomain("m2", 16, Engine.SGLANG),
    ]
    chains = [domain.keys(tokens) for domain in domains]
    chains += [domains[0].keys(tokens, "lora"), domains[0].keys(tokens, None, "salt")]
    chains += [domains[0].keys(tokens, "lora", "salt")]
    for i, left in enumerate(chains):
        for right in chains[i + 1 :]:
            assert not set(left) & set(right)


def test_bumping_the_hash_version_changes_every_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    before = domain_seed("m", 16, Engine.SGLANG)
    monkeypatch.setattr(keys_module, "HASH_VERSION", HASH_VERSION + 1)
    assert domain_seed("m", 16, Engine.SGLANG) != before


@pytest.mark.parametrize(
    "tokens",
    [
        [1, -1],
        [2**32],
        [0] * 16 + [2**40],  # in the unkeyed partial tail: still refused
        [1.5],
        ["1"],
        np.array([1, -1], dtype=np.int64),
        np.array([2**32], dtype=np.uint64),
        np.array([1.0, 2.0]),
        np.array([[1, 2], [3, 4]], dtype=np.uint32),
        b"\x01\x00\x00",
        array("d", [1.0]),
    ],
)
def test_out_of_range_or_non_integer_tokens_are_refused(tokens: object) -> None:
    with pytest.raises(ValueError):
        block_keys(tokens, 16, 0)  # type: ignore[arg-type]


@pytest.mark.parametrize("block_size", [0, -1, 2**32])
def test_bad_block_sizes_are_refused(block_size: int) -> None:
    with pytest.raises(ValueError, match="block_size"):
        block_keys([1, 2], block_size, 0)
    with pytest.raises(ValueError, match="block_size"):
        HashDomain("m", block_size, Engine.SGLANG)


@pytest.mark.parametrize("parent", [-1, 2**64])
def test_bad_parent_keys_are_refused(parent: int) -> None:
    with pytest.raises(ValueError, match="parent"):
        block_keys([1, 2], 1, parent)


def test_hash_domain_validates_and_is_frozen() -> None:
    with pytest.raises(ValueError, match="model"):
        HashDomain("", 16, Engine.SGLANG)
    with pytest.raises(ValueError):
        HashDomain("m", 16, "tgi")  # type: ignore[arg-type]
    domain = HashDomain("m", 16, "vllm")  # type: ignore[arg-type]
    assert domain.engine is Engine.VLLM
    assert domain == HashDomain("m", 16, Engine.VLLM)
    assert repr(domain) == "HashDomain(model='m', block_size=16, engine=<Engine.VLLM: 'vllm'>)"
    with pytest.raises(FrozenInstanceError):
        domain.block_size = 32  # type: ignore[misc]


def test_short_prompts_have_no_keys() -> None:
    domain = HashDomain("m", 16, Engine.SGLANG)
    assert domain.keys([]) == []
    assert domain.keys(list(range(15))) == []
    assert len(domain.keys(list(range(16)))) == 1
