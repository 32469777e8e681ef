"""``KeyMapper``: decoded events of one source → Cortex keys in its :class:`Ledger`.

A ``BlockStored`` is placed by computing the Cortex keys of its ``token_ids``, chained from
its parent's key (found through the engine hash → key map) or, for a chain start, from the
domain's root key with the request's LoRA name / cache salt (spec kv-events.md §4). What the
gateway could not reproduce is counted and never guessed:

- a parent the ledger does not hold (``unknown_parent_blocks``);
- media Cortex does not know, KV-cache groups > 0, device placeholder stores
  (``token_ids=[]``), a token count that is not blocks x block size, extra keys other than
  the LoRA name and a vLLM cache salt (multimodal ids), a LoRA known only by id
  (``ignored_blocks`` by reason).

Every tier (:mod:`cortex.ingest.media`) has its own :class:`Ledger`; engine hashes are the
same across a worker's tiers, so parents and placeholders resolve through all of them. An
offload store without tokens (vLLM's offloading connector publishes ``token_ids=[]``,
``parent_block_hash=None``: ``v1/kv_connector/v1/offloading_connector.py::take_events``)
names blocks the worker already computed: each hash resolves to the key and parent some
tier holds it under, or is ignored (``unresolved_offload``). An offload store whose block
size differs from the domain's (vLLM ``offloaded_block_size``) is ignored
(``offload_block_size``), never a misalignment: the device ledger stays exact.

The block size comes from the registry or, if unset, from the first store; a store with
another block size makes the source MISALIGNED (exact routing off). Sampled chain starts are
checked against the engine's own hash (:mod:`cortex.ingest.alignment`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from cortex.hashing import Engine, HashDomain, block_keys
from cortex.ingest.alignment import AlignmentChecker
from cortex.ingest.codec import BlockHash, BlockRemoved, BlockStored
from cortex.ingest.ledger import Ledger
from cortex.ingest.ops import SourceId
from cortex.ingest.stats import SourceStats, bump
from cortex.ledger.model import StoreBlocks, Tier

__all__ = ["KeyMapper", "Misaligned"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Misaligned:
    """The store's block size disagrees with the domain's: ``reason`` says how."""

    reason: str


class KeyMapper:
    """Engine hash → Cortex key for one source."""

    def __init__(
        self,
        source: SourceId,
        *,
        engine: Engine,
        model: str,
        block_size: int | None,
        stats: SourceStats,
        alignment: AlignmentChecker | None = None,
        align_every: int = 64,
    ) -> None:
        self.source = source
        self.engine = Engine(engine)
        self.model = model
        self.configured_block_size = block_size
        self.block_size = block_size
        self.domain = HashDomain(model, block_size, engine) if block_size is not None else None
        self.ledger = Ledger()
        self.ledgers: dict[Tier, Ledger] = {Tier.DEVICE: self.ledger}
        self.stats = stats
        self.misaligned = False
        self._align = alignment
        self._align_every = max(1, align_every)
        self._chain_starts = 0
        self._mismatch_logged: set[str] = set()

    def __repr__(self) -> str:
        return (
            f"KeyMapper({self.source}, domain={self.domain}, blocks={len(self.ledger)},"
            f" tiers={len(self.ledgers)}, misaligned={self.misaligned})"
        )

    @property
    def blocks(self) -> int:
        """Keys held over every tier."""
        return sum(len(ledger) for ledger in self.ledgers.values())

    def clear(self) -> None:
        for ledger in self.ledgers.values():
            ledger.clear()

    def tier_ledger(self, tier: Tier) -> Ledger:
        ledger = self.ledgers.get(tier)
        if ledger is None:
            ledger = self.ledgers[tier] = Ledger()
        return ledger

    def _resolve(self, engine_hash: BlockHash) -> tuple[int, int] | None:
        """``(key, parent_key)`` some tier holds ``engine_hash`` under (device first)."""
        for ledger in self.ledgers.values():
            key = ledger.key_of(engine_hash)
            if key is not None:
                parent = ledger.parent_of(key)
                assert parent is not None
                return key, parent
        return None

    def _extra(self) -> dict[str, str]:
        return {"worker": self.source.worker_id, "source": str(self.source)}

    def _ignore(self, reason: str, blocks: int) -> None:
        bump(self.stats.ignored_blocks, reason, blocks)

    def stored(self, event: BlockStored, tier: Tier | None = Tier.DEVICE
               ) -> StoreBlocks | list[StoreBlocks] | Misaligned | None:
        """Place a store in ``tier`` (``None``: an unknown medium): the op(s) to emit,
        ``Misaligned``, or ``None`` (counted). Placeholder offload stores give a
        ``StoreBlocks`` per run of resolved blocks."""
        hashes = event.block_hashes
        count = len(hashes)
        bump(self.stats.blocks, "stored", count)
        if tier is None:
            self._ignore("medium", count)
            return None
        if event.group_idx:
            self._ignore("group", count)
            return None
        if self.misaligned:
            self._ignore("misaligned", count)
            return None
        size = event.block_size
        if tier is not Tier.DEVICE:
            if not event.token_ids:
                return self._offloaded(event, tier)
            if size != self.block_size:
                self._ignore("offload_block_size", count)
                return None
        if size <= 0 or not event.token_ids:
            self._ignore("placeholder", count)
            return None
        if size != self.block_size:
            misaligned = self._learn_block_size(size)
            if misaligned is not None:
                self._ignore("misaligned", count)
                return misaligned
        if len(event.token_ids) != count * size:
            self._ignore("token_count", count)
            return None
        domain = self.domain
        assert domain is not None  # the block size is known by now
        parent_hash = event.parent_block_hash
        if parent_hash is None:
            extras = _chain_extras(event, self.engine)
            if isinstance(extras, str):
                self._ignore(extras, count)
                return None
            parent = domain.root_key(*extras)
            if self._align is not None:
                self._maybe_check_alignment(event)
        else:
            if event.extra_keys is not None and _has_foreign_extras(event):
                self._ignore("extra_keys", count)
                return None
            found = self._resolve(parent_hash)
            if found is None:
                self.stats.unknown_parent_blocks += count
                return None
            parent = found[0]
        keys = block_keys(event.token_ids, size, parent)
        self.tier_ledger(tier).store(hashes, keys, parent)
        return StoreBlocks(parent, keys)

    def _offloaded(self, event: BlockStored, tier: Tier) -> list[StoreBlocks] | None:
        """A store without tokens in an offload tier: blocks the worker computed before,
        named by hash only."""
        hashes = event.block_hashes
        if event.block_size not in (0, self.block_size):
            self._ignore("offload_block_size", len(hashes))
            return None
        ledger = self.tier_ledger(tier)
        ops: list[StoreBlocks] = []
        for engine_hash in hashes:
            found = self._resolve(engine_hash)
            if found is None:
                self._ignore("unresolved_offload", 1)
                continue
            key, parent = found
            ledger.store((engine_hash,), (key,), parent)
            if ops and ops[-1].keys[-1] == parent:
                ops[-1].keys.append(key)
            else:
                ops.append(StoreBlocks(parent, [key]))
        return ops or None

    def removed(self, event: BlockRemoved, tier: Tier | None = Tier.DEVICE) -> list[int]:
        """Apply a removal from ``tier`` (that tier only; ``None``: an unknown medium); the
        keys it no longer holds."""
        count = len(event.block_hashes)
        bump(self.stats.blocks, "removed", count)
        if tier is None:
            self._ignore("medium", count)
            return []
        if event.group_idx:
            self._ignore("group", count)
            return []
        ledger = self.ledgers.get(tier)
        if ledger is None:
            self.stats.unknown_removed_blocks += count
            return []
        dead, unknown = ledger.remove(event.block_hashes)
        if unknown:
            self.stats.unknown_removed_blocks += unknown
        return dead

    def _learn_block_size(self, size: int) -> Misaligned | None:
        """Learn the block size from the first store; any later disagreement misaligns."""
        if self.block_size is None:
            self.block_size = size
            self.domain = HashDomain(self.model, size, self.engine)
            log.info("learned block size %d for source=%s", size, self.source,
                     extra=self._extra())
            return None
        configured = "registry" if self.configured_block_size is not None else "first events"
        reason = f"block size: events say {size}, {configured} says {self.block_size}"
        log.error("MISALIGNED source=%s: %s; exact KV routing off for this worker",
                  self.source, reason, extra=self._extra())
        bump(self.stats.alignment_mismatches, "block_size")
        self.misaligned = True
        self.clear()
        return Misaligned(reason)

    def _maybe_check_alignment(self, event: BlockStored) -> None:
        assert self._align is not None
        self._chain_starts += 1
        if (self._chain_starts - 1) % self._align_every:
            return
        outcome = self._align.check(event)
        if outcome is None:
            return
        self.stats.alignment_checks += 1
        if outcome.cause is None:
            return
        bump(self.stats.alignment_mismatches, outcome.cause.value)
        if outcome.cause.value not in self._mismatch_logged:
            self._mismatch_logged.add(outcome.cause.value)
            log.warning("alignment mismatch source=%s likely cause=%s: %s", self.source,
                        outcome.cause.value, outcome.detail, extra=self._extra())


def _chain_extras(event: BlockStored, engine: Engine) -> tuple[str | None, str | None] | str:
    """``(lora_name, cache_salt)`` a chain start is rooted at, or the reason it cannot be
    placed: keys are computed from tokens, so extra inputs the gateway cannot reproduce
    (multimodal hashes, a LoRA known only by id) must not produce keys at all."""
    lora = event.lora_name
    if event.lora_id is not None and not lora:
        return "lora_without_name"
    salt = event.cache_salt
    extras = event.extra_keys
    if extras:
        leftover = [key for key in _keys_of(extras[0]) if key != lora]
        if engine is Engine.VLLM and salt is None and len(leftover) == 1 and isinstance(
            leftover[0], str
        ):
            salt = leftover[0]  # vLLM puts the cache salt into block 0's extra keys
            leftover = []
        if leftover or _has_foreign_extras(event, skip_first=True):
            return "extra_keys"
    return lora, salt


def _has_foreign_extras(event: BlockStored, *, skip_first: bool = False) -> bool:
    """Any block's extra keys beyond the LoRA name (multimodal ids, prompt embeds)."""
    lora = event.lora_name
    for index, keys in enumerate(event.extra_keys or ()):
        if skip_first and index == 0:
            continue
        if any(key != lora for key in _keys_of(keys)):
            return True
    return False


def _keys_of(block_extras: object) -> tuple[object, ...]:
    """One block's extra keys as a tuple (the codec decodes arrays as tuples; nil is none)."""
    if block_extras is None:
        return ()
    if isinstance(block_extras, tuple):
        return block_extras
    return (block_extras,)
