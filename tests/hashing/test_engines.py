"""Engine hash replicas: the spec's vectors, the engines' own batches, reference formulas."""

from __future__ import annotations

import hashlib
import json
import pickle
import struct
from pathlib import Path
from typing import Any

import cbor2
import msgpack
import numpy as np
import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from cortex.hashing import (
    VLLM_HASH_ALGOS,
    Engine,
    engine_event_ints,
    sglang_event_int,
    sglang_page_hashes,
    sglang_salt_root,
    vllm_block_hashes,
    vllm_event_int,
    vllm_extra_keys,
    vllm_none_hash,
)

BATCHES = Path(__file__).with_name("data") / "engine_batches.json"
WIDE_TOKENS = st.lists(st.integers(0, 2**64 - 1), max_size=60)
EXTRA = st.one_of(
    st.none(),
    st.tuples(st.text(max_size=5)),
    st.tuples(st.just("lora"), st.tuples(st.text(max_size=4), st.integers(0, 100))),
    st.just(("same", "same")),  # one interned object twice: pickle memoizes it
)


# ---- spec/kv-events.md §3, number for number ----


def test_vllm_sha256_vectors() -> None:
    tokens = list(range(1, 33))
    assert vllm_none_hash().hex() == (
        "066b1e8987e027138e98701c46128929378935f9b6cd1549105ae6b4f0d71198"
    )
    assert engine_event_ints("vllm", tokens, 16) == [1403909460543360175, 1643945449041937783]


def test_vllm_sha256_cbor_vectors() -> None:
    tokens = list(range(1, 33))
    assert vllm_none_hash("sha256_cbor").hex() == (
        "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0"
    )
    assert engine_event_ints("vllm", tokens, 16, algo="sha256_cbor") == [
        8866452693264111234,
        807986237951177663,
    ]


def test_vllm_pythonhashseed_zero_vector() -> None:
    assert vllm_none_hash("sha256", seed="0").hex() == (
        "1973e23848344dc43a988a9b478663803cfffe1243480253f9a3cf004b14aa7c"
    )
    # vLLM hashes the variable's *string*: "0", not the int 0.
    assert vllm_none_hash("sha256", "0") == hashlib.sha256(pickle.dumps("0", protocol=5)).digest()


def test_sglang_vectors() -> None:
    assert engine_event_ints("sglang", list(range(1, 49)), 16) == [
        8635429971592222890,
        1256577331724852459,
        5689809685380680247,
    ]
    assert engine_event_ints("sglang", list(range(1, 17)), 16, cache_salt="s1") == [
        2241309735000630258
    ]


# ---- the engines' own publisher output ----


def _stored_events(batch: dict[str, Any]) -> list[dict[str, Any]]:
    _ts, events, *_ = msgpack.unpackb(bytes.fromhex(batch["payload_hex"]))
    return [e for e in events if isinstance(e, dict) and e["type"] == "BlockStored"]


def test_replicas_reproduce_the_engines_own_block_stored_hashes() -> None:
    batches = json.loads(BATCHES.read_text())["batches"]
    checked = 0
    for batch in batches:
        for event in _stored_events(batch):
            assert event["parent_block_hash"] is None
            options: dict[str, Any] = {}
            if batch["engine"] == "vllm":
                options["extra_keys"] = event.get("extra_keys")
            else:
                options["cache_salt"] = event.get("cache_salt")
            ints = engine_event_ints(
                batch["engine"], event["token_ids"], event["block_size"], **options
            )
            assert ints == event["block_hashes"], (batch["engine"], batch["version"])
            checked += 1
    assert checked == 3


# ---- reference formulas (the engines' code paths, written out plainly) ----


def _vllm_reference(
    tokens: list[int], block_size: int, algo: str, extras: list[Any] | None
) -> list[bytes]:
    if algo.endswith("_cbor"):

        def serialize(obj: object) -> bytes:
            return bytes(cbor2.dumps(obj, canonical=True))
    else:

        def serialize(obj: object) -> bytes:
            return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)

    def digest(obj: object) -> bytes:
        data = serialize(obj)
        if algo.startswith("xxhash"):
            return xxhash.xxh3_128_digest(data)
        return hashlib.sha256(data).digest()

    parent = digest("vllm-none-hash")
    out = []
    for index in range(len(tokens) // block_size):
        block = tuple(tokens[index * block_size : (index + 1) * block_size])
        parent = digest((parent, block, extras[index] if extras else None))
        out.append(parent)
    return out


@given(
    tokens=WIDE_TOKENS,
    block_size=st.integers(1, 20),
    algo=st.sampled_from(VLLM_HASH_ALGOS),
    data=st.data(),
)
def test_vllm_matches_the_reference_formula(
    tokens: list[int], block_size: int, algo: str, data: st.DataObject
) -> None:
    blocks = len(tokens) // block_size
    extras = data.draw(st.one_of(st.none(), st.lists(EXTRA, min_size=blocks, max_size=blocks)))
    got = vllm_block_hashes(tokens, block_size, algo=algo, extra_keys=extras)
    assert got == _vllm_reference(tokens, block_size, algo, extras)
    assert all(len(digest) == (16 if algo.startswith("xxhash") else 32) for digest in got)


def _sglang_reference(tokens: list[int], page_size: int, prior: bytes | None) -> list[bytes]:
    out = []
    for start in range(0, len(tokens) - len(tokens) % page_size, page_size):
        page = tokens[start : start + page_size]
        hasher = hashlib.sha256()
        if prior:
            hasher.update(prior)
        if max(page) > 2**32 - 1:
            hasher.update(b"\xff" + struct.pack(f"<{len(page)}Q", *page))
        else:
            for token in page:
                hasher.update(token.to_bytes(4, "little", signed=False))
        prior = hasher.digest()
        out.append(prior)
    return out


@given(
    tokens=st.lists(
        st.one_of(st.integers(0, 2**32 - 1), st.integers(2**32, 2**64 - 1)), max_size=60
    ),
    page_size=st.integers(1, 20),
    salt=st.one_of(st.none(), st.text(max_size=8)),
)
def test_sglang_matches_the_reference_formula(
    tokens: list[int], page_size: int, salt: str | None
) -> None:
    prior = sglang_salt_root(salt) if salt else None
    got = sglang_page_hashes(tokens, page_size, cache_salt=salt)
    assert got == _sglang_reference(tokens, page_size, prior)


def test_only_pages_with_a_wide_token_are_widened() -> None:
    tokens = [1, 2, 3, 2**32, 5, 6]
    digests = sglang_page_hashes(tokens, 2)
    first = hashlib.sha256(struct.pack("<2I", 1, 2)).digest()
    second = hashlib.sha256(first + b"\xff" + struct.pack("<2Q", 3, 2**32)).digest()
    third = hashlib.sha256(second + struct.pack("<2I", 5, 6)).digest()
    assert digests == [first, second, third]


# ---- chaining, inputs, options ----


@pytest.mark.parametrize("engine", list(Engine))
@given(tokens=st.lists(st.integers(0, 200_000), max_size=80), block_size=st.integers(1, 16))
def test_chaining_from_a_parent_digest_equals_the_tail(
    engine: Engine, tokens: list[int], block_size: int
) -> None:
    if engine is Engine.VLLM:
        full = vllm_block_hashes(tokens, block_size)
    else:
        full = sglang_page_hashes(tokens, block_size)
    for k in range(1, len(full)):
        tail = tokens[k * block_size :]
        if engine is Engine.VLLM:
            assert vllm_block_hashes(tail, block_size, parent=full[k - 1]) == full[k:]
        else:
            assert sglang_page_hashes(tail, block_size, parent=full[k - 1]) == full[k:]


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_numpy_and_packed_tokens_hash_like_python_ints(engine: str) -> None:
    tokens = list(range(100, 164))
    expected = engine_event_ints(engine, tokens, 16)
    assert engine_event_ints(engine, np.arange(100, 164, dtype=np.int64), 16) == expected
    numpy_scalars: list[object] = [np.int64(t) for t in tokens]
    assert engine_event_ints(engine, numpy_scalars, 16) == expected  # type: ignore[arg-type]
    assert engine_event_ints(engine, struct.pack("<64I", *tokens), 16) == expected


def test_vllm_extra_keys_follow_the_engine() -> None:
    assert vllm_extra_keys(3) == [None, None, None]
    assert vllm_extra_keys(3, lora_name="ad", cache_salt="s") == [("ad", "s"), ("ad",), ("ad",)]
    assert vllm_extra_keys(2, cache_salt="s", first_block=1) == [None, None]
    assert vllm_extra_keys(1, cache_salt="") == [None]


def test_vllm_salt_and_lora_change_the_whole_chain() -> None:
    tokens = list(range(1, 49))
    plain = engine_event_ints("vllm", tokens, 16)
    salted = engine_event_ints("vllm", tokens, 16, cache_salt="tenant")
    lora = engine_event_ints("vllm", tokens, 16, lora_name="adapter")
    assert not set(plain) & set(salted)
    assert not set(plain) & set(lora)
    explicit = vllm_extra_keys(3, cache_salt="tenant")
    assert salted == engine_event_ints("vllm", tokens, 16, extra_keys=explicit)
    # Mid-chain, the salt is already inside the parent: it is not added again.
    parent = vllm_block_hashes(tokens[:16], 16, extra_keys=explicit[:1])[0]
    assert (
        engine_event_ints("vllm", tokens[16:], 16, parent=parent, cache_salt="tenant")
        == (salted[1:])
    )


def test_sglang_salt_is_ignored_under_a_parent_and_empty_salt_is_none() -> None:
    tokens = list(range(1, 33))
    salted = sglang_page_hashes(tokens, 16, cache_salt="s1")
    assert sglang_page_hashes(tokens[16:], 16, parent=salted[0], cache_salt="s1") == salted[1:]
    assert sglang_page_hashes(tokens, 16, cache_salt="") == sglang_page_hashes(tokens, 16)


def test_event_ints() -> None:
    digest = bytes(range(32))
    assert vllm_event_int(digest) == int.from_bytes(digest, "big") & (2**64 - 1)
    assert sglang_event_int(b"\xff" * 8 + digest) == -1
    assert sglang_event_int(digest) == int.from_bytes(digest[:8], "big")
    for convert in (vllm_event_int, sglang_event_int):
        with pytest.raises(ValueError):
            convert(b"\x00" * 7)


def test_bad_options_are_refused() -> None:
    with pytest.raises(ValueError, match="algo"):
        vllm_none_hash("md5")
    with pytest.raises(ValueError, match="algo"):
        vllm_block_hashes([1, 2], 1, algo="sha512")
    with pytest.raises(ValueError, match="algo"):
        engine_event_ints("vllm", [1, 2], 1, algo="sha1")
    with pytest.raises(ValueError, match="extra_keys"):
        vllm_block_hashes([1, 2, 3, 4], 2, extra_keys=[None])
    with pytest.raises(ValueError, match="vLLM only"):
        engine_event_ints("sglang", [1, 2], 1, algo="sha256")
    with pytest.raises(ValueError, match="not both"):
        engine_event_ints("vllm", [1, 2], 1, extra_keys=[None, None], cache_salt="s")
    with pytest.raises(ValueError):
        engine_event_ints("tgi", [1, 2], 1)
    for page_size in (0, -3):
        with pytest.raises(ValueError, match="block_size"):
            sglang_page_hashes([1, 2], page_size)
        with pytest.raises(ValueError, match="block_size"):
            vllm_block_hashes([1, 2], page_size)
    with pytest.raises(ValueError):
        sglang_page_hashes([1, -2], 1)
    with pytest.raises(ValueError):
        vllm_block_hashes([2**64], 1)


def test_partial_blocks_are_not_hashed() -> None:
    for engine in Engine:
        assert engine_event_ints(engine, [], 16) == []
        assert engine_event_ints(engine, list(range(15)), 16) == []


def test_event_shaped_inputs_hash_like_the_engine_objects() -> None:
    # msgpack turns vLLM's extra-key tuples into lists; a parent may arrive as a bytearray.
    tokens = list(range(32))
    as_tuples = [("adapter", ("img-1", 3)), None]
    as_lists: list[Any] = [["adapter", ["img-1", 3]], []]
    for algo in VLLM_HASH_ALGOS:
        expected = vllm_block_hashes(tokens, 16, algo=algo, extra_keys=as_tuples)
        assert vllm_block_hashes(tokens, 16, algo=algo, extra_keys=as_lists) == expected
        parent = expected[0]
        odd_parent: Any = bytearray(parent)
        tail = vllm_block_hashes(tokens[16:], 16, algo=algo, parent=odd_parent)
        assert tail == vllm_block_hashes(tokens[16:], 16, algo=algo, parent=parent)
