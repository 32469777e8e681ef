"""Qwen-VL processor settings from a model directory, and smart_resize's edge cases."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cortex.chat.vision import VisionConfig, load_vision_config, smart_resize

PAD = 248056
QWEN3 = VisionConfig("qwen3_vl", PAD, 248057, 16, 2, 65536, 16777216)


def test_load_vision_config(tmp_path: Path) -> None:
    assert load_vision_config(tmp_path) is None
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "qwen3_vl", "image_token_id": PAD, "video_token_id": 248057,
        "vision_config": {"patch_size": 16, "spatial_merge_size": 2}}))
    with pytest.raises(ValueError, match="preprocessor_config"):
        load_vision_config(tmp_path)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(
        {"size": {"shortest_edge": 65536, "longest_edge": 16777216}}))
    assert load_vision_config(tmp_path) == QWEN3
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert load_vision_config(tmp_path) is None


def test_smart_resize_bounds_and_refusals() -> None:
    assert smart_resize(60, 100, 28, 3136, 1003520) == (56, 112)
    assert smart_resize(10, 10, 28, 3136, 1003520) == (56, 56)  # grown to the minimum area
    h, w = smart_resize(2000, 3000, 28, 3136, 1003520)
    assert h * w <= 1003520 and h % 28 == w % 28 == 0
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(1, 201, 28, 3136, 1003520)
    assert QWEN3.image_tokens(1, 201) is None and QWEN3.image_tokens(0, 5) is None
