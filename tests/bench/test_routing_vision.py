"""The multimodal workload's model directory and its prompts as the vLLM sim computes them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cortex.bench.routing.bounds import page_keys, shape_prompts
from cortex.bench.routing.vision import QWEN_DIR, VisionPrompts, write_vision_model
from cortex.bench.routing.workloads import Endpoint, Request, png_data_url
from cortex.chat.vision import load_vision_config
from cortex.hashing import MediaSpan

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def prompts(tmp_path_factory: pytest.TempPathFactory) -> VisionPrompts:
    return VisionPrompts(write_vision_model(tmp_path_factory.mktemp("vl") / "model"), "m")


def test_the_model_directory_names_the_tokenizers_placeholders(tmp_path: Path) -> None:
    out = write_vision_model(tmp_path / "m")
    config = json.loads((out / "config.json").read_text())
    vocab = json.loads((out / "tokenizer.json").read_text())["added_tokens"]
    ids = {t["content"]: t["id"] for t in vocab}
    assert config["image_token_id"] == ids["<|image_pad|>"]
    assert config["video_token_id"] == ids["<|video_pad|>"]
    vision = load_vision_config(out)
    assert vision is not None and vision.image_tokens(224, 224) == 64
    assert (out / "chat_template.jinja").read_bytes() == (
        QWEN_DIR / "chat_template.jinja").read_bytes()


def _ask(rid: int, image: str, question: str = "what is shown here") -> Request:
    return Request(rid, Endpoint.CHAT, 4, 0.0, messages=(
        ("system", "you are a careful visual assistant " * 4), ("user", question)),
        images=((1, image),))


def test_an_image_is_expanded_to_its_run_and_keyed_by_its_bytes(prompts: VisionPrompts) -> None:
    a, b = png_data_url(224, 224, 1), png_data_url(224, 224, 2)
    ids_a, runs_a = prompts.encode_media(_ask(0, a))
    ids_b, runs_b = prompts.encode_media(_ask(1, b))
    plain = prompts.encode_chat([{"role": "user", "content": "x"}])
    assert len(runs_a) == 1 and runs_a[0].length == 64
    assert ids_a == ids_b  # the same placeholder ids ...
    assert runs_a[0].identifier != runs_b[0].identifier  # ... for other bytes
    assert prompts.encode_media(_ask(2, a))[1] == runs_a
    assert len(ids_a) > 64 + len(plain)
    shapes = shape_prompts([_ask(0, a), _ask(1, b), _ask(2, a)], prompts.encode_text,
                           prompts.encode_chat, 16, prompts.encode_media)
    first = runs_a[0].offset // 16  # the pages before the image are shared
    assert shapes[0].pages[:first] == shapes[1].pages[:first]
    assert shapes[0].pages[first] != shapes[1].pages[first]
    assert shapes[0] == shapes[2]
    with pytest.raises(ValueError, match="encode_media"):
        shape_prompts([_ask(0, a)], prompts.encode_text, prompts.encode_chat, 16)


def test_page_keys_carry_the_media_items_they_overlap() -> None:
    ids = list(range(40))
    run = MediaSpan("img-a", 10, 12)  # tokens 10..21: pages 0 and 1 of 16
    plain = page_keys(ids, 16)
    keyed = page_keys(ids, 16, [run])
    assert len(plain) == len(keyed) == 2
    assert keyed != plain and keyed != page_keys(ids, 16, [MediaSpan("img-b", 10, 12)])
    assert page_keys(ids, 16, [MediaSpan("img-a", 32, 8)]) == plain  # past the full pages
