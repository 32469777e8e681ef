"""Lookahead keys (speculative decoding): a block's key covers its next L tokens."""

from __future__ import annotations

import pytest
import xxhash

from cortex.hashing import Engine, HashDomain, lookahead_block_keys, lookahead_root, pack_tokens

pytestmark = pytest.mark.timeout(10)

DOMAIN = HashDomain("m", 4, Engine.VLLM)


def test_layout_is_the_documented_one() -> None:
    root = lookahead_root(DOMAIN.seed, 1)
    assert root == xxhash.xxh3_64_intdigest(b"cortex-lookahead" + (1).to_bytes(4, "little"),
                                            DOMAIN.seed)
    first = xxhash.xxh3_64_intdigest(pack_tokens([1, 2, 3, 4, 5]), root)
    assert DOMAIN.keys(range(1, 7), lookahead=1) == [first]


def test_only_blocks_whose_next_tokens_exist_are_keyed() -> None:
    assert len(DOMAIN.keys(range(1, 9), lookahead=1)) == 1  # block 1 lacks its 9th token
    assert len(DOMAIN.keys(range(1, 10), lookahead=1)) == 2
    assert len(DOMAIN.keys(range(1, 10), lookahead=2)) == 1
    assert DOMAIN.keys(range(1, 9), lookahead=0) == DOMAIN.keys(range(1, 9))


def test_the_next_token_is_part_of_the_key_and_plain_keys_never_collide() -> None:
    keys = DOMAIN.keys([1, 2, 3, 4, 5, 6, 7, 8, 9], lookahead=1)
    other = DOMAIN.keys([1, 2, 3, 4, 5, 6, 7, 8, 10], lookahead=1)
    assert keys[0] == other[0] and keys[1] != other[1]
    assert not set(keys) & set(DOMAIN.keys(range(1, 10)))


def test_a_tail_continues_the_window_like_the_whole_prompt() -> None:
    root = DOMAIN.root_key(lookahead=2)
    whole = DOMAIN.keys(range(1, 11), lookahead=2)
    assert lookahead_block_keys(list(range(1, 9)), 4, 2, root, tail=[9, 10]) == whole
    with pytest.raises(ValueError):
        lookahead_root(DOMAIN.seed, -1)
