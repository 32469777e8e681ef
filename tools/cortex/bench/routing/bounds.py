"""What any router could get at best: exact prompt shapes and cache-hit bounds (pure).

:class:`PromptShape` is a request as the engine sees it: its prompt token count and the
chained keys of its full pages (``page_tokens`` = the sims' block size). Hits follow the
engine's rules: only full pages are cached, the last prompt token is always computed, so a
request with ``h`` leading pages already cached reports
``min(h, (tokens - 1) // page_tokens) * page_tokens`` cached tokens.

* :func:`infinite_cache_hit_rate` — one cache that never forgets and sees every request in
  order: an upper bound for every router on the same request list.
* :func:`pooled_lru_hit_rate` — one LRU cache as large as all workers together (a prefix's
  pages refreshed root-last, so leaves go first, like the sims). A reference for what a
  perfect partition of the cluster's memory could keep, used to say whether capacity
  allows reaching the infinite bound; not a strict bound (LRU is not optimal).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from cortex.bench.routing.workloads import Endpoint, Request, Workload

__all__ = [
    "MediaEncoder",
    "MediaRun",
    "PromptShape",
    "cacheable_tokens",
    "infinite_cache_hit_rate",
    "nominal_order",
    "page_keys",
    "pooled_lru_hit_rate",
    "shape_prompts",
    "unique_pages",
]


@dataclass(frozen=True, slots=True)
class PromptShape:
    """A prompt's token count and the chained keys of its full pages."""

    tokens: int
    pages: tuple[int, ...]


class MediaRun(Protocol):
    """A media item's placeholder run in an engine's prompt (``cortex.hashing.MediaSpan``)."""

    @property
    def identifier(self) -> str: ...
    @property
    def offset(self) -> int: ...
    @property
    def length(self) -> int: ...


MediaEncoder = Callable[[Request], tuple[list[int], Sequence[MediaRun]]]
"""A request with images → the engine's prompt ids (placeholders expanded) and its runs."""


def page_keys(token_ids: Sequence[int], page_tokens: int, media: Sequence[MediaRun] = ()
              ) -> tuple[int, ...]:
    """Chained keys of every full page: equal keys ⇔ equal token prefixes (up to hash
    collisions of 64-bit tuple hashes). A page overlapping a media run also carries the
    item's identifier: placeholder ids say nothing about the image, the engine's key does."""
    keys: list[int] = []
    parent = 0
    for start in range(0, len(token_ids) - page_tokens + 1, page_tokens):
        end = start + page_tokens
        items = tuple(m.identifier for m in media
                      if m.offset < end and m.offset + m.length > start)
        parent = hash((parent, tuple(token_ids[start:end]), items))
        keys.append(parent)
    return tuple(keys)


def cacheable_tokens(shape: PromptShape, hit_pages: int, page_tokens: int) -> int:
    """Cached tokens the engine reports for ``hit_pages`` leading pages found cached."""
    return min(hit_pages, max(shape.tokens - 1, 0) // page_tokens) * page_tokens


def shape_prompts(requests: Iterable[Request], encode_text: Callable[[str], list[int]],
                  encode_chat: Callable[[list[dict[str, str]]], list[int]], page_tokens: int,
                  encode_media: MediaEncoder | None = None) -> list[PromptShape]:
    """The shape of every request, tokenized like the engine (``encode_*`` of
    :class:`cortex.sim.tokenization.ChatTokenizer`; ``encode_media`` for requests with
    images)."""
    shapes = []
    for r in requests:
        if r.images:
            if encode_media is None:
                raise ValueError(f"request {r.id} has images: shaping it needs encode_media")
            ids, media = encode_media(r)
            shapes.append(PromptShape(len(ids), page_keys(ids, page_tokens, media)))
            continue
        if r.endpoint is Endpoint.COMPLETIONS:
            assert r.prompt is not None
            ids = encode_text(r.prompt)
        else:
            ids = encode_chat([{"role": role, "content": c} for role, c in r.messages])
        shapes.append(PromptShape(len(ids), page_keys(ids, page_tokens)))
    return shapes


def nominal_order(workload: Workload) -> list[int]:
    """Request ids by nominal send time: ``at_s`` after the start, or after the request
    it follows (its own nominal time, service time taken as zero); ties by id."""
    nominal: dict[int, float] = {}
    for r in workload.requests:
        nominal[r.id] = r.at_s if r.after is None else nominal[r.after] + r.at_s
    return sorted(nominal, key=lambda i: (nominal[i], i))


def _leading(pages: Sequence[int], present: Callable[[int], bool]) -> int:
    n = 0
    for key in pages:
        if not present(key):
            break
        n += 1
    return n


def infinite_cache_hit_rate(shapes: Sequence[PromptShape], order: Sequence[int],
                            page_tokens: int) -> float:
    """Σ cached / Σ prompt tokens with one never-evicting cache, requests in ``order``."""
    seen: set[int] = set()
    cached = total = 0
    for i in order:
        shape = shapes[i]
        cached += cacheable_tokens(shape, _leading(shape.pages, seen.__contains__), page_tokens)
        total += shape.tokens
        seen.update(shape.pages)
    return cached / total if total else 0.0


def pooled_lru_hit_rate(shapes: Sequence[PromptShape], order: Sequence[int], page_tokens: int,
                        capacity_pages: int) -> float:
    """Σ cached / Σ prompt tokens with one LRU cache of ``capacity_pages`` pages."""
    if capacity_pages < 1:
        raise ValueError("capacity_pages must be >= 1")
    lru: OrderedDict[int, None] = OrderedDict()
    cached = total = 0
    for i in order:
        shape = shapes[i]
        cached += cacheable_tokens(shape, _leading(shape.pages, lru.__contains__), page_tokens)
        total += shape.tokens
        for key in reversed(shape.pages):  # the root ends up most recent: leaves go first
            lru[key] = None
            lru.move_to_end(key)
        while len(lru) > capacity_pages:
            lru.popitem(last=False)
    return cached / total if total else 0.0


def unique_pages(shapes: Iterable[PromptShape]) -> int:
    """Distinct prompt pages of a workload (its working set, in pages)."""
    return len({key for shape in shapes for key in shape.pages})
