"""The conformance checks' shape comparison (pure; runs in make test, no engine needed)."""

from __future__ import annotations

from .shapes import differences, shape

REMOVED = {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU", "group_idx": 0}
STORED = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
          "token_ids": [1, 2], "medium": "GPU", "extra_keys": [None], "group_idx": 0}


def test_a_batch_is_alike_whichever_event_comes_first() -> None:
    assert differences(shape([1.0, [REMOVED, STORED]]), shape([1.0, [STORED, REMOVED]])) == []


def test_a_missing_key_is_still_a_difference() -> None:
    stored = {k: v for k, v in STORED.items() if k != "parent_block_hash"}
    assert differences(shape([1.0, [REMOVED, STORED]]), shape([1.0, [stored, REMOVED]])) != []
