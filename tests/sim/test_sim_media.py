"""The simulated vLLM's media (pure): placeholder runs identified by the part's ``uuid``, the
identifiers in the block hashes (vLLM 0.32's tagged extra keys) and in the published
``extra_keys``; different images never share a block past the first placeholder."""

from __future__ import annotations

import json
from pathlib import Path

from cortex.chat.vision import VisionConfig
from cortex.hashing import Engine, MediaSpan, vllm_block_hashes, vllm_event_int, vllm_hash_extras
from cortex.kvevents import codec
from cortex.sim.cache import BlocksStored, PrefixCache
from cortex.sim.engine import EngineHasher
from cortex.sim.protocol import engine_media
from cortex.sim.publisher import EventEncoder

B = 16
PAD = 248056
VISION = VisionConfig("qwen2_5_vl", PAD, PAD + 1, 14, 2, 3136, 1003520)
PNG = next(r for r in json.loads((Path(__file__).parents[1] / "chat" / "data"
                                  / "media_vllm_reference.json").read_text())["images"]
           if r["name"] == "png-100x60")


def _body(uuid: str | None) -> dict[str, object]:
    part: dict[str, object] = {"type": "image_url",
                               "image_url": {"url": "data:image/png;base64," + PNG["b64"]}}
    if uuid is not None:
        part["uuid"] = uuid
    return {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}, part]}]}


def test_engine_media_expands_and_identifies() -> None:
    ids = [1] * 20 + [PAD] + [2] * 30
    expanded, spans = engine_media(_body("img-a"), ids, VISION)
    assert spans == (MediaSpan("img-a", 20, 8),) and len(expanded) == len(ids) + 7
    _, own = engine_media(_body(None), ids, VISION)
    assert own[0].identifier.startswith("b64-sha256:")  # the data URL's text, as the gateway
    assert engine_media(_body("a"), ids, None) == (ids, ())
    assert engine_media(_body("a"), [1] * 8, VISION) == ([1] * 8, ())  # no placeholder


def test_identifiers_key_the_blocks_and_reach_the_events() -> None:
    ids = [1] * 20 + [PAD] + [2] * 30
    prompt, spans_a = engine_media(_body("a"), ids, VISION)
    _, spans_b = engine_media(_body("b"), ids, VISION)
    cache = PrefixCache(64, B, EngineHasher(Engine.VLLM, B))
    lease = cache.admit(prompt, len(prompt), media=spans_a)
    assert lease is not None
    cache.commit(lease, prompt)
    cache.release(lease)
    stored = [e for e in cache.drain_events() if isinstance(e, BlocksStored)]
    assert stored and stored[0].media == ((), (("a", 4),), ())  # a run of 8 at token 20
    extras = [vllm_hash_extras(p) for p in stored[0].media]
    expect = vllm_block_hashes(prompt[: 3 * B], B, extra_keys=extras)
    assert stored[0].block_hashes == tuple(vllm_event_int(h) for h in expect)
    assert cache.lookup(prompt, media=spans_a) == 3 * B
    assert cache.lookup(prompt, media=spans_b) == B  # only the text block before the image
    event = EventEncoder(Engine.VLLM, "0.33.0").convert(stored[0])
    assert isinstance(event, codec.BlockStored) and event.extra_keys == (None, (("a", 4),), None)
