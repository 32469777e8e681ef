"""The exact ids of recent prompts' heads, so that a resent history is not split again (pure core).

An agent resends its whole conversation on every turn: the rendered prompt of turn n + 1
starts with the rendered prompt of turn n. The segment cache already spares encoding that
history, but splitting it on added tokens, cutting it into chunks, looking every chunk up
and assembling the ids again costs time linear in the whole prompt on every turn.
:class:`PrefixMemo` keeps, for recently routed prompts, a *head*: the prompt's text up to
the end of its last *cut token*, with the exact ids of that text. A new prompt that starts
with a remembered head reuses its ids and splits only the text after it.

Why the ids of the head stay exact inside a longer text. The tokenizer splits a text on its
added tokens leftmost-longest, then encodes each piece between them on its own
(:mod:`cortex.gateway.tokens.prompt`). Let an added token ``t`` end at offset ``c`` of the
split of a text. Appending text after ``c`` can change the split before ``c`` only through
a match that crosses ``c``: one that starts at or before ``t`` and ends past ``c`` contains
``t``, one that starts inside ``t`` begins with a proper suffix of ``t``; and ``t`` itself
could absorb the whitespace after it (``rstrip``). A *cut token* (:func:`cut_tokens`) is an
added token that no other added token contains, whose proper suffixes start no added token,
and that absorbs no whitespace after it: at its end the split of any continuation restarts,
as if the text began there (a piece after it never starts the text). So the ids of a head
are the same in every text that starts with it. ``tests/gateway/tokens/test_prefix.py``
checks the ids of prompts planned with and without the memo on random edits.

Finding the head of a new prompt costs no pass over it: heads are indexed by their length
and their last characters, and the candidates are the positions of the cut tokens' last
characters, scanned from the end (at most ``scan`` of them); a candidate is taken only when
the whole head text matches (``str.startswith``).
"""

from __future__ import annotations

import threading
from array import array
from collections import Counter, OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from cortex.hashing import block_keys

__all__ = ["Head", "PrefixMemo", "cut_tokens"]

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
        """The keys of the head's full blocks chained from ``root`` (computed once; do not
        modify the list)."""
        keys = self._chains.get((root, block_size))
        if keys is None:
            full = len(self.ids) // block_size * block_size
            keys = self._chains[root, block_size] = block_keys(self.ids[:full].tolist(),
                                                               block_size, root)
        return keys


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

    def remember(self, text: str, special: bool, ids: Sequence[int]) -> None:
        """Keep ``text`` (ending with a cut token) and its exact ``ids``."""
        head = Head(text, special, array("I", ids))
        cost = self.cost(head)
        if cost > self.max_bytes:
            return
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
