"""vLLM fetches an image given by URL itself; so does the simulated vLLM engine.

:func:`inline_image_urls` reads every ``http(s)`` ``image_url`` part of a chat body and puts
the bytes in its place as a base64 ``data:`` URL, so the sim sizes and identifies the image by
its bytes as vLLM does (a part's ``uuid`` still names the item). A URL that cannot be read is
the request's error (400), as in vLLM; reads are bounded by a timeout and a size cap (vLLM's
``VLLM_IMAGE_FETCH_TIMEOUT`` is 5 s).
"""

from __future__ import annotations

import asyncio
import base64
import copy
from collections.abc import Mapping
from typing import Any

import aiohttp

from cortex.sim.protocol import RequestError

__all__ = ["FETCH_TIMEOUT_S", "MAX_IMAGE_BYTES", "inline_image_urls"]

FETCH_TIMEOUT_S = 5.0
MAX_IMAGE_BYTES = 64 << 20


def _url_parts(body: Mapping[str, Any]) -> list[tuple[int, int, str]]:
    out = []
    for i, message in enumerate(body.get("messages") or []):
        content = message.get("content") if isinstance(message, Mapping) else None
        for j, part in enumerate(content if isinstance(content, list) else []):
            image = part.get("image_url") if isinstance(part, Mapping) else None
            url = image.get("url") if isinstance(image, Mapping) else None
            if part.get("type") == "image_url" and isinstance(url, str) and url.startswith(
                    ("http://", "https://")):
                out.append((i, j, url))
    return out


async def _fetch(session: aiohttp.ClientSession, url: str) -> str:
    try:
        async with session.get(url) as resp:
            if resp.status >= 400:
                raise RequestError(f"failed to fetch image {url!r}: HTTP {resp.status}")
            data = bytearray()
            async for chunk in resp.content.iter_any():  # to the end, not what arrived first
                data += chunk
                if len(data) > MAX_IMAGE_BYTES:
                    raise RequestError(f"image {url!r} is larger than {MAX_IMAGE_BYTES} bytes")
            kind = resp.headers.get("Content-Type", "image/png").split(";")[0]
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise RequestError(f"failed to fetch image {url!r}: {type(exc).__name__}") from None
    return f"data:{kind};base64," + base64.b64encode(data).decode()


async def inline_image_urls(body: dict[str, Any]) -> dict[str, Any]:
    """``body`` with its ``http(s)`` image URLs replaced by ``data:`` URLs of their bytes
    (``body`` itself when it has none; otherwise a copy). Raises :class:`RequestError`."""
    parts = _url_parts(body)
    if not parts:
        return body
    timeout = aiohttp.ClientTimeout(total=FETCH_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        inlined = await asyncio.gather(*(_fetch(session, url) for _, _, url in parts))
    out = copy.deepcopy(body)
    for (i, j, _), data_url in zip(parts, inlined, strict=True):
        out["messages"][i]["content"][j]["image_url"]["url"] = data_url
    return out
