"""Block keys of media prompts (:mod:`cortex.gateway.routing.media`, pure but for the encode
callback): exact media keys for a keyed Qwen-VL image, the plain prefix otherwise — found
from the placeholders, or from a sentinel rendering when the ids do not show them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from cortex.chat import ChatTokenizer, RenderArgs
from cortex.gateway.config.gateway import GatewayConfig
from cortex.gateway.request.payload import InferencePath, InferenceRequest, parse_request
from cortex.gateway.routing.media import media_keys

pytestmark = pytest.mark.timeout(30)

DATA = Path(__file__).parents[2] / "chat" / "data"
QWEN = DATA / "qwen3.5"
PNG = next(r for r in json.loads((DATA / "media_vllm_reference.json").read_text())["images"]
           if r["name"] == "png-100x60")
VSTART = 248053


@pytest.fixture(scope="module")
def chat() -> ChatTokenizer:
    return ChatTokenizer.load(QWEN)


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("vl")
    for name in ("tokenizer.json.gz", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(QWEN / name, out / name)
    (out / "config.json").write_text(json.dumps({
        "model_type": "qwen2_5_vl", "image_token_id": 248056, "video_token_id": 248057,
        "vision_config": {"patch_size": 14, "spatial_merge_size": 2}}))
    (out / "preprocessor_config.json").write_text(json.dumps(
        {"min_pixels": 3136, "max_pixels": 1003520}))
    return out


def request(tokenizer: Path, engine: str, *parts: dict[str, Any]) -> InferenceRequest:
    cfg = GatewayConfig.from_mapping({"models": [
        {"name": "m", "engine": engine, "tokenizer": str(tokenizer)}]})
    body = {"model": "m", "messages": [
        {"role": "system", "content": "You describe pictures. " * 8},
        {"role": "user", "content": [{"type": "text", "text": "What is this?"}, *parts]}]}
    return parse_request(InferencePath.CHAT, body, cfg)


IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + PNG["b64"]}}
URL = {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}


async def test_keys_of_a_keyed_image_cover_the_whole_prompt(chat: ChatTokenizer,
                                                           vl_dir: Path) -> None:
    req = request(vl_dir, "vllm", IMAGE)
    assert req.prompt.chat is not None
    ids = chat.encode_chat(req.prompt.chat)

    async def never(args: RenderArgs) -> list[int]:
        raise AssertionError("no second rendering is needed")

    keys, query, tokens = await media_keys(req, ids, never)
    assert tokens == len(ids) - 1 + PNG["qwen2_5_vl_tokens"]
    assert len(keys) == tokens // 16 and query == (tokens - 1) // 16
    plain = req.model.domain.keys(ids)
    first = ids.index(VSTART) + 1  # the first image pad
    assert keys[: first // 16] == plain[: first // 16]


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
async def test_otherwise_only_the_plain_prefix_is_keyed(chat: ChatTokenizer, vl_dir: Path,
                                                        engine: str) -> None:
    asked: list[RenderArgs] = []

    async def encode(args: RenderArgs) -> list[int]:
        asked.append(args)
        return chat.encode_chat(args)

    for tokenizer, parts, second in ((vl_dir, (IMAGE, URL), False), (QWEN, (IMAGE,), True)):
        req = request(tokenizer, engine, *parts)
        assert req.prompt.chat is not None
        ids = chat.encode_chat(req.prompt.chat)
        asked.clear()
        keys, query, tokens = await media_keys(req, ids, encode)
        assert bool(asked) is second  # the sentinel rendering only without known placeholders
        first = ids.index(VSTART) + (0 if second else 1)
        assert keys == req.model.domain.keys(ids[:first]) and query == len(keys)
        assert tokens == len(ids) and len(keys) == first // 16 > 0
    assert await media_keys(req, [], encode) == ([], 0, 0)


@pytest.mark.parametrize("known", [True, False])
async def test_generate_with_image_data_keys_only_the_text_before_the_image(
        chat: ChatTokenizer, vl_dir: Path, known: bool) -> None:
    """SGLang's ``/generate`` with ``image_data``: the engine replaces the placeholder run by
    ids of its own hash of the image, so two requests with the same text and other images
    share only the text before it — never the key of the text after it (which the gateway
    would otherwise credit from its own predictions of the first)."""
    cfg = GatewayConfig.from_mapping({"models": [
        {"name": "m", "engine": "sglang", "tokenizer": str(vl_dir if known else QWEN)}]})
    text = ("You describe pictures. " * 8 + "<|vision_start|><|image_pad|><|vision_end|>"
            + " What is this? Answer in one long sentence please. " * 4)
    body = {"text": text, "image_data": "data:image/png;base64," + PNG["b64"],
            "sampling_params": {"max_new_tokens": 4}}
    req = parse_request(InferencePath.GENERATE, body, cfg)
    assert [i.modality.value for i in req.prompt.media] == ["image"]
    assert not any(i.keyed for i in req.prompt.media)
    ids = chat.encode_text(text)

    async def never(args: RenderArgs) -> list[int]:
        raise AssertionError("a /generate prompt is not rendered")

    keys, query, tokens = await media_keys(req, ids, never)
    first = ids.index(VSTART + 3)  # the image pad
    expected = req.model.domain.keys(ids[:first]) if known else []
    assert keys == expected and query == len(keys) and tokens == len(ids)
    assert len(req.model.domain.keys(ids)) > len(keys) + 2  # the text after it is not keyed
    plain = parse_request(InferencePath.GENERATE, {"text": text}, cfg)
    assert plain.prompt.media == ()
