"""vLLM's multimodal extra keys and block hashes (golden vectors computed by vLLM 0.32's own
``kv_cache_utils``: ``tools/realengines/media_reference.py``), and Cortex media block keys."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from cortex.hashing import (
    MediaSpan,
    block_keys,
    media_block_keys,
    media_extra_keys,
    media_pairs,
    vllm_block_hashes,
    vllm_event_int,
    vllm_hash_extras,
)

REFERENCE = json.loads((Path(__file__).parents[1] / "chat" / "data"
                        / "media_vllm_reference.json").read_text())
PAD = 248056


@pytest.mark.parametrize("row", REFERENCE["blocks"], ids=lambda r: r["name"])
def test_block_extra_keys_and_hashes_match_vllm(row: dict[str, Any]) -> None:
    size = row["block_size"]
    spans = [MediaSpan(ident, off, n) for ident, off, n in row["spans"]]
    blocks = len(row["tokens"]) // size
    media = media_extra_keys(spans, blocks, size)
    event = [None if (p := media.get(i)) is None else [list(pair) for pair in p]
             for i in range(blocks)]
    assert event == row["event_extra_keys"]
    extras = [vllm_hash_extras(media.get(i, ())) for i in range(blocks)]
    hashes = vllm_block_hashes(row["tokens"], size, extra_keys=extras)
    assert [vllm_event_int(h) for h in hashes] == row["event_ints"]


def test_media_keys_tell_images_apart_and_keep_plain_blocks() -> None:
    tokens = [1] * 16 + [PAD] * 32
    a = media_block_keys(tokens, 16, 7, media_extra_keys([MediaSpan("a", 16, 32)], 3, 16))
    b = media_block_keys(tokens, 16, 7, media_extra_keys([MediaSpan("b", 16, 32)], 3, 16))
    shifted = media_block_keys(tokens, 16, 7, media_extra_keys([MediaSpan("a", 17, 31)], 3, 16))
    assert a[0] == b[0] == shifted[0]  # the text block is plain
    assert a[1] != b[1] and a[1] != shifted[1] and a[2] != b[2]
    assert media_block_keys(tokens, 16, 7, {}) != a


def test_media_pairs_of_published_extra_keys() -> None:
    assert media_pairs(None) == ()
    assert media_pairs((("a", 3), ("b", -12))) == (("a", 3), ("b", -12))
    assert media_pairs(("sql", ("a", 3)), lora_name="sql") == (("a", 3),)
    assert media_pairs((b"digest",)) is None and media_pairs(("salt",)) is None
    assert media_pairs((("a", True),)) is None


def test_without_media_the_keys_are_plain() -> None:
    tokens = list(range(40))
    assert media_block_keys(tokens, 16, 5, {}) == block_keys(tokens, 16, 5)
    with pytest.raises(ValueError):
        MediaSpan("x", 0, 0)
