"""Media parts of a chat request → identifiers the gateway controls and placeholder runs (pure).

An engine expands each media item of a prompt to a run of placeholder tokens; the ids of the
run say nothing about the item (Qwen-VL: N copies of ``<|image_pad|>``), so a block key over
them must also carry the item's identity. vLLM takes that identity from the content part's
``uuid`` verbatim (no ``mm_processor_kwargs`` / ``media_io_kwargs`` in the request), so the
gateway gives each item an identifier it controls and writes it into the part:

- an image given as bytes (a ``data:`` URL): ``b64-sha256:`` + the SHA-256 of its base64
  text (never decoded whole: a text stands for one byte string, and an encoder writes one
  text for a byte string — the same bytes in another text are a miss, never a wrong credit);
- an ``http(s)`` URL, only where the operator declares URLs immutable: ``url-sha256:`` + the
  SHA-256 of the URL (its bytes are never fetched here);
- a ``uuid`` the client set is kept (vLLM uses it as given).

The run's length is computed for the families in :mod:`cortex.chat.vision` from the image's
size, read from the image header (only the header's bytes are decoded from the base64 text;
EXIF orientation applied as vLLM does). What
cannot be computed (videos, audio, URL images, unknown families, processor kwargs in the
request) is *not keyed*: only the blocks before the first media placeholder are (see
:func:`media_prompt`), so a media request is never credited with a block it may not hit.
"""

from __future__ import annotations

import binascii
import dataclasses
import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from cortex.chat.imagesize import Base64Bytes, image_size
from cortex.chat.vision import VisionConfig
from cortex.hashing import MediaSpan

__all__ = ["MEDIA_PARTS", "SENTINEL", "TEMPLATE_MEDIA", "MediaItem", "MediaPrompt", "Modality",
           "common_prefix", "media_items", "media_prompt", "stamp_identifiers"]


class Modality(StrEnum):
    IMAGE = "image"
    VIDEO = "video"
    AUDIO = "audio"


MEDIA_PARTS: Mapping[str, Modality] = {
    "image_url": Modality.IMAGE, "input_image": Modality.IMAGE, "image_pil": Modality.IMAGE,
    "image_embeds": Modality.IMAGE, "video_url": Modality.VIDEO, "video_embeds": Modality.VIDEO,
    "audio_url": Modality.AUDIO, "input_audio": Modality.AUDIO, "audio_embeds": Modality.AUDIO,
}
"""Content-part types that carry a media item (vLLM's parser), and the item's modality."""

# media parts as the engines' parsers hand them to the template (vLLM: {"type": modality};
# SGLang keeps the client's part)
TEMPLATE_MEDIA = frozenset({"image", "video", "audio", *MEDIA_PARTS})
_MAX_DATA_URL_CHARS = 64 << 20  # past this the engine decides alone; nothing is keyed


@dataclass(frozen=True, slots=True)
class MediaItem:
    """One media part: where it is (``message``, ``part`` indices), its modality, the
    identifier the engine will use (``None``: not one the gateway knows) and its placeholder
    tokens (``None``: not computable here). ``url``: an immutable ``http(s)`` image URL
    whose header a bounded read may give the size of (see :meth:`sized`)."""

    message: int
    part: int
    modality: Modality
    identifier: str | None = None
    tokens: int | None = None
    stamp: bool = False  # the gateway writes ``identifier`` into the part as its ``uuid``
    url: str | None = None

    @property
    def keyed(self) -> bool:
        return self.identifier is not None and self.tokens is not None

    def sized(self, size: tuple[int, int] | None, vision: VisionConfig) -> MediaItem:
        """This item with the placeholder run of an image of ``size`` (width, height in
        pixels; ``None``: unknown, the item stays unkeyed)."""
        if size is None or self.modality is not Modality.IMAGE:
            return self
        return dataclasses.replace(self, tokens=vision.image_tokens(*size))


def _url_of(part: Mapping[str, Any]) -> str | None:
    value = part.get("image_url")  # chat: {"url": ...}; Responses' input_image: the URL
    if isinstance(value, Mapping):
        value = value.get("url")
    return value if isinstance(value, str) else None


def _data_text(url: str) -> bytes | None:
    """The base64 text of a ``data:`` URL, as ASCII bytes (``None``: not one, or not strict
    base64 by its length and characters seen here; vLLM decodes the text with
    ``validate=True``, so an image it serves is strict base64)."""
    if not url.startswith("data:") or len(url) > _MAX_DATA_URL_CHARS:
        return None
    head, sep, data = url.partition(",")
    if not sep or not head.endswith(";base64") or len(data) % 4:
        return None
    if "\n" in data or "\r" in data or "\t" in data:
        return None  # a URL parser drops these: the text would not be the bytes' encoding
    try:
        return data.encode("ascii")
    except UnicodeEncodeError:
        return None


def _data_size(text: bytes) -> tuple[int, int] | None:
    """The displayed size of the image whose base64 ``text`` is given, from its header
    (decoding only what the header walk reads; ``None``: unknown or not base64)."""
    try:
        return image_size(Base64Bytes(text))
    except (binascii.Error, ValueError):
        return None


def _image_item(i: int, j: int, part: Mapping[str, Any], vision: VisionConfig | None,
                immutable_urls: bool) -> MediaItem:
    given = part.get("uuid")
    url = _url_of(part)
    identifier: str | None = str(given) if given is not None else None
    tokens: int | None = None
    if url is not None:
        text = _data_text(url)
        if text is not None:
            # the text, not the decoded bytes: a text stands for one byte string, and
            # hashing it costs a tenth of decoding it (the same image in another text is a
            # miss, never a wrong credit)
            identifier = identifier or "b64-sha256:" + hashlib.sha256(text).hexdigest()
            size = _data_size(text) if vision is not None else None
            if vision is not None and size is not None:
                tokens = vision.image_tokens(*size)
        elif immutable_urls and url.startswith(("http://", "https://")):
            identifier = identifier or "url-sha256:" + hashlib.sha256(url.encode()).hexdigest()
            return MediaItem(i, j, Modality.IMAGE, identifier, None, stamp=given is None,
                             url=url)
    return MediaItem(i, j, Modality.IMAGE, identifier, tokens,
                     stamp=given is None and identifier is not None)


def media_items(body: Mapping[str, Any], vision: VisionConfig | None = None,
                immutable_urls: bool = False, *, identify: bool = True
                ) -> tuple[MediaItem, ...]:
    """The media parts of a chat ``body`` in prompt order (none: ``()``). ``vision``: the
    model's processor settings (``None``: placeholder runs are not computed); a request
    with ``mm_processor_kwargs`` / ``media_io_kwargs`` gets no identifiers (the engine
    hashes those into its own), nor does any with ``identify`` false (an engine that takes
    none: nothing is decoded or hashed)."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return ()
    own = identify and not body.get("mm_processor_kwargs") and not body.get("media_io_kwargs")
    items: list[MediaItem] = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, Mapping) else None
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, Mapping) else None
            modality = MEDIA_PARTS.get(kind) if isinstance(kind, str) else None
            if modality is None:
                continue
            if modality is Modality.IMAGE and kind != "image_embeds" and own:
                items.append(_image_item(i, j, part, vision, immutable_urls))
            else:
                items.append(MediaItem(i, j, modality))
    return tuple(items)


def stamp_identifiers(body: dict[str, Any], items: Sequence[MediaItem]) -> None:
    """Write each item's identifier into its part as ``uuid`` (vLLM's field), where the
    client set none. Mutates ``body``."""
    for item in items:
        if item.stamp and item.identifier is not None:
            body["messages"][item.message]["content"][item.part]["uuid"] = item.identifier


@dataclass(frozen=True, slots=True)
class MediaPrompt:
    """A media prompt as the engine computes it: ``ids`` (placeholders expanded where
    ``spans`` are known), ``spans`` (every item's run; ``None``: not all are known) and
    ``plain_tokens``: how many leading tokens are plain text (exact by construction;
    ``None``: not known from the ids, see :func:`sentinel_args`)."""

    ids: list[int]
    spans: tuple[MediaSpan, ...] | None
    plain_tokens: int | None


def media_prompt(ids: Sequence[int], items: Sequence[MediaItem],
                 vision: VisionConfig | None) -> MediaPrompt:
    """Expand the one placeholder token per item of the rendered prompt ``ids`` (what the
    chat template writes) to each item's run. Exact only when the model's family is known,
    every item is an image with an identifier and a size, and the rendered prompt holds one
    placeholder per item; else ``spans`` is ``None`` and ``plain_tokens`` stops at the
    first placeholder, or is ``None`` when the ids do not hold one placeholder per item (an
    unknown family; a string-content template, where vLLM writes its own placeholder strings
    before the message's text)."""
    if vision is None:
        return MediaPrompt(list(ids), None, None)
    marks = [k for k, token in enumerate(ids) if token in vision.placeholder_ids]
    if not items or len(marks) != len(items):
        return MediaPrompt(list(ids), None, None)
    first = marks[0]
    images = [k for k in marks if ids[k] == vision.image_token_id]
    if len(images) != len(marks) or not all(item.keyed and item.modality is Modality.IMAGE
                                            for item in items):
        return MediaPrompt(list(ids), None, first)
    out: list[int] = []
    spans: list[MediaSpan] = []
    at = 0
    for k, item in zip(marks, items, strict=True):
        out.extend(ids[at:k])
        assert item.identifier is not None and item.tokens is not None
        spans.append(MediaSpan(item.identifier, len(out), item.tokens))
        out.extend([vision.image_token_id] * item.tokens)
        at = k + 1
    out.extend(ids[at:])
    return MediaPrompt(out, tuple(spans), first)


SENTINEL = "\ue000"
"""A private-use character no template writes: stands in for the first media item when the
gateway looks for the plain-text prefix of a prompt whose placeholders it does not know."""


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two id lists."""
    n = min(len(a), len(b))
    for k in range(n):
        if a[k] != b[k]:
            return k
    return n
