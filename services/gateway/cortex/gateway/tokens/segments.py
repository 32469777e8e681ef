"""Where a tokenizer provably encodes text piece by piece (pure rules, checked at load time).

A Hugging Face tokenizer first splits the text on its added (special) tokens and then
normalizes, pre-tokenizes and encodes each piece between them on its own. So ``encode(text)``
equals the concatenation, in order, of the ids of each added token and of each piece
encoded alone — with two caveats checked here: pieces are cached together with "starts the
text" (some pre-tokenizers treat offset 0 specially), and tokenizers whose added tokens
match only as whole words, or whose normalizer could change where added tokens match, are
not segmented at all (:func:`splitter` returns ``None``).

Long pieces are cut further into *chunks*, for tokenizers whose pre-tokenizer is known to end
a pre-token before a space that is followed by an ASCII letter and preceded by a non-space
(:data:`CHUNKED_PRE_TOKENIZERS`; BPE never merges across pre-tokens, so the parts' ids
concatenate to the whole's). The normalizer must be absent or NFC: U+0020 is a starter that
never composes with what precedes it, so NFC of the parts concatenates to NFC of the whole.
A chunk ends at the first such space at least ``size`` characters after its start, a rule
that depends only on the text before the cut: prompts sharing a prefix share its chunks.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from tokenizers import Tokenizer

__all__ = ["CHUNKED_PRE_TOKENIZERS", "Splitter", "affixes", "chunkable", "chunks", "splitter"]

CHUNKED_PRE_TOKENIZERS = (
    # DeepSeek-V3 / V4 (and the R1 family): digits in threes, CJK runs, then the GPT-4-style
    # split whose letter alternative ``[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+`` starts every
    # " word" and whose other alternatives cannot run from a non-space across a space
    "\\p{N}{1,3}|[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+|[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|"
    "[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|"
    "\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
    # Qwen3.5 / 3.6: contractions, ``[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+`` starts every " word",
    # single digits, symbol runs that cannot cross a space, whitespace runs
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?[\\p{L}\\p{M}]+|\\p{N}|"
    " ?[^\\s\\p{L}\\p{M}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
)
"""Pre-tokenizers (their Split regexes joined with ``|``, then ByteLevel without its own
regex) for which a space between a non-space and an ASCII letter always starts a new
pre-token; only these get chunked (the property tests check the claim with cuts at every
allowed space)."""

_CUT = re.compile(r"(?<=\S) (?=[A-Za-z])")
"""Where a chunk may end: a space after a non-space and before an ASCII letter."""

Part = tuple[str, int | None]
"""A piece of text (``None``) or an added token's content and id."""


class _AddedTokenMatcher:
    """Leftmost-longest search of a set of added tokens (what the tokenizer's Aho-Corasick
    pass does), with the tokens' ``lstrip``/``rstrip`` whitespace absorption.

    Candidates are found by ``str.find`` of the first characters of the tokens (a handful:
    ``<`` and the fullwidth bar for DeepSeek's), then checked against their two-character
    prefixes: a text is scanned once per first character, in C (a regex alternation of the
    prefixes tries each at every position, ~5x slower on long prompts).
    """

    def __init__(self, tokens: Sequence[tuple[str, int, bool, bool]]) -> None:
        # content -> (id, lstrip, rstrip)
        self.tokens = {content: (tid, lstrip, rstrip) for content, tid, lstrip, rstrip in tokens}
        lengths: dict[str, set[int]] = {}
        for content in self.tokens:
            lengths.setdefault(content[:2], set()).add(len(content))
        self._lengths = {head: sorted(ls, reverse=True) for head, ls in lengths.items()}
        self._firsts = sorted({head[0] for head in lengths})

    def split(self, text: str) -> list[Part]:
        """``text`` as ``(piece, None)`` and ``(content, id)`` parts, in order."""
        if not self._firsts:
            return [(text, None)]
        parts: list[Part] = []
        lengths = self._lengths
        tokens = self.tokens
        find = text.find
        upcoming = {first: find(first) for first in self._firsts}  # next one, -1: none left
        piece_start = 0
        pos = 0
        while True:
            at = -1
            for first, start in upcoming.items():
                if -1 < start < pos:
                    start = upcoming[first] = find(first, pos)
                if start != -1 and (at == -1 or start < at):
                    at = start
            if at == -1:
                break
            hit = None
            for length in lengths.get(text[at:at + 2], ()):
                candidate = text[at : at + length]
                if candidate in tokens:
                    hit = candidate
                    break
            if hit is None:
                pos = at + 1
                continue
            tid, lstrip, rstrip = tokens[hit]
            left, end = at, at + len(hit)
            if lstrip:
                while left > piece_start and text[left - 1].isspace():
                    left -= 1
            if rstrip:
                while end < len(text) and text[end].isspace():
                    end += 1
            if left > piece_start:
                parts.append((text[piece_start:left], None))
            parts.append((hit, tid))
            piece_start = pos = end
        if piece_start < len(text):
            parts.append((text[piece_start:], None))
        return parts


class Splitter:
    """Splits text on added tokens in the tokenizer's two passes: tokens matched on the raw
    text first, then ("normalized") tokens matched inside the remaining pieces."""

    def __init__(self, raw: _AddedTokenMatcher, normalized: _AddedTokenMatcher) -> None:
        self._raw = raw
        self._normalized = normalized

    def split(self, text: str) -> list[Part]:
        parts: list[Part] = []
        for piece, tid in self._raw.split(text):
            if tid is None:
                parts.extend(self._normalized.split(piece))
            else:
                parts.append((piece, tid))
        return parts


def _normalizer(described: dict[str, Any]) -> str:
    """``"none"`` (changes no text), ``"nfc"`` or ``"other"``."""
    normalizer = described.get("normalizer")
    if normalizer is None or (normalizer.get("type") == "Sequence"
                              and not normalizer.get("normalizers")):
        return "none"
    return "nfc" if normalizer.get("type") == "NFC" else "other"


def splitter(tokenizer: Tokenizer, described: dict[str, Any]) -> Splitter | None:
    """The tokenizer's added-token splitting (``described``: its ``tokenizer.json``), or
    ``None`` when its matching rules cannot be reproduced exactly (then every call encodes
    the whole text)."""
    trivial_normalizer = _normalizer(described) == "none"
    if '"prepend_scheme": "first"' in json.dumps(described.get("pre_tokenizer")):
        return None
    raw: list[tuple[str, int, bool, bool]] = []
    normalized: list[tuple[str, int, bool, bool]] = []
    for token_id, token in tokenizer.get_added_tokens_decoder().items():
        if token.single_word or (token.normalized and not trivial_normalizer):
            return None
        if token.content:
            entry = (token.content, token_id, token.lstrip, token.rstrip)
            (normalized if token.normalized else raw).append(entry)
    if not raw and not normalized:
        return None
    return Splitter(_AddedTokenMatcher(raw), _AddedTokenMatcher(normalized))


def chunkable(described: dict[str, Any]) -> bool:
    """Whether the tokenizer (its ``tokenizer.json``) pre-tokenizes like one of
    :data:`CHUNKED_PRE_TOKENIZERS` behind no normalizer or NFC."""
    if _normalizer(described) == "other":
        return False
    if (described.get("model") or {}).get("type") != "BPE":
        return False
    pre = described.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    if not steps or steps[-1].get("type") != "ByteLevel" or steps[-1].get("use_regex"):
        return False
    splits = steps[:-1]
    if any(s.get("type") != "Split" or s.get("behavior") != "Isolated" or s.get("invert")
           or "Regex" not in s.get("pattern", {}) for s in splits):
        return False
    return "|".join(s["pattern"]["Regex"] for s in splits) in CHUNKED_PRE_TOKENIZERS


def chunks(piece: str, size: int) -> list[str]:
    """``piece`` cut at the first allowed space ``size`` or more characters into each chunk
    (the whole piece when ``size`` is 0 or the piece is short)."""
    if not size or len(piece) <= size:
        return [piece]
    out: list[str] = []
    start = 0
    search = _CUT.search
    while (cut := search(piece, start + size)) is not None:
        out.append(piece[start:cut.start()])
        start = cut.start()
    out.append(piece[start:])
    return out


def affixes(tokenizer: Tokenizer) -> tuple[list[int], list[int]]:
    """Ids the post-processor adds before and after a single sequence."""
    plain = tokenizer.encode("a", add_special_tokens=False).ids
    full = tokenizer.encode("a", add_special_tokens=True).ids
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return full[:start], full[start + len(plain) :]
    raise ValueError("cannot locate the sequence inside the post-processed encoding")
