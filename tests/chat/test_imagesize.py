"""Image header sizes against the size vLLM 0.32 sees (Pillow plus EXIF orientation; golden
vectors from ``tools/realengines/media_reference.py``), and Qwen-VL placeholder counts."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest

from cortex.chat.imagesize import image_size
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
