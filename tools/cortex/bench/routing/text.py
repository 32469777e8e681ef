"""Prompt text for the routing benchmark: words that are exactly one token each (pure).

Every workload is assembled from *blocks*. A block id names a fixed sequence of words, and
the DeepSeek-V4 tokenizer that the sims and the gateway share encodes ``" " + word`` as one
token for every word of :class:`WordVocabulary`, also inside chat messages. So a block of
``n`` words is ``n`` tokens wherever it appears, equal block ids give equal token prefixes,
and different ids give different blocks: the first two words spell the id in base ``V``
(the vocabulary size), the rest are drawn from a generator seeded with the id.

Text (not token ids) is what the benchmark sends, so that ``sglang-router``'s cache-aware
policy, which matches request *text*, and Cortex, which matches *tokens*, both see what
they were built for.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Protocol

__all__ = ["BlockText", "Segment", "TokenizerLike", "WordVocabulary"]


class TokenizerLike(Protocol):
    """The part of a Hugging Face ``tokenizers.Tokenizer`` the vocabulary needs."""

    def get_vocab(self) -> dict[str, int]: ...

    def encode_batch(self, input: Sequence[Any], is_pretokenized: bool = ...,
                     add_special_tokens: bool = ...) -> Sequence[_Encoding]: ...


class _Encoding(Protocol):
    @property
    def ids(self) -> list[int]: ...


@dataclass(frozen=True, slots=True)
class WordVocabulary:
    """Lower-case ASCII words whose ``" " + word`` is one token (sorted, deterministic)."""

    words: tuple[str, ...]

    def __post_init__(self) -> None:
        if len(self.words) < 2:
            raise ValueError("a vocabulary needs at least two words")

    @classmethod
    def from_tokenizer(cls, tokenizer: TokenizerLike, min_chars: int = 3) -> WordVocabulary:
        """Every byte-level BPE token ``"Ġword"`` (a space then ``min_chars``+ lower-case
        ASCII letters) that the tokenizer really produces alone for ``" word"``."""
        vocab = tokenizer.get_vocab()
        candidates = sorted(
            token[1:] for token in vocab
            if token.startswith("Ġ") and len(token) > min_chars and token[1:].isascii()
            and token[1:].isalpha() and token[1:].islower())
        encoded = tokenizer.encode_batch([" " + w for w in candidates],
                                         add_special_tokens=False)
        words = tuple(w for w, enc in zip(candidates, encoded, strict=True)
                      if list(enc.ids) == [vocab["Ġ" + w]])
        return cls(words)

    def __len__(self) -> int:
        return len(self.words)

    def __repr__(self) -> str:
        return f"WordVocabulary({len(self.words)} words)"


@dataclass(frozen=True, slots=True)
class Segment:
    """``tokens`` tokens taken from ``blocks`` in order: full blocks, the last one cut."""

    blocks: tuple[int, ...]
    tokens: int

    def __post_init__(self) -> None:
        if self.tokens < 0:
            raise ValueError(f"tokens must be >= 0, got {self.tokens}")


class BlockText:
    """Block id → words (``tokens_per_block`` of them); ``seed`` varies the filler words."""

    def __init__(self, vocabulary: WordVocabulary, tokens_per_block: int, seed: int = 0) -> None:
        if tokens_per_block < 2:
            raise ValueError("tokens_per_block must be >= 2 (two words spell the block id)")
        self.vocabulary = vocabulary
        self.tokens_per_block = tokens_per_block
        self.seed = seed
        self._words = lru_cache(maxsize=1 << 17)(self._make_words)

    @property
    def max_block_id(self) -> int:
        """The largest block id two words can spell."""
        return len(self.vocabulary) ** 2 - 1

    def _make_words(self, block_id: int) -> tuple[str, ...]:
        if not 0 <= block_id <= self.max_block_id:
            raise ValueError(f"block id {block_id} is outside 0..{self.max_block_id}")
        words = self.vocabulary.words
        v = len(words)
        rng = random.Random(self.seed * 1_000_003 + block_id)
        filler = rng.choices(words, k=self.tokens_per_block - 2)
        return (words[block_id % v], words[block_id // v], *filler)

    def words(self, block_id: int, tokens: int | None = None) -> tuple[str, ...]:
        """The first ``tokens`` words of the block (all of them by default)."""
        full = self._words(block_id)
        if tokens is None or tokens >= len(full):
            return full
        return full[:max(tokens, 0)]

    def text(self, segment: Segment) -> str:
        """The text of a segment: ``" w1 w2 ..."`` (a leading space), ``tokens`` words."""
        parts: list[str] = []
        left = segment.tokens
        for block_id in segment.blocks:
            if left <= 0:
                break
            words = self.words(block_id, left)
            parts.extend(words)
            left -= len(words)
        if left > 0:
            raise ValueError(f"{len(segment.blocks)} blocks of {self.tokens_per_block} tokens "
                             f"cannot hold {segment.tokens} tokens")
        return "".join(" " + w for w in parts)

    def join(self, segments: Sequence[Segment]) -> str:
        return "".join(self.text(s) for s in segments)

    def __repr__(self) -> str:
        return (f"BlockText({self.vocabulary!r}, tokens_per_block={self.tokens_per_block}, "
                f"seed={self.seed})")
