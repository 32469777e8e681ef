"""Deterministic answers: the same prompt and seed always give the same output tokens.

Output tokens are drawn from the tokenizer's plain lower-case word tokens (``Ġword``), so
every token decodes on its own to `` word`` and the streamed deltas concatenate to the
full text. The answer's natural length (where EOS comes) is drawn from a range.
"""

from __future__ import annotations

import random
import re
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

import xxhash
from tokenizers import Tokenizer

__all__ = ["FinishReason", "GenerationPlan", "TextGenerator"]

_WORD = re.compile(r"Ġ[a-z]{2,9}")
_VOCAB_LIMIT = 4096


class FinishReason(StrEnum):
    STOP = "stop"
    LENGTH = "length"


@dataclass(frozen=True, slots=True)
class GenerationPlan:
    """The output of one sequence: token ids, their text pieces, and why it ended.

    ``token_ids`` includes the EOS token when ``finish_reason`` is ``stop`` (its piece is
    empty), as the engines count it in ``completion_tokens``.
    """

    token_ids: tuple[int, ...]
    pieces: tuple[str, ...]
    finish_reason: FinishReason

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def __len__(self) -> int:
        return len(self.token_ids)


class TextGenerator:
    """Seeded generator of answers (pure; no I/O after construction)."""

    def __init__(self, tokenizer: Tokenizer, *, seed: int, natural_tokens: tuple[int, int],
                 eos_token_id: int | None) -> None:
        words = sorted(
            token_id for piece, token_id in tokenizer.get_vocab().items() if _WORD.fullmatch(piece)
        )[:_VOCAB_LIMIT]
        if not words:
            words = sorted(tokenizer.get_vocab().values())[:_VOCAB_LIMIT]
        self._words = words
        self._pieces = {token_id: tokenizer.decode([token_id]) for token_id in words}
        self._seed = seed
        self._natural = natural_tokens
        self._eos = eos_token_id

    @property
    def words(self) -> list[int]:
        """The token ids answers are drawn from."""
        return list(self._words)

    def plan(self, prompt: Sequence[int], *, max_tokens: int | None, ignore_eos: bool = False,
             min_tokens: int = 0, request_seed: int | None = None) -> GenerationPlan:
        """The answer to ``prompt``.

        Length: the natural length (seeded, in ``natural_tokens``, at least ``min_tokens``)
        unless ``max_tokens`` is smaller (finish ``length``); with ``ignore_eos`` exactly
        ``max_tokens`` (or the natural length when unbounded).
        """
        digest = xxhash.xxh64_intdigest(array("Q", [t & 0xFFFFFFFFFFFFFFFF for t in prompt[:4096]])
                                        .tobytes(), seed=self._seed)
        rng = random.Random(digest ^ (len(prompt) << 1) ^ ((request_seed or 0) << 32))
        natural = max(rng.randint(*self._natural), min_tokens)
        if ignore_eos:
            count = max_tokens if max_tokens is not None else natural
            reason = FinishReason.LENGTH
        elif max_tokens is not None and max_tokens < natural:
            count, reason = max_tokens, FinishReason.LENGTH
        else:
            count, reason = natural, FinishReason.STOP
        if reason is FinishReason.STOP and self._eos is not None:
            ids = [rng.choice(self._words) for _ in range(count - 1)] + [self._eos]
        else:
            ids = [rng.choice(self._words) for _ in range(count)]
        pieces = tuple("" if token == self._eos else self._pieces[token] for token in ids)
        return GenerationPlan(token_ids=tuple(ids), pieces=pieces, finish_reason=reason)

    def __repr__(self) -> str:
        return (f"TextGenerator(seed={self._seed}, natural={self._natural}, "
                f"vocab={len(self._words)})")
