"""Deterministic fake log-probabilities, in the engines' response shapes (pure).

Values are a function of (token id, position) only, so a prompt token has the same logprob
on every request, the prefill and decode legs of a PD pair agree, and a test can compute
the expected value. The sampled token is always the most likely one of its ``top`` list;
the alternatives are other word tokens with lower logprobs.

Shapes: SGLang's native ``meta_info`` lists of ``[logprob, token_id, text_or_null]``
(``input_*`` for prompt tokens from ``logprob_start_len``, ``output_*`` for generated ones,
``*_top_logprobs`` with ``top_logprobs_num``); OpenAI chat ``logprobs.content`` entries
(``token``, ``logprob``, ``bytes``, ``top_logprobs``); OpenAI completions ``logprobs``
(``text_offset``, ``token_logprobs``, ``tokens``, ``top_logprobs``).
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

__all__ = ["FakeLogprobs", "LogprobRequest", "TokenLogprob"]

_SPREAD_MILLI = 6000  # logprobs fall in (-6, 0]
_ALT_STEP = 0.75  # each alternative is this much less likely than the one before
_CACHED_ENTRIES = 1 << 16  # streams repeat every earlier position in each chunk (SGLang)


@dataclass(frozen=True, slots=True)
class LogprobRequest:
    """What a request asked for. ``top``: alternatives per position (SGLang
    ``top_logprobs_num``, OpenAI ``top_logprobs`` / completions ``logprobs``).
    ``start``: first prompt position with a logprob (SGLang ``logprob_start_len``;
    ``None``: no prompt logprobs). ``text``: SGLang ``return_text_in_logprobs``."""

    top: int = 0
    start: int | None = None
    text: bool = True


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One position: the token, its logprob (``None`` for a sequence's first token) and the
    most likely alternatives as (token id, logprob, text), best first."""

    token_id: int
    text: str
    logprob: float | None
    top: tuple[tuple[int, float, str], ...] = ()


class FakeLogprobs:
    """Logprobs over a vocabulary of ``words`` (alternatives); ``decode`` gives token text."""

    def __init__(self, words: Sequence[int], decode: Callable[[int], str]) -> None:
        self._words = list(words) or [0]
        self._decode = functools.lru_cache(maxsize=_CACHED_ENTRIES)(decode)
        self._entry = functools.lru_cache(maxsize=_CACHED_ENTRIES)(self._make_entry)

    @staticmethod
    def _hash(token_id: int, position: int, salt: int = 0) -> int:
        digest: int = xxhash.xxh32_intdigest(struct.pack("<qqq", token_id, position, salt))
        return digest

    def logprob(self, token_id: int, position: int) -> float:
        """The logprob of ``token_id`` at sequence ``position`` (0 = first prompt token)."""
        return -(self._hash(token_id, position) % _SPREAD_MILLI) / 1000.0

    def top(self, token_id: int, position: int, k: int) -> tuple[tuple[int, float, str], ...]:
        """The ``k`` most likely tokens at ``position``: the sampled one, then alternatives."""
        if k <= 0:
            return ()
        best = self.logprob(token_id, position)
        out = [(token_id, best, self._decode(token_id))]
        salt = 1
        while len(out) < k and salt < 8 * k + 8:
            alt = self._words[self._hash(token_id, position, salt) % len(self._words)]
            salt += 1
            if all(alt != seen for seen, _, _ in out):
                out.append((alt, round(best - _ALT_STEP * len(out), 3), self._decode(alt)))
        return tuple(out)

    def entry(self, token_id: int, position: int, k: int, text: str | None = None,
              first: bool = False) -> TokenLogprob:
        """Position ``position`` holding ``token_id``; ``first``: nothing precedes it."""
        return self._entry(token_id, position, k, text, first)

    def _make_entry(self, token_id: int, position: int, k: int, text: str | None,
                    first: bool) -> TokenLogprob:
        if first:
            return TokenLogprob(token_id, self._decode(token_id) if text is None else text, None)
        return TokenLogprob(token_id, self._decode(token_id) if text is None else text,
                            self.logprob(token_id, position), self.top(token_id, position, k))

    def prompt(self, prompt: Sequence[int], start: int, k: int) -> list[TokenLogprob]:
        """Prompt positions ``start``… (position 0 has no logprob)."""
        return [self.entry(token, pos, k, first=pos == 0)
                for pos, token in enumerate(prompt) if pos >= start]

    def output(self, prompt_len: int, tokens: Sequence[int], pieces: Sequence[str], k: int
               ) -> list[TokenLogprob]:
        """Generated tokens (their texts are the pieces the answer is made of)."""
        return [self.entry(token, prompt_len + i, k, text=piece or self._decode(token))
                for i, (token, piece) in enumerate(zip(tokens, pieces, strict=True))]

    def __repr__(self) -> str:
        return f"FakeLogprobs(words={len(self._words)})"


# -- shapes --------------------------------------------------------------------------------


def sglang_triples(entries: Sequence[TokenLogprob], with_text: bool) -> list[list[Any]]:
    """``[[logprob, token_id, text_or_null], ...]``."""
    return [[e.logprob, e.token_id, e.text if with_text else None] for e in entries]


def sglang_top(entries: Sequence[TokenLogprob], with_text: bool) -> list[Any]:
    """Per position the top list of triples (``None`` where there is no logprob)."""
    return [None if e.logprob is None else
            [[lp, tid, text if with_text else None] for tid, lp, text in e.top]
            for e in entries]


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def openai_chat(entries: Sequence[TokenLogprob]) -> dict[str, Any]:
    """A chat choice's ``logprobs``: ``{"content": [...]}``."""
    return {"content": [
        {"token": e.text, "logprob": e.logprob, "bytes": _bytes(e.text),
         "top_logprobs": [{"token": text, "logprob": lp, "bytes": _bytes(text)}
                          for _, lp, text in e.top]}
        for e in entries]}


def openai_completion(entries: Sequence[TokenLogprob], offset: int, top: int
                      ) -> dict[str, Any]:
    """A completions choice's ``logprobs``; ``offset``: text offset of the first token."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e.text)
    return {
        "text_offset": offsets,
        "token_logprobs": [e.logprob for e in entries],
        "tokens": [e.text for e in entries],
        "top_logprobs": [None if e.logprob is None or top <= 0 else
                         {text: lp for _, lp, text in e.top} for e in entries],
    }
