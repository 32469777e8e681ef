"""Prompt text → the exact token ids the engine will see, cached by segment (pure core).

Rendering and the engine's tokenization rules come from :mod:`cortex.chat` (the one shared
definition the simulated engine uses too): the gateway imports them, it does not restate them.
The segment rules (below) say where a tokenizer provably encodes text piece by piece;
:class:`PromptTokenizer` splits a prompt there, serves the pieces it has seen from the
model's :class:`SegmentCache` and leaves the rest in an
:class:`EncodePlan`, which the caller finishes inline or hands to worker threads
(:mod:`cortex.gateway.tokens.parallel`): the result is identical either way, and identical to
``ChatTokenizer.encode_prompt`` (property-tested).

A long system prompt or an earlier turn of a conversation is one piece between the
template's special tokens (or a few chunks of one), so it is encoded once and then served
from the cache; the answers the gateway relays are encoded into the cache after the
response (:mod:`cortex.gateway.tokens.answers`), so the next turn's resent history hits too.

Where a tokenizer provably encodes text piece by piece (pure rules, checked at load time).
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

The segment cache: prompt pieces already encoded, bounded by tokens and by bytes.
One per served model, shared by every path that tokenizes for it (routing, answer feeding,
``/tokenize``) and by the threads that encode off the event loop. Ids are kept as packed
``uint32`` arrays (4 bytes per token instead of a list's 36).

The walk: ledger-guided lazy tokenization, encoding a prompt only as far as the cache match
can reach.

The ledger can only match a prefix some worker holds: past the first full block that no worker
holds, every further token changes nothing about the match. :func:`walk` therefore takes a
prompt's :class:`EncodePlan` (its parts, split at the provably safe cuts above, cached pieces
already filled in) and goes front to back: each part's ids are exact on their own, so after
each part the ids so far are an exact prefix of the whole prompt's. As parts complete full
blocks their keys are chained on, and ``deepest(keys)`` (the longest leading run of ``keys``
any worker holds, in the ledger or predicted) says whether the match can still grow; the walk
stops at the first full block nobody holds. The match of that prefix equals the match of the
whole query (a worker's leading run cannot pass a block it does not hold), which
``tests/gateway/tokens/test_prompt_walk.py`` checks differentially on random workloads.

What the decision used the whole token count for is then estimated or bounded:

- the prompt's length (the load term's uncached tokens, the placement's held prefill
  tokens): encoded tokens plus the rest's UTF-8 bytes over a per-model bytes-per-token ratio
  learned online (:class:`BytesPerToken`);
- the context-length check: every token of an encoded piece covers at least one byte except
  the post-processor's added ids and a prefix space a pre-tokenizer may add per piece, so
  :meth:`Walk.max_tokens` bounds the length from above and a prompt under the limit by that
  bound is safe without encoding it (one that is not is encoded fully).

What needs the whole ids is not lazy (the router encodes fully first, see docs/gateway.md):
PD (the prefill/decode split and sequence counts read the exact length), workers with
lookahead keys (a block's key needs the tokens after it) and a ledger read over gRPC.
``/admin/explain`` decides on the walk, then finishes it to report the exact length and
keys; the predicted-block credit of a recorded decision covers the walked blocks until
:meth:`Walk.finish` has run off the request path, then every block.
"""

from __future__ import annotations

import copy
import functools
import json
import re
import sys
import threading
from array import array
from collections import Counter, OrderedDict
from collections.abc import Callable, Container, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from cortex.chat import ChatPrompt, ChatTokenizer, Encoder, EncoderChoice, RenderArgs
from cortex.hashing import block_keys

__all__ = [
    "CHUNKED_PRE_TOKENIZERS",
    "BytesPerToken",
    "CacheStats",
    "EncodePlan",
    "Encoded",
    "Head",
    "PrefixMemo",
    "PromptTokenizer",
    "SegmentCache",
    "SegmentKey",
    "Splitter",
    "Walk",
    "affixes",
    "chunkable",
    "chunks",
    "cut_tokens",
    "held_prefix",
    "keys_past",
    "splitter",
    "walk",
]


# ---- segments ----


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

    def split(self, text: str, ends: dict[int, int] | None = None, offset: int = 0
              ) -> list[Part]:
        """``text`` as ``(piece, None)`` and ``(content, id)`` parts, in order; ``ends``
        (when given) gets each token part's index -> its end in ``text`` (+ ``offset``),
        whitespace it absorbed included."""
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
            if ends is not None:
                ends[len(parts) - 1] = offset + end
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

    def split(self, text: str, ends: dict[int, int] | None = None) -> list[Part]:
        """``text`` split; ``ends`` (when given) gets each token part's index -> its end
        in ``text``."""
        parts: list[Part] = []
        if ends is None:
            for piece, tid in self._raw.split(text):
                if tid is None:
                    parts.extend(self._normalized.split(piece))
                else:
                    parts.append((piece, tid))
            return parts
        raw_ends: dict[int, int] = {}
        start = 0  # where the current raw piece starts
        for i, (piece, tid) in enumerate(self._raw.split(text, raw_ends)):
            if tid is None:
                inner: dict[int, int] = {}
                base = len(parts)
                parts.extend(self._normalized.split(piece, inner, start))
                for k, end in inner.items():
                    ends[base + k] = end
            else:
                start = ends[len(parts)] = raw_ends[i]
                parts.append((piece, tid))
        return parts

    def tokens(self) -> dict[str, bool]:
        """Every added token of both passes -> its ``rstrip``."""
        return {content: rstrip for matcher in (self._raw, self._normalized)
                for content, (_, _, rstrip) in matcher.tokens.items()}


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


# ---- cache ----


SegmentKey = tuple[str, bool]
"""A piece of prompt text and whether it starts the text (offset 0 can encode differently)."""

_ENTRY_BYTES = 200
"""Bookkeeping per entry beyond its text and ids (dict slot, key tuple, array header)."""


@dataclass(slots=True)
class CacheStats:
    """Lifetime counters: pieces and tokens served from the cache (hits) or encoded
    (misses), entries evicted."""

    hits: int = 0
    misses: int = 0
    hit_tokens: int = 0
    miss_tokens: int = 0
    evictions: int = 0

    @property
    def token_hit_rate(self) -> float:
        """Share of looked-up tokens served from the cache (0 before any lookup)."""
        total = self.hit_tokens + self.miss_tokens
        return self.hit_tokens / total if total else 0.0


class SegmentCache:
    """LRU of :data:`SegmentKey` → token ids, holding at most ``max_tokens`` tokens and
    about ``max_bytes`` bytes (text, packed ids and bookkeeping). Thread-safe."""

    def __init__(self, max_tokens: int, max_bytes: int = 1 << 62) -> None:
        self.max_tokens = max_tokens
        self.max_bytes = max_bytes
        self.tokens = 0
        self.bytes = 0
        self.stats = CacheStats()
        self._entries: OrderedDict[SegmentKey, array[int]] = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def cost(key: SegmentKey, tokens: int) -> int:
        """Bytes an entry of ``tokens`` ids for ``key`` is charged."""
        return sys.getsizeof(key[0]) + 4 * tokens + _ENTRY_BYTES

    def lookup(self, keys: list[SegmentKey]) -> list[array[int] | None]:
        """The cached ids of each key (``None``: not cached), refreshing the hits."""
        out: list[array[int] | None] = []
        with self._lock:
            entries = self._entries
            get = entries.get
            refresh = entries.move_to_end
            stats = self.stats
            for key in keys:
                ids = get(key)
                if ids is None:
                    stats.misses += 1
                else:
                    refresh(key)
                    stats.hits += 1
                    stats.hit_tokens += len(ids)
                out.append(ids)
        return out

    def get(self, key: SegmentKey) -> array[int] | None:
        return self.lookup([key])[0]

    def put_many(self, items: list[tuple[SegmentKey, list[int]]]) -> None:
        """Store freshly encoded pieces (counted as missed tokens), evicting the least
        recently used entries beyond the bounds."""
        with self._lock:
            entries = self._entries
            stats = self.stats
            for key, ids in items:
                stats.miss_tokens += len(ids)
                cost = self.cost(key, len(ids))
                if len(ids) > self.max_tokens or cost > self.max_bytes or key in entries:
                    continue
                entries[key] = array("I", ids)
                self.tokens += len(ids)
                self.bytes += cost
            while self.tokens > self.max_tokens or self.bytes > self.max_bytes:
                old_key, old = entries.popitem(last=False)
                self.tokens -= len(old)
                self.bytes -= self.cost(old_key, len(old))
                stats.evictions += 1

    def put(self, key: SegmentKey, ids: list[int]) -> None:
        self.put_many([(key, ids)])

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return (f"SegmentCache(segments={len(self._entries)}, tokens={self.tokens}/"
                f"{self.max_tokens}, bytes={self.bytes}/{self.max_bytes}, "
                f"hits={self.stats.hits}, misses={self.stats.misses})")


# ---- prompt ----


DEFAULT_CACHE_BYTES = 256 * 1024 * 1024
DEFAULT_HEAD_BYTES = 64 * 1024 * 1024
"""Bound of a model's :class:`~PrefixMemo` (heads of recently
routed prompts: ~8 bytes per token, so ~8M tokens)."""


class PromptTokenizer:
    """A model's chat template and tokenizer with a segment cache in front.

    :meth:`encode_prompt` returns exactly what ``ChatTokenizer.encode_prompt`` returns (the
    sim's and the engine's tokenization), only faster on repeated segments. Synchronous and
    CPU-bound (1-6 µs per uncached token); safe to call from several threads.
    ``observer(hit_pieces, missed_pieces)`` and ``token_observer(hit_tokens,
    missed_tokens)``, when set, receive each finished plan's cache outcome.
    """

    observer: Callable[[int, int], None] | None = None
    token_observer: Callable[[int, int], None] | None = None

    def __init__(self, chat: ChatTokenizer, cache_tokens: int = 1_000_000,
                 chunk_chars: int = 512, cache_bytes: int = DEFAULT_CACHE_BYTES,
                 head_bytes: int = DEFAULT_HEAD_BYTES) -> None:
        self.chat = chat
        self.cache = SegmentCache(cache_tokens, cache_bytes)
        assert chat.encoder is not None
        self.encoder = chat.encoder
        described = json.loads(chat.tokenizer.to_str()) if cache_tokens > 0 else {}
        self._splitter = splitter(chat.tokenizer, described) if cache_tokens > 0 else None
        self.segmented = self._splitter is not None
        # heads of recent prompts (a resent history is not split again); none unsegmented
        self.heads = (PrefixMemo(cut_tokens(self._splitter.tokens()), head_bytes)
                      if self._splitter is not None and head_bytes > 0 else None)
        # 0: pieces are cached whole (the tokenizer is not known to allow cuts)
        self.chunk_chars = chunk_chars if self.segmented and chunkable(described) else 0
        self._prefix, self._suffix = affixes(chat.tokenizer)
        self._bos = chat.bos_token_id

    def fork(self, cache_tokens: int | None = None, cache_bytes: int | None = None
             ) -> PromptTokenizer:
        """The same tokenizer and rules with an empty cache (cheap); its bounds default to
        this one's."""
        twin = copy.copy(self)
        twin.cache = SegmentCache(self.cache.max_tokens if cache_tokens is None else cache_tokens,
                                  self.cache.max_bytes if cache_bytes is None else cache_bytes)
        if self.heads is not None:
            twin.heads = PrefixMemo(self.heads.cuts, self.heads.max_bytes, self.heads.scan)
        twin.observer = twin.token_observer = None
        return twin

    @classmethod
    def load(
        cls,
        tokenizer: Path | None = None,
        chat_template: Path | None = None,
        cache_tokens: int = 1_000_000,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        encoder: EncoderChoice = EncoderChoice.HF,
    ) -> PromptTokenizer:
        """Load like the engine/sim does; ``None`` paths = the shared defaults; ``encoder``:
        see ``ChatTokenizer.load`` (raises ``ValueError`` when ``fastokens`` is demanded and
        not exact).

        Loading parses a large ``tokenizer.json`` (~0.5 s; the encoder probe 1-5 s more): the
        parsed tokenizer is kept per process and shared; each call gets its own segment
        cache."""
        loaded = _loaded(tokenizer, chat_template, cache_tokens > 0, EncoderChoice(encoder))
        return loaded.fork(cache_tokens, cache_bytes)

    def use_encoder(self, encoder: Encoder) -> None:
        """Encode with ``encoder`` from now on (one that gives the same ids: a probed one);
        encodes running on other threads finish with the previous one."""
        self.chat = self.chat.with_encoder(encoder)
        self.encoder = encoder

    # -- rendering --------------------------------------------------------------------------

    def prompt(self, args: RenderArgs) -> ChatPrompt:
        """What the engine tokenizes for a chat request; raises
        :class:`cortex.chat.ChatError` (a client error)."""
        return self.chat.prompt(args)

    def render(self, args: RenderArgs) -> str:
        """The whole chat prompt text (see ``ChatTokenizer.render``)."""
        return self.chat.render(args)

    # -- encoding ---------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """Ids of ``text`` (a rendered chat prompt, or a plain prompt)."""
        return self.plan(text, add_special_tokens).finish().tolist()

    def encode_prompt(self, prompt: ChatPrompt) -> list[int]:
        """Ids of a rendered chat prompt, assembled the engine's way."""
        return self.plan_prompt(prompt).finish().tolist()

    def encode_text(self, text: str) -> list[int]:
        """Ids of a plain completion prompt (the tokenizer's special tokens added)."""
        return self.plan(text, add_special_tokens=True).finish().tolist()

    def encode_pieces(self, texts: Sequence[tuple[str, bool]]) -> list[list[int]]:
        """Ids of each ``(text, add_special_tokens)`` with the model's encoder, one at a
        time (``Encoder.encode_each``), so parallelism is the caller's."""
        return self.encoder.encode_each(texts)

    def plan_prompt(self, prompt: ChatPrompt) -> EncodePlan:
        """The plan of a chat prompt: its text, then SGLang's continued prefix encoded on
        its own with the special tokens, a leading BOS dropped."""
        plan = self.plan(prompt.text, prompt.add_special_tokens)
        if not prompt.suffix:
            return plan
        if self._splitter is None:
            plan.parts.append(self.chat.encode_suffix(prompt.suffix))
            return plan
        tail = self.plan(prompt.suffix, add_special_tokens=True)
        if tail.parts and tail.parts[0] == self._bos:
            del tail.parts[0]
        return plan.extend(tail)

    def plan(self, text: str, add_special_tokens: bool) -> EncodePlan:
        """``text`` split and looked up in the segment cache; :meth:`EncodePlan.finish`
        encodes what is missing (``missing_chars`` of it: the caller decides where). A
        remembered head of ``text`` (:attr:`heads`) is one part: only the rest is split."""
        if self._splitter is None:
            return EncodePlan(self, [text], [(text, add_special_tokens)], [None])
        heads = self.heads
        head = heads.find(text, add_special_tokens) if heads is not None else None
        parts: list[int | Sequence[int] | str]
        if head is not None:
            parts, start = [head.ids], len(head.text)
        else:
            parts, start = list(self._prefix) if add_special_tokens else [], 0
        keys: list[SegmentKey] = []
        slots: list[int] = []  # where each looked-up piece goes in ``parts``
        first = start == 0
        size = self.chunk_chars
        ends: dict[int, int] | None = {} if heads is not None else None
        cut = cut_end = -1  # the last cut token's part and its end in ``text``
        cuts = heads.cuts if heads is not None else frozenset()
        for i, (piece, token_id) in enumerate(self._splitter.split(
                text[start:] if start else text, ends)):
            if token_id is not None:
                if ends is not None and piece in cuts:
                    cut, cut_end = len(parts), start + ends[i]
                parts.append(token_id)
                first = False
                continue
            for chunk in chunks(piece, size):
                keys.append((chunk, first))
                slots.append(len(parts))
                parts.append(chunk)
                first = False
        if add_special_tokens:
            parts.extend(self._suffix)
        missing: list[tuple[str, bool]] = []
        miss_keys: list[SegmentKey | None] = []
        hits = 0
        for key, slot, ids in zip(keys, slots, self.cache.lookup(keys), strict=True):
            if ids is None:
                missing.append((key[0], False))
                miss_keys.append(key)
            else:
                parts[slot] = ids
                hits += 1
        plan = EncodePlan(self, parts, missing, miss_keys, hits)
        plan.used = head
        if cut >= 0:
            plan.head = (text[:cut_end], add_special_tokens, cut)
        return plan


class EncodePlan:
    """A prompt's parts: token ids, cached pieces' ids, and texts still to encode
    (``missing``, in order: the ``str`` parts). ``remember``: :meth:`finish` keeps the
    prompt's head (a routed prompt's; not an answer fed to the cache, whose head would
    displace the routed one's, which carries its keys) as :attr:`remembered`."""

    __slots__ = ("_tokenizer", "head", "hits", "keys", "missing", "missing_chars", "parts",
                 "remember", "remembered", "used")

    def __init__(self, tokenizer: PromptTokenizer, parts: list[int | Sequence[int] | str],
                 missing: list[tuple[str, bool]], keys: list[SegmentKey | None],
                 hits: int = 0) -> None:
        self._tokenizer = tokenizer
        self.parts = parts
        self.missing = missing  # (text, add_special_tokens) of each str part, in order
        self.keys = keys  # their cache keys (None: not cached)
        self.hits = hits
        self.missing_chars = sum(len(text) for text, _ in missing)
        # a head to remember once its ids are known: its text, add_special_tokens and its
        # last part (a cut token's id); None: none
        self.head: tuple[str, bool, int] | None = None
        self.used: Head | None = None  # the remembered head ``parts[0]`` holds the ids of
        self.remember = False
        self.remembered: Head | None = None

    def extend(self, other: EncodePlan) -> EncodePlan:
        """This plan followed by ``other`` (of the same tokenizer)."""
        self.parts.extend(other.parts)
        self.missing.extend(other.missing)
        self.keys.extend(other.keys)
        self.hits += other.hits
        self.missing_chars += other.missing_chars
        return self

    def finish(self, encoded: Sequence[Sequence[int]] | None = None) -> array[int]:
        """The ids, packed (a cached piece's are copied, never made Python ints).
        ``encoded``: the ids of :attr:`missing`, in order, when the caller encoded them
        (elsewhere); else they are encoded here (CPU-bound for ``missing_chars``; safe on a
        worker thread). Fresh pieces go into the cache."""
        tok = self._tokenizer
        if encoded is None:
            encoded = tok.encode_pieces(self.missing) if self.missing else []
        out: array[int] = array("I")
        fresh = iter(encoded)
        hit_tokens = 0
        head = self.head if self.remember and tok.heads is not None else None
        last, head_ids = (head[2] if head is not None else -1), 0
        for i, part in enumerate(self.parts):
            if isinstance(part, int):
                out.append(part)
            elif isinstance(part, str):
                out.extend(next(fresh))
            else:
                if isinstance(part, array):
                    hit_tokens += len(part)
                out.extend(part)
            if i == last:
                head_ids = len(out)
        stored = [(key, list(ids)) for key, ids in zip(self.keys, encoded, strict=True)
                  if key is not None]
        if stored:
            tok.cache.put_many(stored)
        if tok.observer is not None:
            tok.observer(self.hits, len(self.missing))
        if tok.token_observer is not None:
            tok.token_observer(hit_tokens, sum(len(ids) for ids in encoded))
        if head is not None and tok.heads is not None:
            self.remembered = tok.heads.remember(head[0], head[1], out[:head_ids])
            self.head = None
        return out

    def __repr__(self) -> str:
        return (f"EncodePlan(parts={len(self.parts)}, hits={self.hits}, "
                f"missing={len(self.missing)}, missing_chars={self.missing_chars})")


@functools.lru_cache(maxsize=8)
def _loaded(tokenizer: Path | None, chat_template: Path | None, segmented: bool,
            encoder: EncoderChoice) -> PromptTokenizer:
    return PromptTokenizer(ChatTokenizer.load(tokenizer, chat_template, encoder),
                           1_000_000 if segmented else 0)


# ---- the walk ----

MIN_NEW_BLOCKS = 4
"""New full blocks the walk collects before it asks the ledger again (at least). A walk that
stops has at least this many keys: routing's tie key (its ``TIE_BLOCKS``-th block, 4) is
then the same as with the whole prompt."""

Deepest = Callable[[list[int]], int]
"""Leading blocks of ``keys`` the best-placed worker holds (0..len(keys))."""


def keys_past(keys: Sequence[int], ids: Sequence[int], block_size: int, root: int,
              blocks: int | None = None) -> list[int]:
    """The keys of the full blocks of ``ids`` past the ``len(keys)`` already keyed (up to
    ``blocks`` blocks in all; default: every full block), chained on from the last of
    ``keys`` (``root`` when there is none)."""
    end = len(ids) if blocks is None else blocks * block_size
    return block_keys(ids[len(keys) * block_size:end], block_size, keys[-1] if keys else root)


def held_prefix(keys: Sequence[int], held: Container[int]) -> int:
    """Leading ``keys`` in ``held`` (one holder's :data:`Deepest`, for an in-memory set)."""
    count = 0
    for key in keys:
        if key not in held:
            break
        count += 1
    return count


class BytesPerToken:
    """A model's UTF-8 bytes per token, learned from what was encoded (an exponentially
    weighted mean over the last ~``window`` tokens; ``initial`` until then)."""

    def __init__(self, initial: float = 4.0, window: int = 200_000) -> None:
        self.ratio = initial
        self.window = window
        self.tokens = 0  # observed so far (saturates the weight at window)

    def observe(self, nbytes: int, tokens: int) -> None:
        if tokens <= 0:
            return
        weight = tokens / min(self.window, self.tokens + tokens)
        self.ratio += weight * (nbytes / tokens - self.ratio)
        self.tokens = min(self.window, self.tokens + tokens)

    def tokens_of(self, nbytes: int) -> int:
        """Estimated tokens of ``nbytes`` of text not encoded yet."""
        return round(nbytes / self.ratio) if nbytes else 0

    def __repr__(self) -> str:
        return f"BytesPerToken({self.ratio:.2f}, observed={self.tokens})"


@dataclass(slots=True)
class Walk:
    """A prompt encoded front to back as far as the match can reach.

    ``ids``: the exact leading ids (all of them when ``complete``), packed: a remembered
    head's ids are copied in, not turned into a Python int each; ``keys``: the plain keys
    of their full blocks; ``deepest``: leading blocks the best-placed worker holds, as of
    the walk's last question (the match cannot exceed it; a walk that completes does not
    ask again at its end: the router asks the ledger next). ``rest_bytes`` /
    ``rest_pieces``: UTF-8 bytes and text pieces not encoded yet."""

    ids: array[int]
    keys: list[int]
    deepest: int
    complete: bool
    rest_bytes: int
    rest_pieces: int
    _plan: EncodePlan = field(repr=False)
    _root: int = field(default=0, repr=False)  # the chain root of ``keys``
    _block_size: int = field(default=1, repr=False)
    _next: int = field(default=0, repr=False)  # the first part not taken yet
    _piece: int = field(default=0, repr=False)  # the first missing piece not encoded yet
    _fresh: list[tuple[SegmentKey, list[int]]] = field(default_factory=list, repr=False)
    _head_ids: int = field(default=-1, repr=False)  # ids up to the plan's head (-1: not yet)

    def estimated_tokens(self, ratio: BytesPerToken) -> int:
        """The whole prompt's length: exact when complete, else the encoded ids plus the
        rest's estimate."""
        return len(self.ids) + self._known_rest() + ratio.tokens_of(self.rest_bytes)

    def max_tokens(self) -> int:
        """An upper bound of the whole prompt's length (see the module)."""
        return len(self.ids) + self._known_rest() + self.rest_bytes + self.rest_pieces

    def _known_rest(self) -> int:
        """Ids of the parts not taken whose ids are known (added tokens, cached pieces)."""
        return sum(1 if isinstance(p, int) else 0 if isinstance(p, str) else len(p)
                   for p in self._plan.parts[self._next:])

    def finish(self, tokenizer: PromptTokenizer, *, keyed: bool = False) -> array[int]:
        """Encode the rest (CPU-bound; safe on a worker thread): the whole ids, which equal
        ``plan.finish()``'s; fresh pieces go into the segment cache. ``keyed``: ``keys`` then
        go on to every full block (a new list; only where no other thread holds the walk);
        else they stay as the walk left them (a router may hold that list meanwhile)."""
        if not self.complete:
            _take(self, tokenizer, len(self._plan.parts))
            self.complete = True
            self.rest_bytes = self.rest_pieces = 0
        if self._fresh:
            tokenizer.cache.put_many(self._fresh)
            self._fresh = []
        if keyed:
            self.keys = self._chained(len(self.ids) // self._block_size)
        head = self._plan.head
        if head is not None and self._head_ids >= 0 and tokenizer.heads is not None:
            # the head's keys go with it: the next turn, which starts with this head, then
            # hashes none of it again
            chain = {(self._root, self._block_size):
                     self._chained(self._head_ids // self._block_size)}
            tokenizer.heads.remember(head[0], head[1], self.ids[:self._head_ids], chain)
            self._plan.head = None
        return self.ids

    def _chained(self, blocks: int) -> list[int]:
        """The keys of the first ``blocks`` full blocks of ``ids`` (a new list): those the
        walk keyed, then the rest chained on from them."""
        keys = self.keys
        if len(keys) >= blocks:
            return keys[:blocks]
        return keys + keys_past(keys, self.ids, self._block_size, self._root, blocks)


def _take(w: Walk, tokenizer: PromptTokenizer, stop: int) -> int:
    """Append parts ``w._next`` .. ``stop`` - 1 to ``w.ids``; the UTF-8 bytes encoded."""
    head = w._plan.head
    last = head[2] if head is not None else -1
    if w._next <= last < stop - 1:  # the head's ids are known once its last part is taken
        encoded = _take_parts(w, tokenizer, last + 1)
        w._head_ids = len(w.ids)
        return encoded + _take_parts(w, tokenizer, stop)
    encoded = _take_parts(w, tokenizer, stop)
    if last == stop - 1:
        w._head_ids = len(w.ids)
    return encoded


def _take_parts(w: Walk, tokenizer: PromptTokenizer, stop: int) -> int:
    plan = w._plan
    parts = plan.parts
    encoded = 0
    missing = plan.missing
    index = w._piece
    for part in parts[w._next:stop]:
        if isinstance(part, int):
            w.ids.append(part)
        elif isinstance(part, str):
            ids = tokenizer.encode_pieces([missing[index]])[0]
            key = plan.keys[index]
            if key is not None:
                w._fresh.append((key, ids))
            size = len(part.encode("utf-8", "surrogatepass"))
            encoded += size
            w.rest_bytes -= size
            w.rest_pieces -= 1
            index += 1
            w.ids.extend(ids)
        else:
            w.ids.extend(part)
    w._next = stop
    w._piece = index
    return encoded


def _more(parts: Sequence[int | Sequence[int] | str], start: int) -> bool:
    """Whether ``parts[start:]`` yield at least one id (so the prompt goes on past the ids
    so far and their last full block is in the match query)."""
    return any(isinstance(p, int) or len(p) for p in parts[start:])


def walk(tokenizer: PromptTokenizer, plan: EncodePlan, root: int, block_size: int,
         deepest: Deepest, ratio: BytesPerToken | None = None) -> Walk:
    """Encode ``plan`` (of ``tokenizer``) part by part until the match cannot grow: stop
    after the part that completes a full block ``deepest`` says nobody holds (``root``: the
    chain root of the request's plain keys). ``ratio`` learns from the pieces encoded."""
    parts: Sequence[int | Sequence[int] | str] = plan.parts
    w = Walk(array("I"), [], 0, False, sum(len(p.encode("utf-8", "surrogatepass"))
                                           for p in parts if isinstance(p, str)),
             sum(isinstance(p, str) for p in parts), plan, root, block_size)
    for i in range(len(parts)):
        before = len(w.ids)
        encoded = _take(w, tokenizer, i + 1)
        if ratio is not None and encoded:
            ratio.observe(encoded, len(w.ids) - before)
        full = len(w.ids) // block_size
        # ask the ledger only before text must be encoded (parts whose ids are known cost
        # nothing to take), and once the new blocks are a fair share of the known ones:
        # keying and asking after every part would cost more than it saves (the walk
        # overshoots the stop by at most an eighth plus a few blocks)
        if (i + 1 < len(parts) and isinstance(parts[i + 1], str)
                and full - len(w.keys) >= max(MIN_NEW_BLOCKS, len(w.keys) // 8)):
            _chain(w, full)
            w.deepest = deepest(w.keys)
            if w.deepest < len(w.keys) and _more(parts, i + 1):
                return w  # block ``deepest`` is held by no one: the match stops there
    full = len(w.ids) // block_size
    if full > len(w.keys):
        _chain(w, full)
    w.complete = True
    return w


def _chain(w: Walk, full: int) -> None:
    """Key ``w``'s blocks up to ``full``: a remembered head's keys come from the head."""
    head, size = w._plan.used, w._block_size
    if not w.keys and head is not None:  # the head is part 0: its ids were taken first
        w.keys = list(head.chain(w._root, size))
    if full > len(w.keys):
        w.keys += keys_past(w.keys, w.ids, size, w._root, full)


# ---- the heads of recent prompts ------------------------------------------------------
# The exact ids of recent prompts' heads, so that a resent history is not split again (pure core).
#
# An agent resends its whole conversation on every turn: the rendered prompt of turn n + 1
# starts with the rendered prompt of turn n. The segment cache already spares encoding that
# history, but splitting it on added tokens, cutting it into chunks, looking every chunk up
# and assembling the ids again costs time linear in the whole prompt on every turn.
# :class:`PrefixMemo` keeps, for recently routed prompts, a *head*: the prompt's text up to
# the end of its last *cut token*, with the exact ids of that text. A new prompt that starts
# with a remembered head reuses its ids and splits only the text after it.
#
# Why the ids of the head stay exact inside a longer text. The tokenizer splits a text on its
# added tokens leftmost-longest, then encodes each piece between them on its own
# (:mod:`cortex.gateway.tokens.prompt`). Let an added token ``t`` end at offset ``c`` of the
# split of a text. Appending text after ``c`` can change the split before ``c`` only through
# a match that crosses ``c``: one that starts at or before ``t`` and ends past ``c`` contains
# ``t``, one that starts inside ``t`` begins with a proper suffix of ``t``; and ``t`` itself
# could absorb the whitespace after it (``rstrip``). A *cut token* (:func:`cut_tokens`) is an
# added token that no other added token contains, whose proper suffixes start no added token,
# and that absorbs no whitespace after it: at its end the split of any continuation restarts,
# as if the text began there (a piece after it never starts the text). So the ids of a head
# are the same in every text that starts with it. ``tests/gateway/tokens/test_prefix.py``
# checks the ids of prompts planned with and without the memo on random edits.
#
# Finding the head of a new prompt costs no pass over it: heads are indexed by their length
# and their last characters, and the candidates are the positions of the cut tokens' last
# characters, scanned from the end (at most ``scan`` of them); a candidate is taken only when
# the whole head text matches (``str.startswith``).


TAIL_CHARS = 64
"""Characters before a head's end that index it (with its length)."""

_ENTRY_BYTES = 300
"""Bookkeeping per head beyond its text and ids (dict slots, key tuple, array header)."""


def cut_tokens(tokens: Mapping[str, bool]) -> frozenset[str]:
    """The added tokens after which a split restarts (see the module): ``tokens`` maps every
    added token's content to its ``rstrip``."""
    contents = [t for t in tokens if t]
    joined = "\x00".join(contents)  # no added token holds NUL
    starts = {u[:k] for u in contents for k in range(1, len(u) + 1)}
    out = set()
    for token in contents:
        if tokens[token] or "\x00" in token or joined.count(token) != 1:
            continue  # absorbs what follows, or inside another token (or itself twice)
        if any(token[i:] in starts for i in range(1, len(token))):
            continue  # a match starting inside it could run past its end
        out.add(token)
    return frozenset(out)


@dataclass(frozen=True, slots=True)
class Head:
    """A prompt's text up to the end of a cut token, and its exact ids (the
    post-processor's leading ids included when ``special``: ``add_special_tokens``)."""

    text: str
    special: bool
    ids: array[int]
    _chains: dict[tuple[int, int], list[int]] = field(default_factory=dict, compare=False,
                                                      repr=False)

    def chain(self, root: int, block_size: int) -> list[int]:
        """The keys of the head's full blocks chained from ``root`` (computed once, unless
        the walk that remembered the head or :meth:`keep_chain` gave them; do not modify
        the list)."""
        keys = self._chains.get((root, block_size))
        if keys is None:
            full = len(self.ids) // block_size * block_size
            keys = self._chains[root, block_size] = block_keys(self.ids[:full], block_size,
                                                               root)
        return keys

    def keep_chain(self, root: int, block_size: int, keys: list[int]) -> None:
        """Keep the head's keys from ``keys``, those of a prompt it begins (chained from
        ``root``), when not known yet."""
        if (root, block_size) not in self._chains:
            self._chains[root, block_size] = keys[:len(self.ids) // block_size]


class Encoded:
    """A whole prompt's ids, with the remembered heads that make its keys cheap: ``used``,
    the head the prompt begins with (its ids were copied in), and ``head``, the head
    remembered from this prompt (the next turn begins with it)."""

    __slots__ = ("head", "ids", "used")

    def __init__(self, ids: Sequence[int], used: Head | None = None, head: Head | None = None
                 ) -> None:
        self.ids = ids
        self.used = used
        self.head = head

    def chain(self, root: int, block_size: int) -> list[int]:
        """The keys of the prompt's full blocks chained from ``root``: the used head's,
        then those of the blocks past them (only the new part is hashed); the new head
        keeps its own."""
        known = self.used.chain(root, block_size) if self.used is not None else []
        keys = known + keys_past(known, self.ids, block_size, root)
        if self.head is not None:
            self.head.keep_chain(root, block_size, keys)
        return keys

    def __repr__(self) -> str:
        return f"Encoded(tokens={len(self.ids)}, used={self.used is not None})"


class PrefixMemo:
    """LRU of :class:`Head` s holding at most ``max_bytes`` (text, ids, bookkeeping);
    ``cuts``: the tokenizer's cut tokens. Thread-safe."""

    def __init__(self, cuts: Iterable[str], max_bytes: int, scan: int = 256) -> None:
        self.cuts = frozenset(cuts)
        self.max_bytes = max_bytes
        self.scan = scan
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self._lasts = sorted({t[-1] for t in self.cuts})
        self._heads: OrderedDict[tuple[int, bool, str], Head] = OrderedDict()
        self._lengths: Counter[int] = Counter()
        self._lock = threading.Lock()

    @staticmethod
    def _key(text: str, end: int, special: bool) -> tuple[int, bool, str]:
        return end, special, text[max(0, end - TAIL_CHARS):end]

    @staticmethod
    def cost(head: Head) -> int:
        """Bytes charged for ``head`` (its chains of keys, one or two per head, included)."""
        return 2 * len(head.text) + 4 * len(head.ids) + len(head.ids) // 2 + _ENTRY_BYTES

    def find(self, text: str, special: bool) -> Head | None:
        """The longest remembered head ``text`` starts with (planned with the same
        ``special``), found among the last ``scan`` candidate ends; ``None``: none."""
        if not self._heads:
            return None
        find = text.rfind
        upcoming = {last: find(last) for last in self._lasts}
        with self._lock:
            lengths = self._lengths
            for _ in range(self.scan):
                at = max(upcoming.values(), default=-1)
                if at < 0:
                    break
                end = at + 1
                if end in lengths:
                    head = self._heads.get(self._key(text, end, special))
                    if head is not None and text.startswith(head.text):
                        self._heads.move_to_end(self._key(text, end, special))
                        self.hits += 1
                        return head
                for last, position in upcoming.items():
                    if position == at:
                        upcoming[last] = find(last, 0, at)
            self.misses += 1
        return None

    def remember(self, text: str, special: bool, ids: Sequence[int],
                 chains: dict[tuple[int, int], list[int]] | None = None) -> Head | None:
        """Keep ``text`` (ending with a cut token) and its exact ``ids`` (a packed array is
        kept as it is: do not modify it); ``chains``: keys of its full blocks already known,
        by ``(root, block_size)`` (:meth:`Head.chain`). The head kept, or ``None`` (too
        large to keep)."""
        packed = ids if isinstance(ids, array) and ids.typecode == "I" else array("I", ids)
        head = Head(text, special, packed, chains or {})
        cost = self.cost(head)
        if cost > self.max_bytes:
            return None
        key = self._key(text, len(text), special)
        with self._lock:
            old = self._heads.pop(key, None)
            if old is not None:
                self._forget(old)
            self._heads[key] = head
            self._lengths[len(text)] += 1
            self.bytes += cost
            while self.bytes > self.max_bytes:
                _, evicted = self._heads.popitem(last=False)
                self._forget(evicted)
        return head

    def _forget(self, head: Head) -> None:
        self.bytes -= self.cost(head)
        end = len(head.text)
        self._lengths[end] -= 1
        if not self._lengths[end]:
            del self._lengths[end]

    def __len__(self) -> int:
        return len(self._heads)

    def __repr__(self) -> str:
        return (f"PrefixMemo(heads={len(self._heads)}, bytes={self.bytes}/{self.max_bytes}, "
                f"cuts={len(self.cuts)}, hits={self.hits}, misses={self.misses})")
