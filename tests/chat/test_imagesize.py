"""Image header sizes against the size vLLM 0.32 sees (Pillow plus EXIF orientation; golden
vectors from ``tools/realengines/media_reference.py``), and Qwen-VL placeholder counts."""

from __future__ import annotations

import base64
import binascii
import json
import random
from pathlib import Path
from typing import Any

import pytest

from cortex.chat.imagesize import Base64Bytes, image_size
from cortex.chat.vision import VisionConfig

REFERENCE = json.loads((Path(__file__).parent / "data" / "media_vllm_reference.json").read_text())
QWEN25 = VisionConfig("qwen2_5_vl", 248056, 248057, 14, 2, 3136, 1003520)
QWEN3 = VisionConfig("qwen3_vl", 248056, 248057, 16, 2, 65536, 16777216)


def _images() -> list[dict[str, Any]]:
    return list(REFERENCE["images"])


@pytest.mark.parametrize("row", _images(), ids=lambda r: r["name"])
def test_image_size_and_placeholders_match_vllm(row: dict[str, Any]) -> None:
    data = base64.b64decode(row["b64"])
    size = image_size(data)
    assert size == tuple(row["vllm_size"])
    assert QWEN25.image_tokens(*size) == row["qwen2_5_vl_tokens"]
    assert QWEN3.image_tokens(*size) == row["qwen3_vl_tokens"]


def test_unreadable_headers_are_unknown() -> None:
    assert image_size(b"") is None
    assert image_size(b"\x89PNG\r\n\x1a\n" + b"\0" * 8) is None
    assert image_size(b"\xff\xd8\xff\xda\0\2") is None  # scan before any frame header
    assert image_size(b"not an image") is None
    png = base64.b64decode(_images()[0]["b64"])
    exif = png[:-12] + b"\0\0\0\0eXIf\0\0\0\0" + png[-12:]  # Pillow would rotate by it
    assert image_size(exif) is None


@pytest.mark.parametrize("row", _images(), ids=lambda r: r["name"])
def test_a_header_read_gives_the_whole_files_size_or_none(row: dict[str, Any]) -> None:
    """The first bytes of a file (a URL image's header read) never give another size than the
    whole file; 1 KiB is enough for every reference image but those with an EXIF block."""
    data = base64.b64decode(row["b64"])
    for cut in (16, 30, 64, 200, 1024):
        found = image_size(data[:cut], complete=False)
        assert found is None or found == tuple(row["vllm_size"]), cut


def test_a_partial_png_counts_only_once_its_first_idat_is_read() -> None:
    png = base64.b64decode(next(r["b64"] for r in _images() if r["name"].startswith("png")))
    idat = png.index(b"IDAT") - 4
    assert image_size(png[:idat], complete=False) is None  # an eXIf chunk could follow
    assert image_size(png[:idat + 8], complete=False) == image_size(png)
    assert image_size(png[:idat]) == image_size(png)  # the whole file: no chunk follows


def test_base64_bytes_reads_what_decoding_gives() -> None:
    """Every index and slice of the lazy view equals the decoded bytes' (every padding)."""
    rng = random.Random(7)
    for n in (0, 1, 2, 3, 4, 5, 6, 31, 32, 33, 100):
        data = rng.randbytes(n)
        view = Base64Bytes(base64.b64encode(data))
        assert len(view) == n
        for a in range(-n - 2, n + 3):
            for b in range(-n - 2, n + 3):
                assert view[a:b] == data[a:b], (n, a, b)
            if -n <= a < n:
                assert view[a] == data[a]
            else:
                with pytest.raises(IndexError):
                    view[a]
        assert view.startswith(data[:3]) and not view.startswith(data[:3] + b"x" * 200)


def test_base64_bytes_refuses_what_is_not_strict_base64() -> None:
    with pytest.raises(ValueError):
        Base64Bytes(b"abcde")  # not whole 4-character groups
    view = Base64Bytes(b"ab*d" + b"A" * 8)
    with pytest.raises(binascii.Error):
        view[:3]
    assert view[3:] == bytes(6)  # what is never read is never checked


@pytest.mark.parametrize("row", _images(), ids=lambda r: r["name"])
def test_the_size_read_from_base64_text_is_the_decoded_files(row: dict[str, Any]) -> None:
    """The header walk over the base64 text (what the gateway does for a data URL) gives
    vLLM's size, and so its placeholder count: keys built on it are the engine's."""
    text = row["b64"].encode()
    assert image_size(Base64Bytes(text)) == image_size(base64.b64decode(text))
    assert image_size(Base64Bytes(text)) == tuple(row["vllm_size"])
    png = base64.b64decode(_images()[0]["b64"])
    exif = png[:-12] + b"\0\0\0\0eXIf\0\0\0\0" + png[-12:]  # an eXIf chunk after IDAT
    assert image_size(Base64Bytes(base64.b64encode(exif))) is None
