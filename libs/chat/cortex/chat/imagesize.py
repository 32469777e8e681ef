"""An encoded image's displayed size from its header, without decoding it (pure).

vLLM opens an image with Pillow and applies its EXIF orientation
(``ImageOps.exif_transpose``) before processing, so the size that counts is the displayed
one: width and height swap for orientations 5-8. Read here: PNG (an ``eXIf`` chunk makes the
size unknown), JPEG (SOF marker; orientation from the APP1 Exif block), GIF, WebP (lossy,
lossless; extended without an EXIF flag) and BMP. Anything else, or a header this cannot
read with certainty, is ``None``: the caller then does not key the image.

A header read (the first bytes of a URL image) passes ``complete=False``: a PNG then counts
only once its first ``IDAT`` chunk is in the data (the PNG specification puts any ``eXIf``
chunk before it); a JPEG's Exif block precedes its frame header anyway.

An image given as base64 text (a ``data:`` URL) is read through :class:`Base64Bytes`: only
the few bytes the header walk looks at are decoded (decoding a whole image costs ~10x more
than hashing its text, docs/chat.md "Media parts").
"""

from __future__ import annotations

import binascii
import struct
from typing import overload

__all__ = ["Base64Bytes", "image_size"]


class Base64Bytes:
    """The bytes a strict base64 text (``A-Z a-z 0-9 + /``, ``=`` padding, no whitespace)
    decodes to, decoded on access: a slice decodes only the 4-character groups holding it.
    Raises ``ValueError`` on creation when the length cannot be strict base64, and
    ``binascii.Error`` on access when the characters read are not base64 (the characters
    never read are never checked: an engine decoding the whole text refuses what is
    invalid there)."""

    __slots__ = ("_len", "_text")

    def __init__(self, text: bytes) -> None:
        if len(text) % 4:
            raise ValueError("base64 text of a length not a multiple of 4")
        self._text = text
        pad = 2 if text.endswith(b"==") else 1 if text.endswith(b"=") else 0
        self._len = len(text) // 4 * 3 - pad

    def __len__(self) -> int:
        return self._len

    @overload
    def __getitem__(self, key: int) -> int: ...

    @overload
    def __getitem__(self, key: slice) -> bytes: ...

    def __getitem__(self, key: int | slice) -> int | bytes:
        if isinstance(key, int):
            at = key + self._len if key < 0 else key
            if not 0 <= at < self._len:
                raise IndexError("Base64Bytes index out of range")
            return self[at : at + 1][0]
        start, stop, step = key.indices(self._len)
        if step != 1:
            raise ValueError("Base64Bytes slices take no step")
        if start >= stop:
            return b""
        first = start // 3
        decoded = binascii.a2b_base64(self._text[first * 4 : -(-stop // 3) * 4],
                                      strict_mode=True)
        return decoded[start - first * 3 : stop - first * 3]

    def startswith(self, prefix: bytes) -> bool:
        return self[: len(prefix)] == prefix

    def __repr__(self) -> str:
        return f"Base64Bytes({self._len} bytes)"


_Data = bytes | Base64Bytes

_SOF = frozenset({0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE,
                  0xCF})
_SWAPPING = frozenset({5, 6, 7, 8})


def _png(data: _Data, complete: bool) -> tuple[int, int] | None:
    if len(data) < 24 or data[12:16] != b"IHDR":
        return None
    width, height = struct.unpack(">II", data[16:24])
    at = 8
    while at + 8 <= len(data):  # an eXIf chunk anywhere: Pillow may rotate
        head = data[at : at + 8]  # one read per chunk (a decode when ``data`` is base64)
        length, kind = int.from_bytes(head[:4], "big"), head[4:]
        if kind == b"eXIf":
            return None
        if kind == b"IEND" or (kind == b"IDAT" and not complete):
            return width, height
        at += 12 + length
    return (width, height) if complete else None


def _exif_orientation(tiff: bytes) -> int | None:
    """The orientation tag of an Exif TIFF block (1 when absent; ``None``: unreadable)."""
    if len(tiff) < 8 or tiff[:2] not in (b"II", b"MM"):
        return None
    order = "<" if tiff[:2] == b"II" else ">"
    ifd = struct.unpack(order + "I", tiff[4:8])[0]
    if ifd + 2 > len(tiff):
        return None
    count = struct.unpack(order + "H", tiff[ifd : ifd + 2])[0]
    for k in range(count):
        entry = ifd + 2 + 12 * k
        if entry + 12 > len(tiff):
            return None
        tag, kind = struct.unpack(order + "HH", tiff[entry : entry + 4])
        if tag == 0x0112:
            if kind != 3:
                return None
            value: int = struct.unpack(order + "H", tiff[entry + 8 : entry + 10])[0]
            return value
    return 1


def _jpeg(data: _Data) -> tuple[int, int] | None:
    at = 2
    orientation = 1
    while at + 4 <= len(data):
        if data[at] != 0xFF:
            return None
        marker = data[at + 1]
        if marker == 0xFF:
            at += 1
            continue
        if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7:
            at += 2
            continue
        length = int.from_bytes(data[at + 2 : at + 4], "big")
        segment = data[at + 4 : at + 2 + length]
        if marker == 0xE1 and segment.startswith(b"Exif\x00\x00"):
            found = _exif_orientation(segment[6:])
            if found is None:
                return None
            orientation = found
        elif marker in _SOF:
            if len(segment) < 5:
                return None
            height, width = struct.unpack(">HH", segment[1:5])
            return (height, width) if orientation in _SWAPPING else (width, height)
        elif marker == 0xDA:
            return None  # scan data before any frame header
        at += 2 + length
    return None


def _webp(data: _Data) -> tuple[int, int] | None:
    kind = data[12:16]
    if kind == b"VP8 " and len(data) >= 30 and data[23:26] == b"\x9d\x01\x2a":
        width, height = struct.unpack("<HH", data[26:30])
        return width & 0x3FFF, height & 0x3FFF
    if kind == b"VP8L" and len(data) >= 25 and data[20] == 0x2F:
        bits = int.from_bytes(data[21:25], "little")
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    if kind == b"VP8X" and len(data) >= 30:
        if data[20] & 0x08:  # EXIF present: Pillow may rotate
            return None
        return int.from_bytes(data[24:27], "little") + 1, int.from_bytes(data[27:30], "little") + 1
    return None


def image_size(data: bytes | Base64Bytes, complete: bool = True) -> tuple[int, int] | None:
    """``(width, height)`` in pixels as vLLM will see the image, or ``None``.
    ``complete``: ``data`` is the whole file (else its first bytes). Raises
    ``binascii.Error`` where a :class:`Base64Bytes` read meets a character that is not
    base64."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return _png(data, complete)
    if data.startswith(b"\xff\xd8"):
        return _jpeg(data)
    if data[:6] in (b"GIF87a", b"GIF89a") and len(data) >= 10:
        width, height = struct.unpack("<HH", data[6:10])
        return width, height
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return _webp(data)
    if data[:2] == b"BM" and len(data) >= 26:
        width, height = struct.unpack("<ii", data[18:26])
        return width, abs(height)
    return None
