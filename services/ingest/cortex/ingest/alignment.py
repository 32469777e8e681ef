"""Alignment check: do the ``token_ids`` of a ``BlockStored`` reproduce the engine's hashes?

Cortex keys never depend on engine hashes, but a worker whose hashes *can* be reproduced
proves that the tokens in its events are exactly the tokens it cached, with the block size
we think. Only chain starts (``parent_block_hash`` nil) are checkable: an event carries its
parent's 64-bit int, not the digest the engines chain from.

vLLM: ``hash_algo`` (``--prefix-caching-hash-algo``) and ``hash_seed`` (``PYTHONHASHSEED``)
come from configuration; with ``hash_algo="auto"`` every replicated algorithm is tried and the
first that matches is kept (learned). SGLang (>= 0.5.6) needs nothing.

vLLM EAGLE lookahead blocks hash ``(extra, *next L tokens)`` as their extra keys
(``v1/core/kv_cache_utils.py::get_request_block_hasher``), which the check reproduces from
the store's ``lookahead_token_ids``. SGLang bigram pages hash with its native page hash over
pairs, which is not replicated: those stores are not judged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from cortex.hashing import (
    VLLM_HASH_ALGOS,
    Engine,
    ExtraKeys,
    engine_event_ints,
    vllm_block_hashes,
    vllm_event_int,
)
from cortex.kvevents.codec import BlockHash, BlockStored

__all__ = ["AUTO", "AlignmentChecker", "AlignmentOutcome", "MismatchCause"]

AUTO = "auto"


class MismatchCause(StrEnum):
    """The likely reason a recomputed engine hash differs (a metric label)."""

    BLOCK_SIZE = "block_size"  # tokens do not split into blocks of the announced size
    SEED = "seed"  # vLLM: PYTHONHASHSEED / --prefix-caching-hash-algo differ (or 0.10.2-0.28)
    ENGINE_VERSION = "engine_version"  # SGLang <= 0.5.5 hashed with Python's hash()


@dataclass(frozen=True, slots=True)
class AlignmentOutcome:
    """``cause`` is ``None`` when the hashes matched."""

    cause: MismatchCause | None
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.cause is None


class AlignmentChecker:
    """Per-worker checker; ``check`` returns ``None`` for events it cannot judge."""

    def __init__(
        self,
        engine: Engine,
        *,
        hash_algo: str = AUTO,
        hash_seed: str | None = None,
        max_blocks: int = 2,
    ) -> None:
        if hash_algo != AUTO and hash_algo not in VLLM_HASH_ALGOS:
            raise ValueError(f"hash_algo must be 'auto' or one of {VLLM_HASH_ALGOS}")
        self.engine = Engine(engine)
        self.hash_seed = hash_seed
        self.max_blocks = max_blocks
        self._algos: tuple[str, ...] = VLLM_HASH_ALGOS if hash_algo == AUTO else (hash_algo,)
        self.learned_algo: str | None = None if hash_algo == AUTO else hash_algo
        self.checks = 0
        self.matches = 0

    def __repr__(self) -> str:
        return (
            f"AlignmentChecker(engine={self.engine.value}, algo={self.learned_algo or AUTO},"
            f" checks={self.checks}, matches={self.matches})"
        )

    def check(self, event: BlockStored) -> AlignmentOutcome | None:
        if (
            event.parent_block_hash is not None
            or event.block_size <= 0
            or not event.block_hashes
            or event.lora_name is not None
            or event.lora_id is not None
            or (event.extra_keys is not None and any(event.extra_keys))
            or event.bigram
        ):
            return None  # not a plain chain start: the engine hash depends on more inputs
        size = event.block_size
        count = min(len(event.block_hashes), self.max_blocks)
        if len(event.token_ids) != len(event.block_hashes) * size:
            self.checks += 1
            return AlignmentOutcome(
                MismatchCause.BLOCK_SIZE,
                f"{len(event.token_ids)} tokens for {len(event.block_hashes)} blocks of {size}",
            )
        tokens = event.token_ids[: count * size]
        expected = list(event.block_hashes[:count])
        lookahead = event.lookahead_token_ids
        extras: list[ExtraKeys] | None = (
            None if lookahead is None else [(None, *la) for la in lookahead[:count]]
        )
        self.checks += 1
        if self.engine is Engine.SGLANG:
            if engine_event_ints(Engine.SGLANG, tokens, size, cache_salt=event.cache_salt) == (
                expected
            ):
                self.matches += 1
                return AlignmentOutcome(None)
            return AlignmentOutcome(
                MismatchCause.ENGINE_VERSION,
                "SGLang page hashes not reproducible (SGLang <= 0.5.5 uses Python hash())",
            )
        algos = (self.learned_algo,) if self.learned_algo else self._algos
        for algo in algos:
            if self._vllm(tokens, size, algo, expected, extras) == expected:
                self.learned_algo = algo
                self.matches += 1
                return AlignmentOutcome(None)
        seed = "unset" if self.hash_seed is None else repr(self.hash_seed)
        return AlignmentOutcome(
            MismatchCause.SEED,
            f"no vLLM hash algorithm of {list(algos)} with PYTHONHASHSEED={seed} reproduces the"
            " block hashes (different seed/algo, or vLLM 0.10.2-0.28 with a random seed)",
        )

    def _vllm(
        self,
        tokens: Sequence[int],
        size: int,
        algo: str,
        expected: list[BlockHash],
        extras: list[ExtraKeys] | None,
    ) -> list[BlockHash]:
        digests = vllm_block_hashes(tokens, size, algo=algo, seed=self.hash_seed,
                                    extra_keys=extras)
        if expected and isinstance(expected[0], bytes):  # VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0
            return list(digests)
        return [vllm_event_int(digest) for digest in digests]
