"""``KeyMapper``: decoded events of one source → Cortex keys in its :class:`Ledger`.

A ``BlockStored`` is placed by computing the Cortex keys of its ``token_ids``, chained from
its parent's key (found through the engine hash → key map) or, for a chain start, from the
domain's root key with the request's LoRA name / cache salt (spec kv-events.md §4). What the
gateway could not reproduce is counted and never guessed:

- a parent the ledger does not hold (``unknown_parent_blocks``);
- media Cortex does not know, device placeholder stores (``token_ids=[]``), a token count
  that is not blocks x block size, extra keys other than the LoRA name and a vLLM cache salt
  (multimodal ids), a LoRA known only by id (``ignored_blocks`` by reason).

Every tier (:mod:`cortex.ingest.media`) has its own :class:`Ledger`; engine hashes are the
same across a worker's tiers, so parents and placeholders resolve through all of them. An
offload store without tokens (vLLM's offloading connector publishes ``token_ids=[]``,
``parent_block_hash=None``: ``v1/kv_connector/v1/offloading_connector.py::take_events``)
names blocks the worker already computed: each hash resolves to the key and parent some
tier holds it under, or is ignored (``unresolved_offload``). An offload store whose block
size differs from the domain's (vLLM ``offloaded_block_size``) is ignored
(``offload_block_size``), never a misalignment: the device ledger stays exact. Offload
tiers of a hybrid model's other KV-cache groups are not modelled (``group``).

The block size comes from the registry or, if unset, from the first store; a store with
another block size makes the source MISALIGNED (exact routing off). Sampled chain starts are
checked against the engine's own hash (:mod:`cortex.ingest.alignment`).

Speculative decoding: a store whose blocks carry lookahead tokens (vLLM EAGLE block hashes,
SGLang EAGLE bigram pages) is keyed with lookahead keys (:func:`~cortex.hashing.
lookahead_block_keys`): the engine reuses such a block only for a request that also has its
next L tokens, so the gateway must find it only then. The worker spec's ``kv_lookahead``
says what the worker runs; unset, the first store decides. A store of another mode makes
the source MISALIGNED (``alignment_mismatches{cause="spec_decode"}``): its keys would not
be the ones the gateway looks for.

Hybrid models (several KV-cache groups, :mod:`cortex.ingest.hybrid`): the full-attention
group's blocks are keyed; one is handed to the index only while every other group holds it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from cortex.hashing import (
    BlockMedia,
    Engine,
    HashDomain,
    lookahead_block_keys,
    media_block_keys,
    media_pairs,
)
from cortex.ingest.alignment import AlignmentChecker
from cortex.ingest.columnar import ColumnarEvent, materialize_stored
from cortex.ingest.hybrid import HybridGroups, is_hybrid_store
from cortex.ingest.ledger import Ledger
from cortex.ingest.ops import SourceId
from cortex.ingest.stats import SourceStats, bump
from cortex.kvevents.codec import BlockHash, BlockRemoved, BlockStored
from cortex.ledger.model import RemoveBlocks, StoreBlocks, Tier

__all__ = ["NOT_PLAIN", "KeyMapper", "Misaligned", "NotPlain", "Placed"]

log = logging.getLogger(__name__)

class NotPlain:
    """:meth:`KeyMapper.place_plain`'s answer for a store it does not place."""

    __slots__ = ()


NOT_PLAIN = NotPlain()


@dataclass(frozen=True, slots=True)
class Misaligned:
    """The store's block size disagrees with the domain's: ``reason`` says how."""

    reason: str


Placed = StoreBlocks | Misaligned | list[StoreBlocks | RemoveBlocks] | None
"""What a store does: one chain to store, a misalignment, the ops of a hybrid source (its
credited blocks changed), or nothing (counted)."""


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
        lookahead: int | None = None,
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
        self.configured_lookahead = lookahead
        self.lookahead = lookahead  # tokens after a block its reuse needs; None: not known yet
        self._align = alignment
        self._align_every = max(1, align_every)
        self._chain_starts = 0
        self._mismatch_logged: set[str] = set()
        self.hybrid: HybridGroups | None = None  # set once a second KV-cache group shows

    def __repr__(self) -> str:
        return (
            f"KeyMapper({self.source}, domain={self.domain}, blocks={len(self.ledger)},"
            f" tiers={len(self.ledgers)}, lookahead={self.lookahead},"
            f" misaligned={self.misaligned})"
        )

    def _extra(self) -> dict[str, str]:
        return {"worker": self.source.worker_id, "source": str(self.source)}

    def _ignore(self, reason: str, blocks: int) -> None:
        bump(self.stats.ignored_blocks, reason, blocks)

    @property
    def blocks(self) -> int:
        """Keys held over every tier."""
        return sum(len(ledger) for ledger in self.ledgers.values())

    def clear(self) -> None:
        """Forget every block (every tier, and a hybrid source's group state)."""
        for ledger in self.ledgers.values():
            ledger.clear()
        if self.hybrid is not None:
            self.hybrid.clear()

    def tier_ledger(self, tier: Tier) -> Ledger:
        ledger = self.ledgers.get(tier)
        if ledger is None:
            ledger = self.ledgers[tier] = Ledger()
        return ledger

    def _resolve(self, engine_hash: BlockHash) -> tuple[int, int] | None:
        """``(key, parent_key)`` some tier holds ``engine_hash`` under (device first; a
        hybrid source's full-attention record last)."""
        ledgers = list(self.ledgers.values())
        if self.hybrid is not None:
            ledgers.append(self.hybrid.full)
        for ledger in ledgers:
            key = ledger.key_of(engine_hash)
            if key is not None:
                parent = ledger.parent_of(key)
                assert parent is not None
                return key, parent
        return None

    def _parent_key(self, ledger: Ledger, parent_hash: BlockHash, count: int) -> int | None:
        """The key of a store's parent block: in ``ledger``, else in another tier (not for a
        hybrid source's full-attention ledger); ``None``, counted as ``count`` blocks of an
        unknown parent."""
        found = ledger.key_of(parent_hash)
        if found is None and ledger is not (self.hybrid.full if self.hybrid else None):
            resolved = self._resolve(parent_hash)  # the parent may be in another tier
            found = resolved[0] if resolved is not None else None
        if found is None:
            self.stats.unknown_parent_blocks += count
        return found

    def stored(self, event: BlockStored, tier: Tier | None = Tier.DEVICE) -> Placed:
        """Place a store in ``tier`` (``None``: an unknown medium; see :data:`Placed`).
        Placeholder offload stores give a ``StoreBlocks`` per run of resolved blocks."""
        hashes = event.block_hashes
        count = len(hashes)
        bump(self.stats.blocks, "stored", count)
        if tier is None:
            self._ignore("medium", count)
            return None
        if tier is not Tier.DEVICE:
            return self._stored_offload(event, tier)
        hybrid = self.hybrid
        ops: list[StoreBlocks | RemoveBlocks] = []
        if hybrid is None and is_hybrid_store(event.group_idx, event.kv_cache_spec_kind):
            hybrid = self._become_hybrid(ops)
        if hybrid is None:
            return self._place(event, self.ledger)
        if hybrid.is_prefix(event.group_idx, event.kv_cache_spec_kind):
            placed = self._place(event, hybrid.full)
            if isinstance(placed, Misaligned):
                return placed
            if placed is not None:
                ops.extend(self._credit(hybrid, list(hashes)))
            return ops
        if not hybrid.learn_block_size(event.group_idx, event.block_size, self.block_size):
            self._ignore("hybrid_block_size", count)
            ops.extend(self._uncredit(self.ledger.hashes()))
            return ops
        hybrid.hold(event.group_idx, hashes)
        ops.extend(self._credit(hybrid, [h for h in hashes if hybrid.full.key_of(h) is not None],
                                count_unconfirmed=False))
        return ops

    def _stored_offload(self, event: BlockStored, tier: Tier) -> Placed:
        """A store in a host / disk / shared tier: keyed like a device store (parents
        resolve through every tier), or, without tokens, resolved by hash."""
        count = len(event.block_hashes)
        if event.group_idx:
            self._ignore("group", count)
            return None
        if self.misaligned:
            self._ignore("misaligned", count)
            return None
        if not event.token_ids:
            return self._offloaded(event, tier)
        if event.block_size != self.block_size:
            self._ignore("offload_block_size", count)
            return None
        return self._place(event, self.tier_ledger(tier))

    def _offloaded(self, event: BlockStored, tier: Tier) -> Placed:
        """A store without tokens in an offload tier: blocks the worker computed before,
        named by hash only."""
        hashes = event.block_hashes
        if event.block_size not in (0, self.block_size):
            self._ignore("offload_block_size", len(hashes))
            return None
        ledger = self.tier_ledger(tier)
        ops: list[StoreBlocks | RemoveBlocks] = []
        for engine_hash in hashes:
            found = self._resolve(engine_hash)
            if found is None:
                self._ignore("unresolved_offload", 1)
                continue
            key, parent = found
            ledger.store((engine_hash,), (key,), parent)
            _store_one(ops, parent, key)
        return ops or None

    def _place(self, event: BlockStored, ledger: Ledger) -> StoreBlocks | Misaligned | None:
        """Key a store's chain into ``ledger`` (the source's, or a hybrid source's
        full-attention record)."""
        hashes = event.block_hashes
        count = len(hashes)
        size = event.block_size
        if size <= 0 or not event.token_ids:
            self._ignore("placeholder", count)
            return None
        if self.misaligned:
            self._ignore("misaligned", count)
            return None
        if size != self.block_size:
            misaligned = self._learn_block_size(size)
            if misaligned is not None:
                self._ignore("misaligned", count)
                return misaligned
        if len(event.token_ids) != count * size:
            self._ignore("token_count", count)
            return None
        lookahead = event.lookahead
        if lookahead != self.lookahead:
            if lookahead < 0 or len(event.lookahead_token_ids or ()) not in (0, count):
                self._ignore("lookahead_shape", count)
                return None
            misaligned = self._learn_lookahead(lookahead)
            if misaligned is not None:
                self._ignore("misaligned", count)
                return misaligned
        tail: tuple[int, ...] = ()
        if lookahead:
            if not _lookahead_follows(event, lookahead):
                self._ignore("lookahead_shape", count)
                return None
            tail = event.lookahead_token_ids[-1]  # type: ignore[index]  # count >= 1 lists
        domain = self.domain
        assert domain is not None  # the block size is known by now
        parent_hash = event.parent_block_hash
        if parent_hash is None:
            extras = _chain_extras(event, self.engine)
            if isinstance(extras, str):
                self._ignore(extras, count)
                return None
            parent = domain.root_key(*extras, lookahead=lookahead)
            if self._align is not None:
                self._maybe_check_alignment(lambda: event)
        else:
            if event.extra_keys is not None and _has_foreign_extras(event):
                self._ignore("extra_keys", count)
                return None
            found = self._parent_key(ledger, parent_hash, count)
            if found is None:
                return None
            parent = found
        media = _media_of(event)
        if media and lookahead:
            self._ignore("extra_keys", count)
            return None
        keys = (media_block_keys(event.token_ids, size, parent, media) if media
                else lookahead_block_keys(event.token_ids, size, lookahead, parent, tail))
        ledger.store(hashes, keys, parent)
        return StoreBlocks(parent, keys)

    def place_plain(self, event: ColumnarEvent) -> StoreBlocks | NotPlain | None:
        """:meth:`stored` of a columnar device store (:mod:`cortex.ingest.columnar`: no
        LoRA, salt, media or lookahead; its tokens packed, ``uint32`` little-endian), for a
        source that is neither hybrid nor misaligned and whose block size and lookahead (0)
        are known and match: the same state changes and result as
        ``stored(materialize_stored(event))``. Anything else is :data:`NOT_PLAIN`, before
        any change."""
        hashes, parent_hash, tokens, size = event[1], event[2], event[3], event[4]
        count = len(hashes)
        if (size != self.block_size or self.misaligned or self.lookahead != 0 or not tokens
                or len(tokens) != 4 * count * size or self.hybrid is not None):
            return NOT_PLAIN
        domain = self.domain
        assert domain is not None  # the block size is known
        bump(self.stats.blocks, "stored", count)
        ledger = self.ledger
        if parent_hash is None:
            parent = domain.seed  # root_key() without LoRA, salt or lookahead
            if self._align is not None:
                self._maybe_check_alignment(lambda: materialize_stored(event))
        else:
            found = self._parent_key(ledger, parent_hash, count)
            if found is None:
                return None
            parent = found
        return StoreBlocks(parent, ledger.place(hashes, tokens, size, parent))

    # ---- hybrid models ----------------------------------------------------------------

    def _become_hybrid(self, ops: list[StoreBlocks | RemoveBlocks]) -> HybridGroups:
        """A second KV-cache group showed: what was credited so far is the full-attention
        record, and credited again only once the other groups are known to hold it."""
        hybrid = self.hybrid = HybridGroups()
        hybrid.full = self.ledger.copy()
        hybrid.is_prefix(0, None)  # the blocks so far came from group 0
        log.info("source=%s is a hybrid model (several KV-cache groups)", self.source,
                 extra=self._extra())
        ops.extend(self._uncredit(self.ledger.hashes()))
        return hybrid

    def _credit(self, hybrid: HybridGroups, hashes: list[BlockHash], *,
                count_unconfirmed: bool = True) -> list[StoreBlocks | RemoveBlocks]:
        """Hand the confirmed ones of these full-attention blocks to the index, as chains."""
        ops: list[StoreBlocks | RemoveBlocks] = []
        held_back = 0
        ledger, full = self.ledger, hybrid.full
        for engine_hash in hashes:
            if ledger.key_of(engine_hash) is not None:
                continue
            if not hybrid.confirmed(engine_hash):
                held_back += 1
                continue
            key = full.key_of(engine_hash)
            parent = full.parent_of(key) if key is not None else None
            if key is None or parent is None:
                continue
            ledger.store((engine_hash,), (key,), parent)
            _store_one(ops, parent, key)
        if held_back and count_unconfirmed:
            self._ignore("hybrid_unconfirmed", held_back)
        return ops

    def _uncredit(self, hashes: list[BlockHash]) -> list[StoreBlocks | RemoveBlocks]:
        """Take these blocks' credit back (every copy)."""
        dead: list[int] = []
        for engine_hash in hashes:
            while self.ledger.key_of(engine_hash) is not None:
                dead.extend(self.ledger.remove((engine_hash,))[0])
        return [RemoveBlocks(dead)] if dead else []

    def removed(self, event: BlockRemoved, tier: Tier | None = Tier.DEVICE) -> list[int]:
        """Apply a removal from ``tier`` (that tier only; ``None``: an unknown medium); the
        keys it no longer holds."""
        count = len(event.block_hashes)
        bump(self.stats.blocks, "removed", count)
        if tier is None:
            self._ignore("medium", count)
            return []
        if tier is not Tier.DEVICE:
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
        hybrid = self.hybrid
        if hybrid is None and event.group_idx:
            self._ignore("group", count)  # a group that never stored: nothing to remove
            return []
        if hybrid is None:
            dead, unknown = self.ledger.remove(event.block_hashes)
            if unknown:
                self.stats.unknown_removed_blocks += unknown
            return dead
        if event.group_idx == hybrid.prefix_group:
            _, unknown = hybrid.full.remove(event.block_hashes)
            if unknown:
                self.stats.unknown_removed_blocks += unknown
            gone = [h for h in event.block_hashes if hybrid.full.key_of(h) is None]
        else:  # a condition group lost blocks: their full-attention twins lose the credit
            gone = hybrid.release(event.group_idx, event.block_hashes)
        return [key for op in self._uncredit(gone) if isinstance(op, RemoveBlocks)
                for key in op.keys]

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

    def _learn_lookahead(self, lookahead: int) -> Misaligned | None:
        """Learn the speculative-decoding mode from the first store; any later (or
        configured) disagreement misaligns."""
        if self.lookahead is None:
            self.lookahead = lookahead
            if lookahead:  # keyed, but the gateway only looks for modes the spec announces
                log.warning("source=%s runs speculative decoding (kv lookahead %d) but its"
                            " worker spec has no kv_lookahead: a vLLM worker's blocks get no"
                            " credit until the spec says so", self.source, lookahead,
                            extra=self._extra())
            return None
        configured = ("worker spec kv_lookahead" if self.configured_lookahead is not None
                      else "first events")
        reason = (f"speculative decoding: events carry {lookahead} lookahead tokens per block,"
                  f" {configured} says {self.lookahead}")
        log.error("MISALIGNED source=%s: %s; exact KV routing off for this worker",
                  self.source, reason, extra=self._extra())
        bump(self.stats.alignment_mismatches, "spec_decode")
        self.misaligned = True
        self.clear()
        return Misaligned(reason)

    def _maybe_check_alignment(self, event: Callable[[], BlockStored]) -> None:
        """One chain start more: every ``align_every``-th is checked (``event`` builds the
        store only then)."""
        assert self._align is not None
        self._chain_starts += 1
        if (self._chain_starts - 1) % self._align_every:
            return
        outcome = self._align.check(event())
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


def _store_one(ops: list[StoreBlocks | RemoveBlocks], parent: int, key: int) -> None:
    """One block stored under ``parent``: extends the last chain when it ends there."""
    last = ops[-1] if ops else None
    if isinstance(last, StoreBlocks) and last.keys[-1] == parent:
        last.keys.append(key)
    else:
        ops.append(StoreBlocks(parent, [key]))


def _lookahead_follows(event: BlockStored, lookahead: int) -> bool:
    """Each block's lookahead tokens are the next block's first tokens (what the engine
    hashed); only the last block's come from outside the store."""
    lists = event.lookahead_token_ids or ()
    tokens, size = event.token_ids, event.block_size
    if lookahead > size:
        return False  # vLLM refuses MTP lookahead past one block; nothing to key it by
    return all(
        lists[k] == tokens[(k + 1) * size : (k + 1) * size + lookahead]
        for k in range(len(lists) - 1)
    )


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
        leftover = [key for key in _keys_of(extras[0]) if key != lora and not _is_media(key)]
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
        if any(key != lora and not _is_media(key) for key in _keys_of(keys)):
            return True
    return False


def _is_media(key: object) -> bool:
    """A vLLM multimodal pair ``(identifier, offset in the block)``."""
    return media_pairs((key,)) not in (None, ())


def _media_of(event: BlockStored) -> dict[int, BlockMedia]:
    """The store's blocks that carry media pairs (index in the store → pairs); Cortex keys
    fold them in (:func:`cortex.hashing.media_block_keys`), as the gateway does."""
    out: dict[int, BlockMedia] = {}
    for index, keys in enumerate(event.extra_keys or ()):
        pairs = tuple(key for key in _keys_of(keys) if _is_media(key))
        if pairs:
            out[index] = pairs  # type: ignore[assignment]  # checked by _is_media
    return out


def _keys_of(block_extras: object) -> tuple[object, ...]:
    """One block's extra keys as a tuple (the codec decodes arrays as tuples; nil is none)."""
    if block_extras is None:
        return ()
    if isinstance(block_extras, tuple):
        return block_extras
    return (block_extras,)
