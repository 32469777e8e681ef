"""Ledger-guided lazy tokenization: encode a prompt only as far as the cache match can reach
(pure core).

The ledger can only match a prefix some worker holds: past the first full block that no
worker holds, every further token changes nothing about the match. :func:`walk` therefore
takes a prompt's :class:`~cortex.gateway.tokens.prompt.EncodePlan` (its parts, split at the
provably safe cuts of :mod:`cortex.gateway.tokens.prompt`, cached pieces already filled in)
and goes front to back: each part's ids are exact on their own, so after each part the ids so
far are an exact prefix of the whole prompt's. As parts complete full blocks their keys are
chained on, and ``deepest(keys)`` (the longest leading run of ``keys`` any worker holds, in
the ledger or predicted) says whether the match can still grow; the walk stops at the first
full block nobody holds. The match of that prefix equals the match of the whole query (a
worker's leading run cannot pass a block it does not hold), which
``tests/gateway/tokens/test_lazy.py`` checks differentially on random workloads.

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

from collections.abc import Callable, Container, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from cortex.gateway.tokens.prompt import EncodePlan, PromptTokenizer, SegmentKey
from cortex.hashing import block_keys

__all__ = ["BytesPerToken", "LeadingRuns", "Walk", "held_prefix", "walk"]

MIN_NEW_BLOCKS = 4
"""New full blocks the walk collects before it asks the ledger again (at least). A walk that
stops has at least this many keys: routing's tie key (its ``TIE_BLOCKS``-th block, 4) is
then the same as with the whole prompt."""

Deepest = Callable[[list[int]], int]
"""Leading blocks of ``keys`` the best-placed worker holds (0..len(keys))."""


def held_prefix(keys: Sequence[int], held: Container[int]) -> int:
    """Leading ``keys`` in ``held`` (one holder's :data:`Deepest`, for an in-memory set)."""
    count = 0
    for key in keys:
        if key not in held:
            break
        count += 1
    return count


H = TypeVar("H", bound=Hashable)


class LeadingRuns(Generic[H]):
    """Per holder, the leading blocks it holds of a key chain that only grows (the walk's
    keys), asked for the keys added since the last time only: a holder's run over the
    longer chain is its run so far, plus its run over the new keys if it held every key so
    far. The walk then matches each key once, not the whole chain at every ask."""

    __slots__ = ("asked", "runs")

    def __init__(self) -> None:
        self.asked = 0  # keys of the chain asked for so far
        self.runs: dict[H, int] = {}

    def growing(self) -> bool:
        """Whether some holder (any, before the first ask) held every key so far."""
        return self.asked == 0 or self.asked in self.runs.values()

    def extend(self, new_runs: Mapping[H, int], count: int) -> None:
        """``count`` more keys asked for; ``new_runs``: each holder's leading run of them."""
        asked, runs = self.asked, self.runs
        for holder, run in new_runs.items():
            if runs.get(holder, 0) == asked:
                runs[holder] = asked + run
        self.asked = asked + count

    @property
    def deepest(self) -> int:
        return max(self.runs.values(), default=0)

    def __repr__(self) -> str:
        return f"LeadingRuns(asked={self.asked}, deepest={self.deepest})"


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

    ``ids``: the exact leading ids (all of them when ``complete``); ``keys``: the plain keys
    of their full blocks; ``deepest``: leading blocks the best-placed worker holds (the
    match cannot exceed it). ``rest_bytes`` / ``rest_pieces``: UTF-8 bytes and text pieces
    not encoded yet."""

    ids: list[int]
    keys: list[int]
    deepest: int
    complete: bool
    rest_bytes: int
    rest_pieces: int
    _plan: EncodePlan = field(repr=False)
    _next: int = field(default=0, repr=False)  # the first part not taken yet
    _piece: int = field(default=0, repr=False)  # the first missing piece not encoded yet
    _fresh: list[tuple[SegmentKey, list[int]]] = field(default_factory=list, repr=False)

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

    def finish(self, tokenizer: PromptTokenizer) -> list[int]:
        """Encode the rest (CPU-bound; safe on a worker thread): the whole ids, which equal
        ``plan.finish()``'s; fresh pieces go into the segment cache."""
        if not self.complete:
            _take(self, tokenizer, len(self._plan.parts))
            self.complete = True
            self.rest_bytes = self.rest_pieces = 0
        if self._fresh:
            tokenizer.cache.put_many(self._fresh)
            self._fresh = []
        return self.ids


def _take(w: Walk, tokenizer: PromptTokenizer, stop: int) -> int:
    """Append parts ``w._next`` .. ``stop`` - 1 to ``w.ids``; the UTF-8 bytes encoded."""
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
    w = Walk([], [], 0, False, sum(len(p.encode("utf-8", "surrogatepass"))
                                   for p in parts if isinstance(p, str)),
             sum(isinstance(p, str) for p in parts), plan)
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
            start = len(w.keys) * block_size
            w.keys += block_keys(w.ids[start:full * block_size], block_size,
                                 w.keys[-1] if w.keys else root)
            w.deepest = deepest(w.keys)
            if w.deepest < len(w.keys) and _more(parts, i + 1):
                return w  # block ``deepest`` is held by no one: the match stops there
    full = len(w.ids) // block_size
    if full > len(w.keys):
        w.keys += block_keys(w.ids[len(w.keys) * block_size:full * block_size], block_size,
                             w.keys[-1] if w.keys else root)
        w.deepest = deepest(w.keys)
    w.complete = True
    return w
