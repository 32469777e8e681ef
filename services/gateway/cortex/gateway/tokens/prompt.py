"""Prompt text → the exact token ids the engine will see, cached by segment (pure core).

Rendering and the engine's tokenization rules come from :mod:`cortex.chat` (the one shared
definition the simulated engine uses too): the gateway imports them, it does not restate them.
:mod:`cortex.gateway.tokens.segments` says where a tokenizer provably encodes text piece by piece;
:class:`PromptTokenizer` splits a prompt there, serves the pieces it has seen from the
model's :class:`~cortex.gateway.tokens.cache.SegmentCache` and leaves the rest in an
:class:`EncodePlan`, which the caller finishes inline or hands to worker threads
(:mod:`cortex.gateway.tokens.parallel`): the result is identical either way, and identical to
``ChatTokenizer.encode_prompt`` (property-tested).

A long system prompt or an earlier turn of a conversation is one piece between the
template's special tokens (or a few chunks of one), so it is encoded once and then served
from the cache; the answers the gateway relays are encoded into the cache after the
response (:mod:`cortex.gateway.tokens.answers`), so the next turn's resent history hits too.
"""

from __future__ import annotations

import copy
import functools
import json
from array import array
from collections.abc import Callable, Sequence
from pathlib import Path

from cortex.chat import ChatPrompt, ChatTokenizer, Encoder, EncoderChoice, RenderArgs
from cortex.gateway.tokens.cache import SegmentCache, SegmentKey
from cortex.gateway.tokens.segments import affixes, chunkable, chunks, splitter

__all__ = ["EncodePlan", "PromptTokenizer"]

DEFAULT_CACHE_BYTES = 256 * 1024 * 1024


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
                 chunk_chars: int = 512, cache_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        self.chat = chat
        self.cache = SegmentCache(cache_tokens, cache_bytes)
        assert chat.encoder is not None
        self.encoder = chat.encoder
        described = json.loads(chat.tokenizer.to_str()) if cache_tokens > 0 else {}
        self._splitter = splitter(chat.tokenizer, described) if cache_tokens > 0 else None
        self.segmented = self._splitter is not None
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
        return self.plan(text, add_special_tokens).finish()

    def encode_prompt(self, prompt: ChatPrompt) -> list[int]:
        """Ids of a rendered chat prompt, assembled the engine's way."""
        return self.plan_prompt(prompt).finish()

    def encode_text(self, text: str) -> list[int]:
        """Ids of a plain completion prompt (the tokenizer's special tokens added)."""
        return self.plan(text, add_special_tokens=True).finish()

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
        encodes what is missing (``missing_chars`` of it: the caller decides where)."""
        if self._splitter is None:
            return EncodePlan(self, [text], [(text, add_special_tokens)], [None])
        parts: list[int | Sequence[int] | str] = list(self._prefix) if add_special_tokens else []
        keys: list[SegmentKey] = []
        slots: list[int] = []  # where each looked-up piece goes in ``parts``
        first = True
        size = self.chunk_chars
        for piece, token_id in self._splitter.split(text):
            if token_id is not None:
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
        return EncodePlan(self, parts, missing, miss_keys, hits)


class EncodePlan:
    """A prompt's parts: token ids, cached pieces' ids, and texts still to encode
    (``missing``, in order: the ``str`` parts)."""

    __slots__ = ("_tokenizer", "hits", "keys", "missing", "missing_chars", "parts")

    def __init__(self, tokenizer: PromptTokenizer, parts: list[int | Sequence[int] | str],
                 missing: list[tuple[str, bool]], keys: list[SegmentKey | None],
                 hits: int = 0) -> None:
        self._tokenizer = tokenizer
        self.parts = parts
        self.missing = missing  # (text, add_special_tokens) of each str part, in order
        self.keys = keys  # their cache keys (None: not cached)
        self.hits = hits
        self.missing_chars = sum(len(text) for text, _ in missing)

    def extend(self, other: EncodePlan) -> EncodePlan:
        """This plan followed by ``other`` (of the same tokenizer)."""
        self.parts.extend(other.parts)
        self.missing.extend(other.missing)
        self.keys.extend(other.keys)
        self.hits += other.hits
        self.missing_chars += other.missing_chars
        return self

    def finish(self, encoded: Sequence[Sequence[int]] | None = None) -> list[int]:
        """The ids. ``encoded``: the ids of :attr:`missing`, in order, when the caller
        encoded them (elsewhere); else they are encoded here (CPU-bound for
        ``missing_chars``; safe on a worker thread). Fresh pieces go into the cache."""
        tok = self._tokenizer
        if encoded is None:
            encoded = tok.encode_pieces(self.missing) if self.missing else []
        out: list[int] = []
        fresh = iter(encoded)
        hit_tokens = 0
        for part in self.parts:
            if isinstance(part, int):
                out.append(part)
            elif isinstance(part, str):
                out.extend(next(fresh))
            else:
                if isinstance(part, array):
                    hit_tokens += len(part)
                out.extend(part)
        stored = [(key, list(ids)) for key, ids in zip(self.keys, encoded, strict=True)
                  if key is not None]
        if stored:
            tok.cache.put_many(stored)
        if tok.observer is not None:
            tok.observer(self.hits, len(self.missing))
        if tok.token_observer is not None:
            tok.token_observer(hit_tokens, sum(len(ids) for ids in encoded))
        return out

    def __repr__(self) -> str:
        return (f"EncodePlan(parts={len(self.parts)}, hits={self.hits}, "
                f"missing={len(self.missing)}, missing_chars={self.missing_chars})")


@functools.lru_cache(maxsize=8)
def _loaded(tokenizer: Path | None, chat_template: Path | None, segmented: bool,
            encoder: EncoderChoice) -> PromptTokenizer:
    return PromptTokenizer(ChatTokenizer.load(tokenizer, chat_template, encoder),
                           1_000_000 if segmented else 0)
