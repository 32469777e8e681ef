"""The multimodal workload's model: a Qwen2.5-VL-shaped model directory and its prompts.

The workers of the ``multimodal`` workload are vLLM sims serving a Qwen2.5-VL-shaped model:
the Qwen3.5 tokenizer and chat template the project's tests hold (its template writes an
image part as ``<|vision_start|><|image_pad|><|vision_end|>``) beside a ``config.json`` and a
``preprocessor_config.json`` with Qwen2.5-VL's image settings (patch 14, merge 2: one
placeholder token per 28 x 28 pixels). The sims, the gateway and this module all read that
directory; no weights are involved.

:class:`VisionPrompts` computes each request's prompt as the engine does — rendered by the
vLLM rules, every image placeholder expanded to its run, the run identified by the image —
using the sim's own expansion (:func:`cortex.sim.protocol.engine_media`), so the
benchmark's bounds and prompt-token checks are those of the workers, not of the gateway.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Sequence
from pathlib import Path

from cortex.bench.routing.bounds import MediaRun
from cortex.bench.routing.workloads import Request

__all__ = ["QWEN_DIR", "QWEN_VL_CONFIG", "QWEN_VL_PREPROCESSOR", "VisionPrompts",
           "write_vision_model"]

QWEN_DIR = Path(__file__).resolve().parents[4] / "tests" / "chat" / "data" / "qwen3.5"
"""The Qwen3.5 tokenizer and chat template (the project's test data)."""
_IMAGE_PAD = "<|image_pad|>"
_VIDEO_PAD = "<|video_pad|>"
QWEN_VL_CONFIG = {"model_type": "qwen2_5_vl",
                  "vision_config": {"patch_size": 14, "spatial_merge_size": 2}}
"""``config.json`` beside the tokenizer (the placeholder ids are added from the vocabulary)."""
QWEN_VL_PREPROCESSOR = {"min_pixels": 3136, "max_pixels": 1003520, "patch_size": 14,
                        "merge_size": 2, "temporal_patch_size": 2}
"""Qwen2.5-VL's image processor settings (``preprocessor_config.json``)."""


def write_vision_model(out: Path, source: Path = QWEN_DIR) -> Path:
    """Write the model directory into ``out`` (created) and return it: the tokenizer
    (``tokenizer.json``, decompressed), its config and template, ``config.json`` with the
    vocabulary's image and video placeholder ids, ``preprocessor_config.json``."""
    out.mkdir(parents=True, exist_ok=True)
    raw = gzip.decompress((source / "tokenizer.json.gz").read_bytes())
    (out / "tokenizer.json").write_bytes(raw)
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        (out / name).write_bytes((source / name).read_bytes())
    added = {t["content"]: t["id"] for t in json.loads(raw).get("added_tokens", [])}
    if _IMAGE_PAD not in added:
        raise ValueError(f"{source}: the tokenizer has no {_IMAGE_PAD} token")
    config = {**QWEN_VL_CONFIG, "image_token_id": added[_IMAGE_PAD],
              "video_token_id": added.get(_VIDEO_PAD)}
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n", encoding="utf-8")
    (out / "preprocessor_config.json").write_text(
        json.dumps(QWEN_VL_PREPROCESSOR, indent=1) + "\n", encoding="utf-8")
    return out


class VisionPrompts:
    """The prompt a vLLM sim serving the model in ``model_dir`` computes for a request."""

    def __init__(self, model_dir: Path, model: str) -> None:
        from cortex.chat import ChatTokenizer
        from cortex.chat.vision import load_vision_config

        self._chat = ChatTokenizer.load(model_dir)
        self.tokenizer = self._chat.tokenizer
        self._vision = load_vision_config(model_dir)
        if self._vision is None:
            raise ValueError(f"{model_dir}: not a supported vision-language model")
        self._model = model

    def encode_text(self, text: str) -> list[int]:
        ids: list[int] = self._chat.encode_text(text)
        return ids

    def encode_chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        from cortex.chat import RenderArgs
        from cortex.hashing import Engine

        ids: list[int] = self._chat.encode_chat(RenderArgs.of(Engine.VLLM, messages))
        return ids

    def encode_media(self, request: Request) -> tuple[list[int], Sequence[MediaRun]]:
        """The request's prompt ids with every image's run expanded, and the runs."""
        from cortex.chat import render_args
        from cortex.hashing import Engine
        from cortex.sim.protocol import engine_media

        body = request.body(self._model)
        ids = self._chat.encode_chat(render_args(body, Engine.VLLM))
        expanded, runs = engine_media(body, ids, self._vision)
        if len(runs) != len(request.images):
            raise ValueError(f"request {request.id}: {len(request.images)} images, "
                             f"{len(runs)} placeholder runs in the engine's prompt")
        return expanded, runs

    def __repr__(self) -> str:
        return f"VisionPrompts({self._chat!r}, {self._vision!r})"
