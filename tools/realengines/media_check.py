"""Real-engine check of Cortex's media keys against a running vLLM serving a Qwen-VL model.

Run with the project's Python against an engine started by the vLLM CPU harness on the tiny
Qwen2.5-VL-shaped model (``make_models.py --qwen-vl``)::

    .venv/bin/python tools/realengines/media_check.py --url http://127.0.0.1:8191 \\
        --events tcp://127.0.0.1:5691 --model-dir ~/.cache/realvllm/model-qwen-vl

It sends chat requests with images given as bytes, each part stamped with the identifier the
gateway gives it (``cortex.chat.media``), and compares what the gateway computes with what the
engine does: the expanded prompt length (``usage.prompt_tokens``), the stored blocks' tokens,
``extra_keys`` and engine hashes (KV events), the Cortex keys the ingest derives from those
events (a real :class:`~cortex.ingest.tracker.SourceTracker`) against the gateway's, and the
cached tokens of each request against the gateway's credit. Prints one JSON report; exits 1 on
any mismatch.
"""

from __future__ import annotations

import argparse
import base64
import json
import struct
import sys
import time
import urllib.request
import zlib
from pathlib import Path
from typing import Any

import zmq

from cortex.chat import ChatTokenizer, render_args
from cortex.chat.media import media_items, media_prompt, stamp_identifiers
from cortex.chat.vision import load_vision_config
from cortex.hashing import (
    Engine,
    HashDomain,
    media_block_keys,
    media_extra_keys,
    vllm_block_hashes,
    vllm_event_int,
    vllm_hash_extras,
)
from cortex.ingest.ops import SourceId
from cortex.ingest.tracker import SourceTracker, TrackerConfig
from cortex.kvevents import frames
from cortex.kvevents.codec import BlockStored, decode_batch
from cortex.ledger.model import StoreBlocks

BLOCK = 16
SYSTEM = "You are a careful visual assistant. Describe what you see in plain words. " * 3


def _png(width: int, height: int, shade: int) -> str:
    raw = b"".join(b"\x00" + bytes([shade, 90, 200 - shade]) * width for _ in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data)))

    data = (b"\x89PNG\r\n\x1a\n"
            + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))
    return "data:image/png;base64," + base64.b64encode(data).decode()


def _body(model: str, system: str, image: str, question: str) -> dict[str, Any]:
    return {"model": model, "max_tokens": 1, "temperature": 0, "messages": [
        {"role": "system", "content": system},
        {"role": "user", "content": [{"type": "text", "text": question},
                                     {"type": "image_url", "image_url": {"url": image}},
                                     {"type": "text", "text": "One word."}]}]}


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as resp:
        answer: dict[str, Any] = json.loads(resp.read())
        return answer


def _stores(sub: zmq.Socket[bytes], want_blocks: int, timeout_s: float
            ) -> list[tuple[int, bytes]]:
    """``(seq, payload)`` of the event batches until ``want_blocks`` blocks were stored (or
    the timeout)."""
    payloads: list[tuple[int, bytes]] = []
    seen = 0
    deadline = time.monotonic() + timeout_s
    while seen < want_blocks and time.monotonic() < deadline:
        if not sub.poll(200):
            continue
        message = frames.parse_pub(sub.recv_multipart())
        payloads.append((message.seq, message.payload))
        for event in decode_batch(message.payload, Engine.VLLM).events:
            if isinstance(event, BlockStored):
                seen += len(event.block_hashes)
    return payloads


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8191")
    ap.add_argument("--events", default="tcp://127.0.0.1:5691")
    ap.add_argument("--model-dir", type=Path, required=True)
    ap.add_argument("--model", default="tiny-qwen-vl")
    ap.add_argument("--out", type=Path, help="also write the JSON report here")
    args = ap.parse_args()
    vision = load_vision_config(args.model_dir)
    assert vision is not None, "not a Qwen-VL model directory"
    chat = ChatTokenizer.load(args.model_dir)
    domain = HashDomain("m", BLOCK, Engine.VLLM)
    tracker = SourceTracker(SourceId("real", 0), TrackerConfig(engine=Engine.VLLM, model="m",
                                                               block_size=BLOCK))
    tracker.start()
    tracker.on_connected()
    tracker.take_ops()
    sub: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(args.events)
    time.sleep(0.5)  # a SUB socket misses what is published before it has joined
    first, second = _png(300, 200, 20), _png(300, 200, 140)
    cases = [
        ("new image", SYSTEM, first, "What is in this picture?"),
        ("the same request again", SYSTEM, first, "What is in this picture?"),
        ("another image after the same text", SYSTEM, second, "What is in this picture?"),
        ("the first image in a new conversation", "Be terse. " * 12, first, "What is it?"),
        ("the first image, asked otherwise", SYSTEM, first, "Which colour is it?"),
    ]
    held: dict[int, int | bytes] = {}  # Cortex key -> engine hash (what the index holds)
    rows = []
    failures = []
    for name, system, image, question in cases:
        body = _body(args.model, system, image, question)
        items = media_items(body, vision)
        stamp_identifiers(body, items)
        ids = chat.encode_chat(render_args(body, Engine.VLLM))
        prompt = media_prompt(ids, items, vision)
        assert prompt.spans is not None
        media = media_extra_keys(prompt.spans, len(prompt.ids) // BLOCK, BLOCK)
        keys = media_block_keys(prompt.ids, BLOCK, domain.root_key(), media)
        query = keys[: (len(prompt.ids) - 1) // BLOCK]
        credit = 0
        while credit < len(query) and query[credit] in held:
            credit += 1
        answer = _post(args.url, body)
        usage = answer["usage"]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        new_blocks = len(prompt.ids) // BLOCK - cached // BLOCK
        payloads = _stores(sub, new_blocks, 30.0)
        stored_tokens: list[int] = []
        stored_extras: list[Any] = []
        engine_ints: list[int | bytes] = []
        for seq, payload in payloads:
            tracker.on_message(seq, payload)
            for event in decode_batch(payload, Engine.VLLM).events:
                if isinstance(event, BlockStored):
                    stored_tokens.extend(event.token_ids)
                    stored_extras.extend(event.extra_keys or [None] * len(event.block_hashes))
                    engine_ints.extend(event.block_hashes)
        ops = [op for op in tracker.take_ops() if isinstance(op, StoreBlocks)]
        ingest_keys = [key for op in ops for key in op.keys]
        start = cached // BLOCK
        expect_keys = keys[start : start + len(ingest_keys)]
        expect_extras = [None if (p := media.get(start + i)) is None else [list(x) for x in p]
                         for i in range(len(stored_extras))]
        got_extras = [None if e is None else [list(x) for x in e] for e in stored_extras]
        extras = [vllm_hash_extras(media.get(i, ())) for i in range(len(prompt.ids) // BLOCK)]
        hashes = [vllm_event_int(h) for h in vllm_block_hashes(
            prompt.ids[: len(extras) * BLOCK], BLOCK, extra_keys=extras)]
        row = {
            "case": name, "prompt_tokens": usage["prompt_tokens"],
            "gateway_prompt_tokens": len(prompt.ids),
            "image_tokens": [s.length for s in prompt.spans],
            "cached_tokens": cached, "gateway_credit_tokens": credit * BLOCK,
            "stored_blocks": len(engine_ints),
            "tokens_match": stored_tokens == prompt.ids[start * BLOCK:
                                                         (start + len(engine_ints)) * BLOCK],
            "extra_keys_match": got_extras == expect_extras,
            "engine_hashes_match": engine_ints == hashes[start : start + len(engine_ints)],
            "ingest_keys_match": ingest_keys == expect_keys,
        }
        rows.append(row)
        for check in ("tokens_match", "extra_keys_match", "engine_hashes_match",
                      "ingest_keys_match"):
            if not row[check]:
                failures.append(f"{name}: {check}")
        if row["prompt_tokens"] != row["gateway_prompt_tokens"]:
            failures.append(f"{name}: prompt tokens")
        if new_blocks and not ingest_keys:
            failures.append(f"{name}: the ingest placed none of the stored blocks")
        if credit * BLOCK != cached:
            failures.append(f"{name}: credit {credit * BLOCK} != cached {cached}")
        held.update(zip(ingest_keys, engine_ints, strict=False))
    report = {"engine": args.url, "model_dir": str(args.model_dir), "rows": rows,
              "failures": failures}
    text = json.dumps(report, indent=1)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    sub.close(0)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
