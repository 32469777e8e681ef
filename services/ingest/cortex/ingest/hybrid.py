"""Hybrid models: which full-attention blocks of a source a prefix hit can really use.

vLLM 0.33 gives a hybrid model one KV-cache group per layer type (full attention, sliding
window, Mamba, ...) and publishes every group's stores and removals with its ``group_idx``,
``kv_cache_spec_kind`` and ``kv_cache_spec_sliding_window``
(``v1/core/kv_cache_manager.py`` fills them from the groups' specs). All groups key their
blocks by the same request block hashes (``v1/core/block_pool.py::cache_full_blocks``), and
a prefix hit needs every group's condition
(``v1/core/kv_cache_coordinator.py::HybridKVCacheCoordinator``): full attention the whole
prefix, a sliding window the blocks of the last window before the hit's end, Mamba its state
at that boundary.

The full-attention group is the prefix ledger: its blocks are keyed as usual. A block is
credited (handed to the index) only while every other group that publishes holds the same
engine hash. That asks more than the engine needs (a window or a boundary state would do,
but the index matches contiguous prefixes, not per-position conditions), so it may
under-credit and never over-credits. Held back blocks are counted
(``ignored_blocks{reason="hybrid_unconfirmed"}``). A group whose block size differs from the
full-attention group's cannot be compared block by block: the source then credits nothing
(``reason="hybrid_block_size"``). A hybrid source without a full-attention group (a pure
Mamba or sliding-window model) has no prefix ledger and credits nothing either.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

from cortex.ingest.ledger import Ledger
from cortex.kvevents.codec import BlockHash

__all__ = ["PREFIX_KINDS", "HybridGroups", "is_hybrid_store"]

PREFIX_KINDS: Final = frozenset({"full_attention", "mla_attention"})
"""Group kinds whose blocks are a contiguous prefix (vLLM ``KVCacheSpecKind``)."""


def is_hybrid_store(group_idx: int, kind: str | None) -> bool:
    """Whether a store reveals more than one KV-cache group (a single-group model publishes
    group 0, as full attention or without a kind)."""
    return group_idx != 0 or (kind is not None and kind not in PREFIX_KINDS)


class HybridGroups:
    """The groups of one hybrid-model source: the full-attention group's complete ledger
    (``full``), and the engine hashes every other group holds (counted copies)."""

    __slots__ = ("_held", "block_sizes", "full", "kinds", "prefix_group", "unverifiable")

    def __init__(self) -> None:
        self.full = Ledger()
        self.prefix_group: int | None = None
        self.kinds: dict[int, str | None] = {}
        self.block_sizes: dict[int, int] = {}
        self.unverifiable = False
        self._held: dict[int, dict[BlockHash, int]] = {}

    def __repr__(self) -> str:
        return (f"HybridGroups(prefix={self.prefix_group}, kinds={self.kinds},"
                f" full={len(self.full)}, unverifiable={self.unverifiable})")

    def is_prefix(self, group: int, kind: str | None) -> bool:
        """Whether a store of ``group`` (of ``kind``) belongs to the prefix ledger; the
        first full-attention group seen becomes it (group 0 when no kind is published)."""
        self.kinds.setdefault(group, kind)
        if self.prefix_group is None and (kind in PREFIX_KINDS or (kind is None and group == 0)):
            self.prefix_group = group
        return group == self.prefix_group

    def learn_block_size(self, group: int, size: int, prefix_size: int | None) -> bool:
        """Record a condition group's block size; ``False`` (and unverifiable from then
        on) when it differs from the full-attention group's."""
        self.block_sizes.setdefault(group, size)
        if prefix_size is not None and size != prefix_size:
            self.unverifiable = True
        return not self.unverifiable

    def confirmed(self, engine_hash: BlockHash) -> bool:
        """Every condition group holds this full-attention block's hash."""
        if self.unverifiable:
            return False
        return all(engine_hash in held for held in self._held.values())

    def hold(self, group: int, hashes: Iterable[BlockHash]) -> None:
        held = self._held.setdefault(group, {})
        for engine_hash in hashes:
            held[engine_hash] = held.get(engine_hash, 0) + 1

    def release(self, group: int, hashes: Iterable[BlockHash]) -> list[BlockHash]:
        """Drop one copy of each hash from ``group``; the hashes it no longer holds."""
        held = self._held.setdefault(group, {})
        gone: list[BlockHash] = []
        for engine_hash in hashes:
            copies = held.get(engine_hash)
            if copies is None:
                continue
            if copies > 1:
                held[engine_hash] = copies - 1
            else:
                del held[engine_hash]
                gone.append(engine_hash)
        return gone

    def clear(self) -> None:
        """Forget every block (the groups and their kinds stay known)."""
        self.full.clear()
        for held in self._held.values():
            held.clear()
