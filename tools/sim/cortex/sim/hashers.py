"""Block hashers of the simulated cache (:class:`cortex.sim.cache.BlockHasher`), pure.

:class:`EngineHasher` computes the engine's real chained block hashes, as a running sim
publishes them (the ingest's alignment check can reproduce them). :class:`FastHasher` is a
cheap stand-in with the same shape, for workloads that only need opaque, chained ids
(``cortex bench ingest`` generates millions of blocks).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import xxhash

from cortex.hashing import BlockMedia, Engine, pack_tokens, vllm_hash_extras
from cortex.hashing.engines import (
    sglang_event_int,
    sglang_page_hashes,
    vllm_block_hashes,
    vllm_event_int,
)

__all__ = ["EngineHasher", "FastHasher"]


def _salted(digests: list[bytes]) -> list[bytes]:
    """32-byte digests (SGLang's width) from the 16-byte fast ones."""
    return [d + d for d in digests]


class EngineHasher:
    """The engine's real block hashes (``cortex.hashing.engines`` replicas).

    ``lookahead`` L > 0 (EAGLE): ``tokens`` also holds the L tokens after the last block, and
    each block's hash covers its next L tokens. vLLM: its real lookahead hash (extra keys
    ``(None, *next tokens)``). SGLang: its bigram pages hash with a native page hash this
    replica does not have; the sim chains its page hash over the page's tokens and the next
    one (opaque ids, as the events' consumers treat them)."""

    def __init__(self, engine: Engine, block_size: int, lookahead: int = 0) -> None:
        self.engine = engine
        self.block_size = block_size
        self.lookahead = lookahead

    def digests(self, tokens: Sequence[int], parent: bytes | None,
                media: Mapping[int, BlockMedia] | None = None) -> list[bytes]:
        size, ahead = self.block_size, self.lookahead
        if media and not ahead:
            # vLLM: each block's media pairs as its tagged extra keys; SGLang writes media
            # identity into the placeholder ids themselves: pairs are opaque salt here
            blocks = len(tokens) // size
            extras = [vllm_hash_extras(media.get(i, ())) for i in range(blocks)]
            if self.engine is Engine.VLLM:
                return vllm_block_hashes(list(tokens), size, parent=parent, extra_keys=extras)
            return _salted(FastHasher(self.engine, size).digests(tokens, parent, media))
        if not ahead:
            if self.engine is Engine.SGLANG:
                return sglang_page_hashes(list(tokens), size, parent=parent)
            return vllm_block_hashes(list(tokens), size, parent=parent)
        blocks = max(len(tokens) - ahead, 0) // size
        nexts = [tuple(tokens[(i + 1) * size : (i + 1) * size + ahead]) for i in range(blocks)]
        if self.engine is Engine.VLLM:
            return vllm_block_hashes(list(tokens[: blocks * size]), size, parent=parent,
                                     extra_keys=[(None, *n) for n in nexts])
        out: list[bytes] = []
        for i, following in enumerate(nexts):
            page = [*tokens[i * size : (i + 1) * size], *following]
            parent = sglang_page_hashes(page, size + ahead, parent=parent)[0]
            out.append(parent)
        return out

    def event_id(self, digest: bytes) -> int:
        if self.engine is Engine.SGLANG:
            return sglang_event_int(digest)
        return vllm_event_int(digest)


class FastHasher:
    """xxh3-128 chained over each full block's packed tokens (``parent`` prefixed).

    Event ids are a digest's first 8 bytes, signed for SGLang (its ids are int64). Opaque
    to Cortex like the engines' hashes, at a fraction of the cost of sha256.
    """

    def __init__(self, engine: Engine, block_size: int) -> None:
        self.engine = engine
        self.block_size = block_size

    def digests(self, tokens: Sequence[int], parent: bytes | None,
                media: Mapping[int, BlockMedia] | None = None) -> list[bytes]:
        packed = pack_tokens(tokens)
        step = self.block_size * 4
        prior = parent or b""
        out: list[bytes] = []
        for i, start in enumerate(range(0, len(packed) - len(packed) % step, step)):
            pairs = media.get(i) if media else None
            salt = repr(pairs).encode() if pairs else b""
            prior = xxhash.xxh3_128_digest(prior + packed[start : start + step] + salt)
            out.append(prior)
        return out

    def event_id(self, digest: bytes) -> int:
        value = int.from_bytes(digest[:8], "big")
        if self.engine is Engine.SGLANG and value >> 63:
            return value - (1 << 64)
        return value
