"""Bounded reads of image URLs' first bytes: a URL image's size without fetching the image.

Only for models whose operator declared URLs immutable and asked for header reads
(``models[].image_headers``); the engine fetches the whole image itself when it serves the
request, so the gateway reads nothing the engine would not. Each read is bounded three ways:

- a ranged ``GET`` (``Range: bytes=0-<n-1>``) of which at most ``n`` body bytes are read,
  whatever the server sends (one that ignores the range is cut off);
- one timeout for the whole read (connect, response head, body), never past the request's
  deadline; the response head's lines and fields are bounded by aiohttp's parser limits;
- the image's declared size (``Content-Range`` total, else ``Content-Length``) against
  ``max_image_bytes``.

An immutable URL's image never changes, so :meth:`ImageHeaders.size` remembers the sizes it
read (the last :data:`SIZE_CACHE` URLs): a repeated image costs one read.

Outcomes: :class:`ImageHeader` (the bytes read, and whether they are the whole file),
``None`` when the read timed out (the item stays unkeyed; the engine decides), or a
:class:`~cortex.gateway.errors.ClientError` the caller returns as is — the URL is not an
``http(s)`` URL, cannot be reached, answers an error status or redirects too often (400), or
declares an image over the limit (413).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from types import TracebackType

import aiohttp

from cortex.chat.imagesize import image_size
from cortex.gateway.errors import ClientError, ErrorCode

__all__ = ["MAX_REDIRECTS", "SIZE_CACHE", "ImageHeader", "ImageHeaders"]

log = logging.getLogger(__name__)

MAX_REDIRECTS = 3
"""Redirects followed per read (each one within the same timeout)."""
SIZE_CACHE = 4096
"""URLs whose image size (or unreadable header) :meth:`ImageHeaders.size` remembers."""
_CHUNK = 16 * 1024


@dataclass(frozen=True, slots=True)
class ImageHeader:
    """The first bytes of an image (``complete``: they are the whole file)."""

    data: bytes
    complete: bool


def _declared_size(resp: aiohttp.ClientResponse) -> int | None:
    """The whole image's size in bytes as the response declares it (``None``: unknown)."""
    if resp.status == 206:
        total = resp.headers.get("Content-Range", "").rpartition("/")[2].strip()
        return int(total) if total.isdigit() else None
    length = resp.headers.get("Content-Length", "")
    return int(length) if length.isdigit() else None


def _bad_url(url: str, why: str) -> ClientError:
    shown = url if len(url) <= 200 else url[:200] + "…"
    return ClientError(f"image URL {shown!r} {why}", param="messages")


class ImageHeaders:
    """Reads the first bytes of image URLs over its own HTTP session (not the workers'):
    ``async with ImageHeaders() as headers: await headers.read(url, ...)``."""

    def __init__(self) -> None:
        self._session: aiohttp.ClientSession | None = None
        self._sizes: OrderedDict[str, tuple[int, int] | None] = OrderedDict()
        self.reads = 0

    async def __aenter__(self) -> ImageHeaders:
        self._session = aiohttp.ClientSession(
            auto_decompress=False, connector=aiohttp.TCPConnector(limit=64),
            headers={"Accept-Encoding": "identity"})
        return self

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def size(self, url: str, *, max_bytes: int, header_bytes: int, timeout_s: float,
                   deadline: float | None = None) -> tuple[int, int] | None:
        """The displayed size (width, height) of the image at ``url`` from its header
        (:func:`~cortex.chat.imagesize.image_size`), remembered per URL; ``None``: the header
        does not say with certainty, or the read timed out (not remembered). Raises
        :class:`ClientError` as :meth:`read` does."""
        if url in self._sizes:
            self._sizes.move_to_end(url)
            return self._sizes[url]
        header = await self.read(url, max_bytes=max_bytes, header_bytes=header_bytes,
                                 timeout_s=timeout_s, deadline=deadline)
        if header is None:
            return None
        found = image_size(header.data, header.complete)
        self._sizes[url] = found
        if len(self._sizes) > SIZE_CACHE:
            self._sizes.popitem(last=False)
        return found

    async def read(self, url: str, *, max_bytes: int, header_bytes: int, timeout_s: float,
                   deadline: float | None = None) -> ImageHeader | None:
        """The first ``header_bytes`` of the image at ``url`` within ``timeout_s`` seconds
        (and before ``deadline``, ``time.monotonic()`` seconds); ``None``: timed out.
        Raises :class:`ClientError` as the module says."""
        if self._session is None:
            raise RuntimeError("ImageHeaders is not open")
        if not url.startswith(("http://", "https://")):
            raise _bad_url(url, "is not an http(s) URL")
        if deadline is not None:
            timeout_s = min(timeout_s, deadline - time.monotonic())
        if timeout_s <= 0:
            return None
        self.reads += 1
        try:
            async with asyncio.timeout(timeout_s):
                return await self._read(url, max_bytes, header_bytes)
        except TimeoutError:
            log.info("image header read timed out after %.2f s: %s", timeout_s, url[:200])
            return None
        except aiohttp.TooManyRedirects:
            raise _bad_url(url, f"redirects more than {MAX_REDIRECTS} times") from None
        except (aiohttp.InvalidURL, ValueError):
            raise _bad_url(url, "is not a valid URL") from None
        except aiohttp.ClientError as exc:
            raise _bad_url(url, f"cannot be read: {type(exc).__name__}") from None

    async def _read(self, url: str, max_bytes: int, header_bytes: int) -> ImageHeader:
        assert self._session is not None
        async with self._session.get(url, headers={"Range": f"bytes=0-{header_bytes - 1}"},
                                     max_redirects=MAX_REDIRECTS) as resp:
            if resp.status >= 400:
                raise _bad_url(url, f"answered HTTP {resp.status}")
            size = _declared_size(resp)
            if size is not None and size > max_bytes:
                raise ClientError(
                    f"the image at {url[:200]!r} is {size:,} bytes, over this model's limit of"
                    f" {max_bytes:,}", code=ErrorCode.REQUEST_TOO_LARGE, status=413,
                    param="messages")
            data = bytearray()
            while len(data) < header_bytes:
                chunk = await resp.content.read(min(_CHUNK, header_bytes - len(data)))
                if not chunk:
                    return ImageHeader(bytes(data), True)
                data += chunk
            return ImageHeader(bytes(data), size is not None and size <= len(data))

    def __repr__(self) -> str:
        return f"ImageHeaders(open={self._session is not None}, reads={self.reads})"
