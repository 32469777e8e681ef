"""Media parts at the gateway's edge (pure): never refused; a vLLM model gets each image's
identifier written into its part as ``uuid`` (and the body re-serialized for the engine); a
model directory of a Qwen-VL family gives the placeholder runs; a bad ``model_dir`` is a
configuration error."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from cortex.chat.media import Modality
from cortex.gateway.config.gateway import GatewayConfig
from cortex.gateway.dispatch.dispatcher import upstream_body
from cortex.gateway.errors import ConfigError
from cortex.gateway.request.payload import (
    InferencePath,
    InferenceRequest,
    generate_media,
    parse_body,
    parse_request,
)

pytestmark = pytest.mark.timeout(10)

DATA = Path(__file__).parents[2] / "chat" / "data"
REFERENCE = json.loads((DATA / "media_vllm_reference.json").read_text())
PNG = next(r for r in REFERENCE["images"] if r["name"] == "png-100x60")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("qwen-vl")
    for name in ("tokenizer.json.gz", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(DATA / "qwen3.5" / name, out / name)
    (out / "config.json").write_text(json.dumps({
        "model_type": "qwen2_5_vl", "image_token_id": 248056, "video_token_id": 248057,
        "vision_config": {"patch_size": 14, "spatial_merge_size": 2}}))
    (out / "preprocessor_config.json").write_text(json.dumps(
        {"min_pixels": 3136, "max_pixels": 1003520}))
    return out


def config(model_dir: Path | None, engine: str = "vllm") -> GatewayConfig:
    model: dict[str, Any] = {"name": "vl", "engine": engine}
    if model_dir is not None:
        model["model_dir"] = str(model_dir)
    return GatewayConfig.from_mapping({"models": [model]})


def body(*parts: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"model": "vl", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is it?"}, *parts]}], **extra}


IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + PNG["b64"]}}


def parse(cfg: GatewayConfig, payload: dict[str, Any]) -> tuple[InferenceRequest, bytes]:
    raw = json.dumps(payload).encode()
    return parse_request(InferencePath.CHAT, parse_body(raw), cfg), raw


def test_vllm_images_get_their_identifier_as_uuid(model_dir: Path) -> None:
    req, raw = parse(config(model_dir), body(IMAGE, {"type": "video_url",
                                                     "video_url": {"url": "https://v"}}))
    image, video = req.prompt.media
    digest = hashlib.sha256(PNG["b64"].encode()).hexdigest()
    assert image.modality is Modality.IMAGE and image.tokens == PNG["qwen2_5_vl_tokens"]
    assert image.identifier == "b64-sha256:" + digest
    assert video.modality is Modality.VIDEO and video.identifier is None
    assert req.prompt.stamped
    sent = json.loads(upstream_body(req, raw))
    assert sent["messages"][0]["content"][1]["uuid"] == image.identifier
    assert "uuid" not in sent["messages"][0]["content"][2]


def test_nothing_is_refused_or_stamped_without_a_known_family() -> None:
    for engine in ("vllm", "sglang"):
        req, raw = parse(config(None, engine), body(IMAGE, {"type": "input_audio",
                                                            "input_audio": {}}))
        assert [i.modality for i in req.prompt.media] == [Modality.IMAGE, Modality.AUDIO]
        assert req.prompt.media[0].tokens is None
        assert req.prompt.stamped is (engine == "vllm")  # bytes are identified anyway
        if engine == "sglang":
            assert upstream_body(req, raw) == raw  # SGLang's routes take no uuid


def test_processor_kwargs_leave_the_identifier_to_the_engine(model_dir: Path) -> None:
    req, raw = parse(config(model_dir), body(IMAGE, mm_processor_kwargs={"max_pixels": 5000}))
    assert req.prompt.media[0].identifier is None and not req.prompt.stamped
    assert upstream_body(req, raw) == raw


def test_a_model_dir_of_a_vl_family_needs_its_processor_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_vl"}))
    with pytest.raises(ConfigError, match="model_dir"):
        config(tmp_path)
    assert config(None).models[0].vision is None


def test_generate_media_counts_the_first_prompts_items() -> None:
    assert generate_media({"text": "x"}) == ()
    one = generate_media({"image_data": "https://x/a.png"})
    assert [(i.modality.value, i.keyed) for i in one] == [("image", False)]
    many = generate_media({"image_data": ["a", "b"], "audio_data": {"url": "c"}})
    assert [i.modality.value for i in many] == ["image", "image", "audio"]
    batch = generate_media({"image_data": [["a", "b", "c"], ["d"]], "video_data": [None]})
    assert [i.modality.value for i in batch] == ["image"] * 3
    assert len({(i.message, i.part) for i in many}) == 3
