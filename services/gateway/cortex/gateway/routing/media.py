"""Block keys of a chat prompt with media items (:mod:`cortex.chat.media`).

- vLLM, a supported family (:mod:`cortex.chat.vision`), every item an image with an
  identifier and a size (an immutable URL's from a bounded header read where the model asks
  for one, :mod:`cortex.gateway.upstream.images`): the prompt is expanded to the engine's
  placeholder runs and keyed with the media pairs vLLM puts on each block
  (:func:`cortex.hashing.media_block_keys`); the ingest keys the engine's stores the same
  way, so a repeated image is an exact hit.
- Otherwise only the blocks before the first media placeholder are keyed (plain tokens, exact
  by construction); the rest of the prompt is routed by load. Where the ids do not show
  the placeholders (an unknown family, a string-content template) the plain prefix is where
  the prompt's ids and those of a rendering with the first item replaced by a sentinel
  character part stop agreeing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

from cortex.chat import RenderArgs
from cortex.chat.media import MediaItem, common_prefix, media_prompt
from cortex.chat.request import sentinel_args
from cortex.gateway.request.payload import InferenceRequest
from cortex.gateway.upstream.images import ImageHeaders
from cortex.hashing import Engine, media_block_keys, media_extra_keys

__all__ = ["media_keys", "sized_items"]


async def sized_items(req: InferenceRequest, headers: ImageHeaders | None,
                      deadline: float | None) -> tuple[MediaItem, ...]:
    """The request's media items, each immutable URL image sized from a header read when
    the model asks for it (vLLM workers of a supported family; reads run together).
    Raises ``ClientError`` for a bad or oversize URL (:meth:`ImageHeaders.read`)."""
    model, items = req.model, req.prompt.media
    vision = model.vision
    wanted = [k for k, item in enumerate(items) if item.url is not None and item.tokens is None]
    if (headers is None or vision is None or not model.image_headers or not wanted
            or model.engine is not Engine.VLLM):
        return items
    sizes = await asyncio.gather(*(headers.size(
        str(items[k].url), max_bytes=model.max_image_bytes,
        header_bytes=model.image_header_bytes, timeout_s=model.image_timeout_s,
        deadline=deadline) for k in wanted))
    out = list(items)
    for k, size in zip(wanted, sizes, strict=True):
        out[k] = items[k].sized(size, vision)
    return tuple(out)


async def media_keys(req: InferenceRequest, ids: Sequence[int],
                     encode: Callable[[RenderArgs], Awaitable[list[int]]],
                     items: tuple[MediaItem, ...] | None = None
                     ) -> tuple[list[int], int, int]:
    """``(keys, query_blocks, prompt_tokens)`` of a media prompt whose rendered ids (one
    placeholder per item) are ``ids`` (none: not renderable here, nothing is keyed);
    ``encode(args)``: the ids of another rendering (raises ``ClientError`` like the first);
    ``items``: the request's media items as :func:`sized_items` gave them (default: as
    parsed)."""
    model = req.model
    size = model.block_size
    prompt = media_prompt(ids, req.prompt.media if items is None else items, model.vision)
    tokens = len(prompt.ids)
    root = model.domain.root_key(req.lora_name, req.cache_salt)
    if prompt.spans is not None and model.engine is Engine.VLLM:
        media = media_extra_keys(prompt.spans, tokens // size, size)
        keys = media_block_keys(prompt.ids, size, root, media)
        return keys, max(tokens - 1, 0) // size, tokens
    plain = prompt.plain_tokens
    if plain is None:
        plain = 0
        if req.prompt.chat is not None and ids:
            plain = common_prefix(ids, await encode(sentinel_args(req.prompt.chat)))
    keys = model.domain.keys(prompt.ids[:plain], req.lora_name, req.cache_salt)
    return keys, len(keys), tokens
