"""A vision-language model's processor settings → placeholder tokens per image (pure).

Families whose image placeholder count the gateway computes exactly, as vLLM 0.32 does
(``model_executor/models/qwen2_vl.py::Qwen2VLProcessingInfo._get_vision_info``, which calls
``transformers``' ``qwen2_vl`` ``smart_resize``), for images (one frame):

- **Qwen2-VL, Qwen2.5-VL, Qwen3-VL** (``model_type`` ``qwen2_vl``, ``qwen2_5_vl``, ``qwen3_vl``,
  ``qwen3_vl_moe``): the image is resized to multiples of ``patch_size * merge_size`` pixels
  with its area kept within ``[shortest_edge, longest_edge]`` pixels, then covered by
  ``patch_size`` patches merged ``merge_size x merge_size`` into one token:
  ``tokens = (h / patch / merge) * (w / patch / merge)``.

Settings are read from the model directory: ``config.json`` (``vision_config.patch_size``,
``spatial_merge_size``, ``image_token_id``) and ``preprocessor_config.json`` (``size``, or
``min_pixels`` / ``max_pixels``, which win as in vLLM's ``_get_vision_size``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["QWEN_VL_TYPES", "VisionConfig", "load_vision_config", "smart_resize"]

QWEN_VL_TYPES = frozenset({"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"})
_DEFAULT_MIN_PIXELS = 56 * 56
_DEFAULT_MAX_PIXELS = 28 * 28 * 1280


def smart_resize(height: int, width: int, factor: int, min_pixels: int,
                 max_pixels: int) -> tuple[int, int]:
    """``(height, width)`` in pixels after Qwen-VL's resize: both multiples of ``factor``,
    the area within ``[min_pixels, max_pixels]``, the aspect ratio about kept. Raises
    ``ValueError`` for an aspect ratio over 200 (the processor refuses those)."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"aspect ratio over 200: {width}x{height}")
    h_bar = round(height / factor) * factor  # round half to even, as Python's round
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass(frozen=True, slots=True)
class VisionConfig:
    """A Qwen-VL-family model's image settings (pixels, tokens)."""

    model_type: str
    image_token_id: int
    video_token_id: int | None = None
    patch_size: int = 14
    merge_size: int = 2
    min_pixels: int = _DEFAULT_MIN_PIXELS
    max_pixels: int = _DEFAULT_MAX_PIXELS

    def __post_init__(self) -> None:
        if self.patch_size < 1 or self.merge_size < 1 or not 0 < self.min_pixels <= self.max_pixels:
            raise ValueError(f"invalid vision settings: {self}")

    @property
    def placeholder_ids(self) -> frozenset[int]:
        """Token ids the template writes for a media item (image, video)."""
        ids = {self.image_token_id}
        if self.video_token_id is not None:
            ids.add(self.video_token_id)
        return frozenset(ids)

    def image_tokens(self, width: int, height: int) -> int | None:
        """Placeholder tokens of a ``width`` x ``height`` image (``None``: one the
        processor refuses)."""
        if width < 1 or height < 1:
            return None
        factor = self.patch_size * self.merge_size
        try:
            h, w = smart_resize(height, width, factor, self.min_pixels, self.max_pixels)
        except ValueError:
            return None
        return (h // self.patch_size) * (w // self.patch_size) // (self.merge_size ** 2)


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def load_vision_config(model_dir: str | Path) -> VisionConfig | None:
    """The image settings of the model in ``model_dir`` (``config.json`` and
    ``preprocessor_config.json``), or ``None`` when it is not of a supported family.
    Raises ``ValueError`` for a supported family whose settings are unreadable."""
    base = Path(model_dir)
    if base.is_file():
        base = base.parent
    try:
        config = json.loads((base / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    model_type = config.get("model_type")
    if model_type not in QWEN_VL_TYPES:
        return None
    vision = config.get("vision_config") or {}
    try:
        pre = json.loads((base / "preprocessor_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{base}: a {model_type} model needs preprocessor_config.json") from exc
    size = pre.get("size") if isinstance(pre.get("size"), dict) else {}
    min_pixels = _int(pre.get("min_pixels")) or _int(size.get("shortest_edge"))
    max_pixels = _int(pre.get("max_pixels")) or _int(size.get("longest_edge"))
    image_token = _int(config.get("image_token_id"))
    if image_token is None:
        raise ValueError(f"{base}/config.json: no image_token_id")
    return VisionConfig(
        model_type=model_type, image_token_id=image_token,
        video_token_id=_int(config.get("video_token_id")),
        patch_size=_int(vision.get("patch_size")) or _int(pre.get("patch_size")) or 14,
        merge_size=_int(vision.get("spatial_merge_size")) or _int(pre.get("merge_size")) or 2,
        min_pixels=min_pixels or _DEFAULT_MIN_PIXELS,
        max_pixels=max_pixels or _DEFAULT_MAX_PIXELS,
    )
