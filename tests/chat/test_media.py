"""Media items: identifiers (vLLM takes a ``uuid`` verbatim: golden vectors from vLLM 0.32's own
code, ``tools/realengines/media_reference.py``), stamping, the expanded prompt, the plain
prefix a sentinel rendering finds."""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from cortex.chat import ChatTokenizer, render_args
from cortex.chat.media import (
    MediaItem,
    MediaPrompt,
    Modality,
    common_prefix,
    media_items,
    media_prompt,
    stamp_identifiers,
)
from cortex.chat.request import sentinel_args
from cortex.chat.vision import VisionConfig
from cortex.hashing import (
    Engine,
)

DATA = Path(__file__).parent / "data"
REFERENCE = json.loads((DATA / "media_vllm_reference.json").read_text())
QWEN = DATA / "qwen3.5"
PAD, VSTART = 248056, 248053
QWEN25 = VisionConfig("qwen2_5_vl", PAD, 248057, 14, 2, 3136, 1003520)
QWEN3 = VisionConfig("qwen3_vl", PAD, 248057, 16, 2, 65536, 16777216)


@pytest.fixture(scope="module")
def chat() -> ChatTokenizer:
    return ChatTokenizer.load(QWEN)


def _images() -> list[dict[str, Any]]:
    return list(REFERENCE["images"])





def test_vllm_takes_the_uuid_verbatim_only_without_processor_kwargs() -> None:
    ids = REFERENCE["identifiers"]
    assert ids["identifier"] == ids["uuid"]
    assert ids["identifier_with_processor_kwargs"] != ids["uuid"]
    body = {"mm_processor_kwargs": {"max_pixels": 1}, "messages": [
        {"role": "user", "content": [_image_part(0)]}]}
    assert media_items(body, QWEN25) == (MediaItem(0, 0, Modality.IMAGE),)



def _image_part(index: int, fmt: str = "png") -> dict[str, Any]:
    row = next(r for r in _images() if r["name"].startswith(fmt))
    data = base64.b64decode(row["b64"])
    if index:
        data = data + bytes([index])  # other bytes, same header: another image
    url = f"data:image/{fmt};base64," + base64.b64encode(data).decode()
    return {"type": "image_url", "image_url": {"url": url}}


def _body(*parts: dict[str, Any]) -> dict[str, Any]:
    return {"model": "m", "messages": [
        {"role": "system", "content": "You look at pictures."},
        {"role": "user", "content": [{"type": "text", "text": "What is this?"}, *parts]}]}


def test_items_identifiers_and_stamping() -> None:
    body = _body(_image_part(0), _image_part(1), _image_part(0),
                 {"type": "image_url", "image_url": {"url": "https://x/y.png"}},
                 {"type": "image_url", "image_url": {"url": "data:,x"}, "uuid": "mine"},
                 {"type": "video_url", "video_url": {"url": "https://x/v.mp4"}})
    items = media_items(body, QWEN25)
    assert [i.modality for i in items] == [Modality.IMAGE] * 5 + [Modality.VIDEO]
    assert items[0].identifier == items[2].identifier != items[1].identifier
    assert items[0].tokens == 8 and items[0].keyed
    assert items[3].identifier is None  # URLs are not immutable unless configured
    immutable = media_items(body, QWEN25, immutable_urls=True)[3]
    assert str(immutable.identifier).startswith("url-") and immutable.url == "https://x/y.png"
    assert items[3].url is None and items[0].url is None  # no header read without it
    sized = immutable.sized((56, 28), QWEN25)  # a header read gave the size: keyed
    assert sized.keyed and sized.tokens == QWEN25.image_tokens(56, 28)
    assert immutable.sized(None, QWEN25) == immutable
    assert items[5].sized((56, 28), QWEN25) == items[5]  # a video's run is not an image's
    assert items[4].identifier == "mine" and not items[4].stamp and items[4].tokens is None
    stamp_identifiers(body, items)
    parts = body["messages"][1]["content"]
    assert parts[1]["uuid"] == items[0].identifier and "uuid" not in parts[4]
    assert parts[5]["uuid"] == "mine"


def test_media_prompt_expands_the_rendered_placeholders(chat: ChatTokenizer) -> None:
    body = _body(_image_part(0), {"type": "text", "text": "and"}, _image_part(1))
    ids = chat.encode_chat(render_args(body, Engine.VLLM))
    assert ids.count(PAD) == 2
    items = media_items(body, QWEN25)
    prompt = media_prompt(ids, items, QWEN25)
    first = ids.index(PAD)
    assert prompt.plain_tokens == first and ids[first - 1] == VSTART
    assert prompt.spans is not None and [s.length for s in prompt.spans] == [8, 8]
    assert len(prompt.ids) == len(ids) + 14
    assert prompt.spans[0].offset == first
    assert prompt.ids[prompt.spans[1].offset : prompt.spans[1].offset + 8] == [PAD] * 8
    # an item without a size (a URL): nothing past the first placeholder is exact
    url = _body(_image_part(0), {"type": "image_url", "image_url": {"url": "https://x"}})
    partial = media_prompt(chat.encode_chat(render_args(url, Engine.VLLM)),
                           media_items(url, QWEN25, immutable_urls=True), QWEN25)
    assert partial.spans is None and partial.plain_tokens == first


@pytest.mark.parametrize("engine", [Engine.VLLM, Engine.SGLANG])
def test_sentinel_rendering_finds_the_plain_prefix(chat: ChatTokenizer, engine: Engine) -> None:
    body = _body(_image_part(0))
    args = render_args(body, engine)
    ids = chat.encode_chat(args)
    other = chat.encode_chat(sentinel_args(args))
    assert common_prefix(ids, other) == ids.index(VSTART)


def test_placeholders_the_ids_do_not_show_leave_the_prefix_unknown(chat: ChatTokenizer) -> None:
    # a string-content template: vLLM writes its own placeholder strings before the text
    body = _body(_image_part(0))
    text_only = chat.encode_chat(render_args(_body(), Engine.VLLM))
    items = media_items(body, QWEN25)
    assert media_prompt(text_only, items, QWEN25).plain_tokens is None
    assert media_prompt(text_only, items, None).plain_tokens is None
    assert media_prompt([], items, QWEN25) == MediaPrompt([], None, None)


@pytest.mark.parametrize("row", _images(), ids=lambda r: r["name"])
def test_a_data_url_is_identified_by_its_text_and_sized_as_vllm_sizes_it(
        row: dict[str, Any]) -> None:
    """The identifier hashes the base64 text (never decoded whole); the placeholder count
    from the header read through it is vLLM 0.32's for the decoded image."""
    fmt = row["name"].split("-")[0]
    url = f"data:image/{fmt};base64," + row["b64"]
    body = _body({"type": "image_url", "image_url": {"url": url}})
    (item,) = media_items(body, QWEN25)
    assert item.identifier == "b64-sha256:" + hashlib.sha256(row["b64"].encode()).hexdigest()
    assert item.tokens == row["qwen2_5_vl_tokens"] and item.stamp
    (item,) = media_items(body, QWEN3)
    assert item.tokens == row["qwen3_vl_tokens"]


def test_a_data_url_that_is_not_strict_base64_is_not_keyed() -> None:
    b64 = _images()[0]["b64"]
    for text in (b64[:40] + "\n" + b64[40:],  # a URL parser drops it; the text is not the bytes'
                 b64[:-1],  # not whole groups
                 "!" + b64[1:],  # the header is not base64
                 b64[:40] + "é" + b64[41:]):
        (item,) = media_items(_body({"type": "image_url",
                                     "image_url": {"url": "data:image/png;base64," + text}}),
                              QWEN25)
        assert not item.keyed, text[:50]
