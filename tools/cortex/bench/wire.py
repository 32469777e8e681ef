"""``cortex bench wire``: Match messages through each protobuf codec Cortex meets.

Encodes and decodes a ``MatchRequest`` with 4,096 prompt tokens (pseudo-random ids below a
152k vocabulary: 1-3 byte varints, as real prompts) and one with 256 block keys (full 64-bit
values), plus a 32-worker ``MatchResponse``, with:

- betterproto, repeated fields (``token_ids`` / ``block_keys``) and bytes twins (``*_le``);
- ``cortex.index.wire``, decoding either form and encoding the twins;
- grpcio's protobuf runtime (upb), the codec of other schedulers' clients.

"decode" ends with the integers usable by the index (a list or an ``array``), "encode"
starts from a ``list[int]``: packing into a twin is part of encoding. Writes a markdown
report (default ``docs/bench/wire.md``).

Run: ``cortex bench wire [--out DIR] [--seconds S]`` or ``python -m cortex.bench.wire``.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import sys
import tempfile
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from types import ModuleType
from typing import Any

from cortex.api.index.v1 import LedgerState, MatchRequest, MatchResponse
from cortex.bench.timed import add_timed_parser, timed_main
from cortex.index.wire import (
    MatchDomain,
    MatchReply,
    WorkerHit,
    decode_match_request,
    decode_match_response,
    encode_match_request,
    encode_match_response,
    pack_block_keys,
    pack_token_ids,
)

__all__ = ["Row", "build_rows", "measure", "register", "render", "run"]

TOKENS = 4096
KEYS = 256
WORKERS = 32
VOCAB = 152_064
DEFAULT_SECONDS = 0.25
_BATCH_S = 0.005  # one timed batch: long enough to dwarf timer overhead

Op = Callable[[], object] | None


@dataclass(frozen=True, slots=True)
class Row:
    """One codec and encoding: the operations to time (None = not applicable)."""

    codec: str
    form: str
    ops: dict[str, Op]  # column -> operation


def _tokens() -> list[int]:
    state, out = 7, []
    for _ in range(TOKENS):
        state = (state * 6364136223846793005 + 1442695040888963407) % 2**64
        out.append((state >> 33) % VOCAB)
    return out


def _keys() -> list[int]:
    state, out = 11, []
    for _ in range(KEYS):
        state = (state * 6364136223846793005 + 1442695040888963407) % 2**64
        out.append(state)
    return out


def _reply() -> MatchReply:
    hits = [
        WorkerHit(f"worker-{i:03d}", i % 5 * 40, i % 5 * 640, LedgerState.READY, i % 2)
        for i in range(WORKERS)
    ]
    return MatchReply(hits, 1_234_567, 256, MatchDomain("bench-model", 16, 1))


def _grpcio() -> ModuleType | None:
    """grpcio's generated messages (built now by protoc), or None without the dev tools."""
    try:
        from cortex.index.grpcio_stubs import load_grpcio_stubs

        return load_grpcio_stubs(Path(tempfile.mkdtemp(prefix="cortex-bench-wire-"))).pb2
    except ImportError:  # grpcio-tools is a dev dependency
        return None


def _array_u32(data: bytes) -> array[int]:
    out = array("I")
    out.frombytes(data)
    return out


def _array_u64(data: bytes) -> array[int]:
    out = array("Q")
    out.frombytes(data)
    return out


def build_rows(pb2: ModuleType | None) -> list[Row]:
    """Every codec x encoding, with prepared inputs (so only the codec is timed)."""
    tokens, keys, reply = _tokens(), _keys(), _reply()
    bp_tok = bytes(MatchRequest(model="m", token_ids=tokens))
    bp_key = bytes(MatchRequest(model="m", block_keys=keys))
    twin_tok = encode_match_request("m", token_ids=tokens)
    twin_key = encode_match_request("m", block_keys=keys)
    reply_bytes = encode_match_response(reply)
    bp_reply = MatchResponse().parse(reply_bytes)

    def bp_twin_decode_tok() -> object:
        return _array_u32(MatchRequest().parse(twin_tok).token_ids_le)

    def bp_twin_decode_key() -> object:
        return _array_u64(MatchRequest().parse(twin_key).block_keys_le)

    def wire_reply_cold() -> object:
        from cortex.index.wire import match

        match._HITS.clear()  # the decoder's entry cache: measure the first sight of a reply
        return decode_match_response(reply_bytes)

    rows = [
        Row(
            "betterproto",
            "repeated",
            {
                "tok_enc": lambda: bytes(MatchRequest(model="m", token_ids=tokens)),
                "tok_dec": lambda: MatchRequest().parse(bp_tok).token_ids,
                "key_enc": lambda: bytes(MatchRequest(model="m", block_keys=keys)),
                "key_dec": lambda: MatchRequest().parse(bp_key).block_keys,
                "rep_enc": lambda: bytes(bp_reply),
                "rep_dec": lambda: MatchResponse().parse(reply_bytes),
            },
        ),
        Row(
            "betterproto",
            "`*_le` twin",
            {
                "tok_enc": lambda: bytes(
                    MatchRequest(model="m", token_ids_le=pack_token_ids(tokens))
                ),
                "tok_dec": bp_twin_decode_tok,
                "key_enc": lambda: bytes(
                    MatchRequest(model="m", block_keys_le=pack_block_keys(keys))
                ),
                "key_dec": bp_twin_decode_key,
                "rep_enc": None,
                "rep_dec": None,
            },
        ),
        Row(
            "cortex.index.wire",
            "repeated",
            {
                "tok_enc": None,
                "tok_dec": lambda: decode_match_request(bp_tok),
                "key_enc": None,
                "key_dec": lambda: decode_match_request(bp_key),
                "rep_enc": lambda: encode_match_response(reply),
                "rep_dec": wire_reply_cold,
            },
        ),
        Row(
            "cortex.index.wire",
            "`*_le` twin",
            {
                "tok_enc": lambda: encode_match_request("m", token_ids=tokens),
                "tok_dec": lambda: decode_match_request(twin_tok),
                "key_enc": lambda: encode_match_request("m", block_keys=keys),
                "key_dec": lambda: decode_match_request(twin_key),
                "rep_enc": None,
                "rep_dec": lambda: decode_match_response(reply_bytes),  # warm entry cache
            },
        ),
    ]
    if pb2 is not None:
        up_tok = pb2.MatchRequest(model="m", token_ids=tokens).SerializeToString()
        up_key = pb2.MatchRequest(model="m", block_keys=keys).SerializeToString()
        up_reply = pb2.MatchResponse.FromString(reply_bytes)
        rows += [
            Row(
                "grpcio (upb)",
                "repeated",
                {
                    "tok_enc": lambda: pb2.MatchRequest(
                        model="m", token_ids=tokens
                    ).SerializeToString(),
                    "tok_dec": lambda: list(pb2.MatchRequest.FromString(up_tok).token_ids),
                    "key_enc": lambda: pb2.MatchRequest(
                        model="m", block_keys=keys
                    ).SerializeToString(),
                    "key_dec": lambda: list(pb2.MatchRequest.FromString(up_key).block_keys),
                    "rep_enc": up_reply.SerializeToString,
                    "rep_dec": lambda: pb2.MatchResponse.FromString(reply_bytes),
                },
            ),
            Row(
                "grpcio (upb)",
                "repeated, parse only",
                {
                    "tok_enc": None,
                    "tok_dec": lambda: pb2.MatchRequest.FromString(up_tok),
                    "key_enc": None,
                    "key_dec": lambda: pb2.MatchRequest.FromString(up_key),
                    "rep_enc": None,
                    "rep_dec": None,
                },
            ),
            Row(
                "grpcio (upb)",
                "`*_le` twin",
                {
                    "tok_enc": lambda: pb2.MatchRequest(
                        model="m", token_ids_le=pack_token_ids(tokens)
                    ).SerializeToString(),
                    "tok_dec": lambda: _array_u32(
                        pb2.MatchRequest.FromString(twin_tok).token_ids_le
                    ),
                    "key_enc": lambda: pb2.MatchRequest(
                        model="m", block_keys_le=pack_block_keys(keys)
                    ).SerializeToString(),
                    "key_dec": lambda: _array_u64(
                        pb2.MatchRequest.FromString(twin_key).block_keys_le
                    ),
                    "rep_enc": None,
                    "rep_dec": None,
                },
            ),
        ]
    _check(rows, tokens, keys, reply)
    return rows


def _check(rows: Sequence[Row], tokens: list[int], keys: list[int], reply: MatchReply) -> None:
    """Every codec must produce the same integers: a benchmark of wrong code is worthless."""
    for row in rows:
        for column, op in row.ops.items():
            if op is None or column.endswith("enc"):
                continue
            value: Any = op()
            if row.form.endswith("parse only"):
                continue
            if column == "tok_dec":
                got = getattr(value, "token_ids", value)
                assert list(got) == tokens, (row, column)
            elif column == "key_dec":
                got = getattr(value, "block_keys", value)
                assert list(got) == keys, (row, column)
            else:
                assert len(value.matches) == len(reply.matches), (row, column)


def measure(fn: Callable[[], object], seconds: float) -> float:
    """Median seconds per call of ``fn``, over ~5 ms batches for about ``seconds``; GC off."""
    fn()
    per_batch = 1
    start = time.perf_counter()
    while time.perf_counter() - start < _BATCH_S and per_batch < 100_000:
        fn()
        per_batch += 1
    samples: list[float] = []
    deadline = time.perf_counter() + seconds
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        while len(samples) < 5 or time.perf_counter() < deadline:
            begin = time.perf_counter()
            for _ in range(per_batch):
                fn()
            samples.append((time.perf_counter() - begin) / per_batch)
    finally:
        if was_enabled:
            gc.enable()
    return statistics.median(samples)


COLUMNS = ("tok_enc", "tok_dec", "key_enc", "key_dec", "rep_enc", "rep_dec")


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "?"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def render(rows: Sequence[Row], timings: dict[tuple[str, str, str], float], seconds: float) -> str:
    """The markdown report: µs per message, medians."""

    def cell(row: Row, column: str) -> str:
        value = timings.get((row.codec, row.form, column))
        return "-" if value is None else f"{value * 1e6:,.1f}"

    lines = [
        "# Wire benchmark: Match messages",
        "",
        f"Generated by `cortex bench wire` on {datetime.now(UTC):%Y-%m-%d %H:%M} UTC. "
        f"µs per message, median of ~5 ms batches over {seconds:g} s per cell, GC off, "
        "one process.",
        "",
        f"- machine: {_cpu_model()}, {os.cpu_count()} cores; Python {platform.python_version()}",
        f"- betterproto {_version('betterproto')}, protobuf {_version('protobuf')} "
        f"(upb), numpy {_version('numpy')}",
        f"- requests: {TOKENS:,} tokens (ids below {VOCAB:,}: 1-3 byte varints), {KEYS} keys "
        f"(64-bit); reply: {WORKERS} `WorkerMatch` entries and a `Domain`",
        "",
        f"| codec | lists as | {TOKENS:,} tokens: encode | decode | {KEYS} keys: encode | "
        f"decode | reply ({WORKERS} workers): encode | decode |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        cells = " | ".join(cell(row, column) for column in COLUMNS)
        lines.append(f"| {row.codec} | {row.form} | {cells} |")
    lines += [
        "",
        "Reading it:",
        "",
        "- `cortex.index.wire` decodes what grpcio clients send (`repeated`) with vectorised",
        "  numpy varint decoding, and the twins with one memcpy; its `repeated` encode column",
        "  is empty because its encoder always writes the twins. The reply decoder caches",
        "  `WorkerMatch` entries by their bytes: its `repeated` row shows a cold cache, its",
        "  twin row (replies have no twins) a warm one, the usual case for repeated prefixes.",
        "- betterproto's pure-Python codec is what a generated grpclib server would use without",
        "  the hook in `cortex.index.wire` (`IndexServiceBase`).",
        "- Decodes end with usable integers: `list(...)` of upb's repeated containers, an",
        '  `array` from the twin bytes; upb\'s "parse only" row leaves them inside upb (reading',
        "  them element by element from Python is what costs), and its reply decode is parse",
        "  only too. upb is C: it is the bar, not a Cortex code path.",
        "",
    ]
    return "\n".join(lines)


def run(out_dir: Path, seconds: float = DEFAULT_SECONDS) -> Path:
    """Time every cell and write ``out_dir/wire.md``; returns the report path."""
    rows = build_rows(_grpcio())
    timings: dict[tuple[str, str, str], float] = {}
    for row in rows:
        for column, op in row.ops.items():
            if op is not None:
                timings[(row.codec, row.form, column)] = measure(op, seconds)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "wire.md"
    path.write_text(render(rows, timings, seconds), encoding="utf-8")
    return path


def register(bench_subparsers: argparse._SubParsersAction[Any]) -> None:
    """Add ``wire`` to ``cortex bench``."""
    add_timed_parser(bench_subparsers, "wire", run, DEFAULT_SECONDS,
                     help="MatchRequest / MatchResponse codec timings",
                     description="Time betterproto, cortex.index.wire and upb on Match messages.")


def main(argv: Sequence[str] | None = None) -> int:
    return timed_main("wire", run, DEFAULT_SECONDS, argv)


if __name__ == "__main__":
    sys.exit(main())
