"""Prompt text → the exact token ids the engine will see, cached by segment.

Rendering and the engine's tokenization rules come from :mod:`cortex.chat` (the one shared
definition the simulated engine uses too): the gateway imports them, it does not restate them.

Why segment caching is exact: a Hugging Face tokenizer first splits the text on its added
(special) tokens and then normalizes, pre-tokenizes and encodes each piece between them on
its own. So ``encode(text)`` equals the concatenation, in order, of the ids of each special
token and of each piece encoded alone — with two caveats this module checks at load time:
pieces are cached together with "starts the text" (some pre-tokenizers treat offset 0
specially), and tokenizers whose added tokens match only as whole words, or whose
normalizer could change where added tokens match, are not segmented at all (every call then
encodes the whole text). The post-processor's special tokens (BOS/EOS templates) are added
around the concatenation exactly as ``add_special_tokens=True`` would.

A long system prompt or an earlier turn of a conversation is one piece between the
template's special tokens, so it is encoded once and then served from the cache.

Long pieces are cut further into chunks, for tokenizers whose pre-tokenizer is known to end a
pre-token before a space that is followed by an ASCII letter and preceded by a non-space
(``CHUNKED_PRE_TOKENIZERS``: BPE never merges across pre-tokens, so the ids of the parts
concatenate to the ids of the whole). A chunk ends at the first such space at least
``chunk_chars`` characters after its start, a rule that depends only on the text before
the cut: two prompts sharing a prefix share its chunks, and a plain completion prompt that
extends an earlier one (the next turn of a conversation sent as text) encodes only its
new tail.
"""

from __future__ import annotations

import copy
import functools
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from cortex.chat import ChatTokenizer, RenderArgs

__all__ = ["CHUNKED_PRE_TOKENIZERS", "EncodePlan", "PromptTokenizer", "SegmentCache",
           "TokenizerStats"]

CHUNKED_PRE_TOKENIZERS = (
    # DeepSeek-V3 / V4 (and the R1 family): digits in threes, CJK runs, then the GPT-4-style
    # split whose letter alternative ``[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+`` starts every
    # " word" and whose other alternatives cannot run from a non-space across a space
    "\\p{N}{1,3}|[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+|[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|"
    "[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|"
    "\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
)
"""Pre-tokenizers (their Split regexes joined with ``|``, then ByteLevel without its own
regex) for which a space between a non-space and an ASCII letter always starts a new
pre-token; only these get chunked (the property tests check the claim)."""

_CUT = re.compile(r"(?<=\S) (?=[A-Za-z])")
"""Where a chunk may end: a space after a non-space and before an ASCII letter."""


@dataclass(slots=True)
class TokenizerStats:
    """Counters of the segment cache (pieces, not requests)."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0


class SegmentCache:
    """LRU of ``(piece, starts_text) → token ids``, bounded by the total cached tokens.

    Thread-safe: long prompts are encoded off the event loop."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.tokens = 0
        self.stats = TokenizerStats()
        self._entries: OrderedDict[tuple[str, bool], list[int]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple[str, bool]) -> list[int] | None:
        with self._lock:
            ids = self._entries.get(key)
            if ids is None:
                self.stats.misses += 1
                return None
            self._entries.move_to_end(key)
            self.stats.hits += 1
            return ids

    def put(self, key: tuple[str, bool], ids: list[int]) -> None:
        with self._lock:
            if len(ids) > self.max_tokens or key in self._entries:
                return
            self._entries[key] = ids
            self.tokens += len(ids)
            while self.tokens > self.max_tokens:
                _, old = self._entries.popitem(last=False)
                self.tokens -= len(old)
                self.stats.evictions += 1

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return (
            f"SegmentCache(segments={len(self._entries)}, tokens={self.tokens}/{self.max_tokens},"
            f" hits={self.stats.hits}, misses={self.stats.misses})"
        )


class _AddedTokenMatcher:
    """Leftmost-longest search of a set of added tokens (what the tokenizer's Aho-Corasick
    pass does), with the tokens' ``lstrip``/``rstrip`` whitespace absorption.

    Candidates are found with a regex over the tokens' two-character prefixes, so text
    without them is scanned at C speed.
    """

    def __init__(self, tokens: Sequence[tuple[str, int, bool, bool]]) -> None:
        # content -> (id, lstrip, rstrip)
        self.tokens = {content: (tid, lstrip, rstrip) for content, tid, lstrip, rstrip in tokens}
        # Candidates are found by the tokens' two-character prefixes (one for 1-char tokens).
        lengths: dict[str, set[int]] = {}
        for content in self.tokens:
            lengths.setdefault(content[:2], set()).add(len(content))
        self._lengths = {head: sorted(ls, reverse=True) for head, ls in lengths.items()}
        heads = sorted(lengths, key=len, reverse=True)
        self._first = re.compile("|".join(map(re.escape, heads))) if heads else None

    def split(self, text: str) -> list[tuple[str, int | None]]:
        """``text`` as ``(piece, None)`` and ``(content, id)`` parts, in order."""
        if self._first is None:
            return [(text, None)]
        parts: list[tuple[str, int | None]] = []
        search = self._first.search
        lengths = self._lengths
        tokens = self.tokens
        piece_start = 0
        pos = 0
        while True:
            found = search(text, pos)
            if found is None:
                break
            at = found.start()
            hit = None
            for length in lengths[found.group()]:
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


class _Splitter:
    """Splits text on added tokens in the tokenizer's two passes: tokens matched on the raw
    text first, then ("normalized") tokens matched inside the remaining pieces."""

    def __init__(self, raw: _AddedTokenMatcher, normalized: _AddedTokenMatcher) -> None:
        self._raw = raw
        self._normalized = normalized

    def split(self, text: str) -> list[tuple[str, int | None]]:
        parts: list[tuple[str, int | None]] = []
        for piece, tid in self._raw.split(text):
            if tid is None:
                parts.extend(self._normalized.split(piece))
            else:
                parts.append((piece, tid))
        return parts


def _trivial_normalizer(described: dict[str, Any]) -> bool:
    """The tokenizer (its ``tokenizer.json``) changes no text before pre-tokenizing."""
    normalizer = described.get("normalizer")
    return normalizer is None or (
        normalizer.get("type") == "Sequence" and not normalizer.get("normalizers"))


def _splitter(tokenizer: Tokenizer, described: dict[str, Any]) -> _Splitter | None:
    """The tokenizer's added-token splitting (``described``: its ``tokenizer.json``), or
    ``None`` when its matching rules cannot be reproduced exactly (then every call encodes
    the whole text)."""
    trivial_normalizer = _trivial_normalizer(described)
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
    return _Splitter(_AddedTokenMatcher(raw), _AddedTokenMatcher(normalized))


def _chunkable(described: dict[str, Any]) -> bool:
    """Whether the tokenizer (its ``tokenizer.json``) pre-tokenizes like one of
    :data:`CHUNKED_PRE_TOKENIZERS`."""
    if not _trivial_normalizer(described):
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


def _affixes(tokenizer: Tokenizer) -> tuple[list[int], list[int]]:
    """Ids the post-processor adds before and after a single sequence."""
    plain = tokenizer.encode("a", add_special_tokens=False).ids
    full = tokenizer.encode("a", add_special_tokens=True).ids
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return full[:start], full[start + len(plain) :]
    raise ValueError("cannot locate the sequence inside the post-processed encoding")


class PromptTokenizer:
    """A model's chat template and tokenizer with a segment cache in front.

    :meth:`encode` returns exactly what ``ChatTokenizer.encode`` returns (the sim's and the
    engine's tokenization), only faster on repeated segments.
    Synchronous and CPU-bound (1-6 µs per uncached token); safe to call from several threads.
    ``observer(hits, misses)``, when set, receives each call's segment-cache outcome.
    """

    observer: Callable[[int, int], None] | None = None

    def __init__(self, chat: ChatTokenizer, cache_tokens: int = 1_000_000,
                 chunk_chars: int = 512) -> None:
        self.chat = chat
        self.cache = SegmentCache(cache_tokens)
        self._tok = chat.tokenizer
        described = json.loads(chat.tokenizer.to_str()) if cache_tokens > 0 else {}
        self._splitter = _splitter(chat.tokenizer, described) if cache_tokens > 0 else None
        self.segmented = self._splitter is not None
        # 0: pieces are cached whole (the tokenizer is not known to allow cuts)
        self.chunk_chars = chunk_chars if self.segmented and _chunkable(described) else 0
        self._prefix, self._suffix = _affixes(chat.tokenizer)

    def fork(self) -> PromptTokenizer:
        """The same tokenizer and rules with an empty cache of the same size (cheap)."""
        twin = copy.copy(self)
        twin.cache = SegmentCache(self.cache.max_tokens)
        return twin

    @classmethod
    def load(
        cls,
        tokenizer: Path | None = None,
        chat_template: Path | None = None,
        cache_tokens: int = 1_000_000,
    ) -> PromptTokenizer:
        """Load like the engine/sim does; ``None`` paths = the shared defaults.

        Loading parses a large ``tokenizer.json`` (~0.5 s): the parsed tokenizer is kept per
        process and shared; each call gets its own segment cache."""
        return _loaded(tokenizer, chat_template, cache_tokens).fork()

    def render(self, args: RenderArgs) -> str:
        """The chat prompt text; raises :class:`cortex.chat.ChatError` (a client error)."""
        return self.chat.render(args)

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """Ids of ``text`` (a rendered chat prompt, or a plain prompt); ``add_special_tokens``
        as the engine decided it (:class:`~cortex.chat.RenderArgs`)."""
        return self._encode(text, add_special=add_special_tokens)

    def encode_text(self, text: str) -> list[int]:
        """Ids of a plain completion prompt (the tokenizer's special tokens added)."""
        return self._encode(text, add_special=True)

    def _encode(self, text: str, add_special: bool) -> list[int]:
        return self.plan(text, add_special).finish()

    def plan(self, text: str, add_special_tokens: bool) -> EncodePlan:
        """``text`` split and looked up in the segment cache; :meth:`EncodePlan.finish`
        encodes what is missing (``missing_chars`` of it: the caller decides where)."""
        if self._splitter is None:
            return EncodePlan(self, [text], [], len(text), 0, whole=add_special_tokens)
        parts: list[int | list[int] | str] = list(self._prefix) if add_special_tokens else []
        keys: list[tuple[str, bool]] = []
        first = True
        hits = missing = 0
        cache = self.cache
        for piece, token_id in self._splitter.split(text):
            if token_id is not None:
                parts.append(token_id)
                first = False
                continue
            for chunk in self._chunks(piece):
                key = (chunk, first)
                cached = cache.get(key)
                if cached is None:
                    parts.append(chunk)
                    keys.append(key)
                    missing += len(chunk)
                else:
                    hits += 1
                    parts.append(cached)
                first = False
        if add_special_tokens:
            parts.extend(self._suffix)
        return EncodePlan(self, parts, keys, missing, hits)

    def _chunks(self, piece: str) -> list[str]:
        """``piece`` cut at the first allowed space ``chunk_chars`` or more characters into
        each chunk (the whole piece when chunking is off or it is short)."""
        size = self.chunk_chars
        if not size or len(piece) <= size:
            return [piece]
        chunks: list[str] = []
        start = 0
        search = _CUT.search
        while (cut := search(piece, start + size)) is not None:
            chunks.append(piece[start:cut.start()])
            start = cut.start()
        chunks.append(piece[start:])
        return chunks

    def _ids(self, text: str, add_special: bool) -> list[int]:
        # encode_batch releases the GIL while it works (encode does not), so a long prompt
        # encoded on a worker thread leaves the event loop running
        ids: list[int] = self._tok.encode_batch([text], add_special_tokens=add_special)[0].ids
        return ids

    def __repr__(self) -> str:
        return f"PromptTokenizer({self.chat!r}, segmented={self.segmented}, {self.cache!r})"


class EncodePlan:
    """A prompt's pieces: token ids, cached pieces' ids, and texts still to encode."""

    __slots__ = ("_hits", "_keys", "_parts", "_tokenizer", "_whole", "missing_chars")

    def __init__(self, tokenizer: PromptTokenizer, parts: list[int | list[int] | str],
                 keys: list[tuple[str, bool]], missing_chars: int, hits: int, *,
                 whole: bool | None = None) -> None:
        self._tokenizer = tokenizer
        self._parts = parts  # strings are the cache misses, in the order of ``keys``
        self._keys = keys
        self._hits = hits
        self._whole = whole  # not segmented: one text, encoded with these special tokens
        self.missing_chars = missing_chars

    def finish(self) -> list[int]:
        """The ids (CPU-bound for ``missing_chars``; safe on a worker thread)."""
        tok = self._tokenizer
        if self._whole is not None:
            text, = self._parts
            assert isinstance(text, str)
            return tok._ids(text, self._whole)
        out: list[int] = []
        keys = iter(self._keys)
        for part in self._parts:
            if isinstance(part, int):
                out.append(part)
            elif isinstance(part, str):
                ids = tok._ids(part, False)
                tok.cache.put(next(keys), ids)
                out.extend(ids)
            else:
                out.extend(part)
        if tok.observer is not None:
            tok.observer(self._hits, len(self._keys))
        return out


@functools.lru_cache(maxsize=8)
def _loaded(tokenizer: Path | None, chat_template: Path | None, cache_tokens: int
            ) -> PromptTokenizer:
    return PromptTokenizer(ChatTokenizer.load(tokenizer, chat_template), cache_tokens)
