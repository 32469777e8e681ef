"""Block keys of a chat prompt with media items (:mod:`cortex.chat.media`).

- vLLM, a supported family (:mod:`cortex.chat.vision`), every item an image with an
  identifier and a size: the prompt is expanded to the engine's placeholder runs and keyed
  with the media pairs vLLM puts on each block (:func:`cortex.hashing.media_block_keys`);
  the ingest keys the engine's stores the same way, so a repeated image is an exact hit.
- Otherwise only the blocks before the first media placeholder are keyed (plain tokens, exact
  by construction); the rest of the prompt is routed by load. Where the ids do not show
  the placeholders (an unknown family, a string-content template) the plain prefix is where
  the prompt's ids and those of a rendering with the first item replaced by a sentinel
  character part stop agreeing.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from cortex.chat import RenderArgs
from cortex.chat.media import common_prefix, media_prompt
from cortex.chat.request import sentinel_args
from cortex.gateway.request.payload import InferenceRequest
from cortex.hashing import Engine, media_block_keys, media_extra_keys

__all__ = ["media_keys"]


async def media_keys(req: InferenceRequest, ids: list[int],
                     encode: Callable[[RenderArgs], Awaitable[list[int]]]
                     ) -> tuple[list[int], int, int]:
    """``(keys, query_blocks, prompt_tokens)`` of a media prompt whose rendered ids (one
    placeholder per item) are ``ids`` (none: not renderable here, nothing is keyed);
    ``encode(args)``: the ids of another rendering (raises ``ClientError`` like the first)."""
    model = req.model
    size = model.block_size
    prompt = media_prompt(ids, req.prompt.media, model.vision)
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
