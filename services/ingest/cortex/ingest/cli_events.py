"""``cortex events``: look inside KV-cache event payloads, and time the decoder.

``cortex events decode --engine vllm|sglang (--hex HEX | FILE | -)`` prints one JSON object
per event (batch ``ts`` and ``dp_rank`` on every line, block hashes given as ``bin`` in hex).
``cortex events bench`` measures decode throughput on realistic batches.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import fields, replace
from functools import partial
from typing import Final, TextIO

from cortex.hashing import Engine
from cortex.kvevents.codec import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CodecError,
    Event,
    EventBatch,
    decode_batch,
    encode_batch,
)

__all__ = ["event_records", "register"]

_WIRE_ONLY: Final = frozenset({"group_idx_nil"})


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``events`` and its actions to the umbrella ``cortex`` parser."""
    parser = subparsers.add_parser(
        "events",
        help="decode KV-cache event payloads of vLLM / SGLang",
        description="Inspect the KV-cache event payloads engines publish on ZMQ.",
    )
    actions = parser.add_subparsers(dest="events_action", metavar="ACTION", required=True)

    decode = actions.add_parser(
        "decode",
        help="print the events of one payload as JSON lines",
        description="Decode one msgpack payload (the third frame of a PUB message) and print "
        "one JSON object per event. Exit 1 when the payload is malformed.",
    )
    decode.add_argument("--engine", required=True, choices=[e.value for e in Engine])
    source = decode.add_mutually_exclusive_group(required=True)
    source.add_argument("--hex", metavar="HEX", help="the payload as hex digits")
    source.add_argument(
        "file", nargs="?", metavar="FILE", help="file holding the raw payload bytes, - for stdin"
    )
    decode.set_defaults(func=_run_decode)

    bench = actions.add_parser(
        "bench",
        help="measure decode throughput (block events/s) on realistic batches",
        description="Time decode_batch on synthetic batches shaped like real engine output.",
    )
    bench.add_argument(
        "--seconds", type=float, default=1.0, help="time spent per case (default 1.0 s)"
    )
    bench.set_defaults(func=_run_bench)


# --------------------------------------------------------------------------------------------
# decode


def _run_decode(args: argparse.Namespace) -> int:
    try:
        payload = _read_payload(args.hex, args.file)
        batch = decode_batch(payload, args.engine)
    except (CodecError, OSError) as exc:
        print(f"cortex events decode: error: {_one_line(str(exc))}", file=sys.stderr)
        return 1
    _write_records(batch, sys.stdout)
    if batch.skipped_unknown:
        print(
            f"cortex events decode: skipped {batch.skipped_unknown} event(s) of unknown type",
            file=sys.stderr,
        )
    return 0


def _read_payload(hex_text: str | None, path: str | None) -> bytes:
    if hex_text is not None:
        digits = "".join(hex_text.split()).removeprefix("0x")
        try:
            return bytes.fromhex(digits)
        except ValueError:
            raise CodecError("--hex is not a string of hex digits") from None
    if path is None or path == "-":
        return sys.stdin.buffer.read()
    with open(path, "rb") as handle:
        return handle.read()


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _write_records(batch: EventBatch, out: TextIO) -> None:
    for record in event_records(batch):
        out.write(json.dumps(record, separators=(",", ":")) + "\n")


def event_records(batch: EventBatch) -> Iterator[dict[str, object]]:
    """The JSON-ready records ``cortex events decode`` prints: one per event, with the
    batch's ``ts`` (s) and ``dp_rank``, the event ``type`` and every normalized field;
    ``bytes`` become lowercase hex strings."""
    for event in batch.events:
        record: dict[str, object] = {
            "ts": batch.ts,
            "dp_rank": batch.dp_rank,
            "type": type(event).__name__,
        }
        for spec in fields(event):
            if spec.name not in _WIRE_ONLY:
                record[spec.name] = _jsonable(getattr(event, spec.name))
        yield record


def _jsonable(value: object) -> object:
    # Depth is bounded by the codec (extra_keys nest at most 16 deep).
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, tuple | list):
        return [_jsonable(item) for item in value]
    if isinstance(value, dict):
        return {str(_jsonable(key)): _jsonable(item) for key, item in value.items()}
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return repr(value)  # msgpack ext types inside extra_keys


# --------------------------------------------------------------------------------------------
# bench


def _run_bench(args: argparse.Namespace) -> int:
    seconds = max(0.05, float(args.seconds))
    print(f"{'case':<50} {'bytes':>7} {'us/batch':>9} {'events/s':>11} {'blocks/s':>12}")
    for name, engine, payload, events, blocks in _bench_cases():
        per_batch = _time_per_call(partial(decode_batch, payload, engine), seconds)
        print(
            f"{name:<50} {len(payload):>7} {per_batch * 1e6:>9.1f} "
            f"{events / per_batch:>11,.0f} {blocks / per_batch:>12,.0f}"
        )
    return 0


def _time_per_call(call: Callable[[], object], seconds: float) -> float:
    """Mean wall time of ``call`` in seconds, repeated for about ``seconds``."""
    calls = 0
    start = time.perf_counter()
    while True:
        call()
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return elapsed / calls


def _bench_cases() -> Iterator[tuple[str, Engine, bytes, int, int]]:
    rng = random.Random(20240601)
    u64 = 2**64
    s64 = 2**63

    def vllm_store(blocks: int) -> BlockStored:
        return BlockStored(
            block_hashes=tuple(rng.randrange(u64) for _ in range(blocks)),
            parent_block_hash=rng.randrange(u64),
            token_ids=tuple(rng.randrange(150_000) for _ in range(blocks * 16)),
            block_size=16,
            medium="GPU",
            extra_keys=(None,) * blocks,
            kv_cache_spec_kind="full_attention",
        )

    def sglang_store(blocks: int, page: int) -> BlockStored:
        return BlockStored(
            block_hashes=tuple(rng.randrange(-s64, s64) for _ in range(blocks)),
            parent_block_hash=rng.randrange(-s64, s64),
            token_ids=tuple(rng.randrange(150_000) for _ in range(blocks * page)),
            block_size=page,
            medium="GPU",
        )

    cases: list[tuple[str, Engine, str, list[Event]]] = [
        ("vLLM 0.33 map: 64 x BlockStored(1 block/16 tok)", Engine.VLLM, "0.33.0",
         [vllm_store(1) for _ in range(64)]),
        ("vLLM 0.33 map: 8 x BlockStored(32 blocks/16 tok)", Engine.VLLM, "0.33.0",
         [vllm_store(32) for _ in range(8)]),
        ("vLLM 0.33 map: 64 x BlockRemoved(1 hash)", Engine.VLLM, "0.33.0",
         [BlockRemoved((rng.randrange(u64),), "GPU") for _ in range(64)]),
        ("vLLM 0.23 array: 64 x BlockStored(1 block)", Engine.VLLM, "0.23.0",
         [replace(vllm_store(1), kv_cache_spec_kind=None) for _ in range(64)]),
        ("SGLang 0.5.23 map: 8 x BlockStored(256 pages/1)", Engine.SGLANG, "0.5.23",
         [sglang_store(256, 1) for _ in range(8)]),
        ("SGLang 0.5.23 map: 64 x BlockStored(4 pages/16)", Engine.SGLANG, "0.5.23",
         [sglang_store(4, 16) for _ in range(64)]),
        ("SGLang 0.5.18 array: 8 x BlockStored(256/1)", Engine.SGLANG, "0.5.18",
         [sglang_store(256, 1) for _ in range(8)]),
        ("SGLang 0.5.23 map: 16 x BlockRemoved(64 hashes)", Engine.SGLANG, "0.5.23",
         [BlockRemoved(tuple(rng.randrange(-s64, s64) for _ in range(64)), "GPU")
          for _ in range(16)]),
    ]  # fmt: skip
    for name, engine, version, events in cases:
        payload = encode_batch(EventBatch(time.time(), tuple(events), 0), engine, version)
        blocks = sum(
            0 if isinstance(event, AllBlocksCleared) else len(event.block_hashes)
            for event in events
        )
        yield name, engine, payload, len(events), blocks
