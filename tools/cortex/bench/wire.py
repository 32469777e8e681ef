"""``cortex bench wire``: the hot ``cortex.index.v1`` messages through Cortex's one codec.

Every Cortex peer uses the protobuf classes generated from ``index.proto`` (the upb runtime,
in C) through :mod:`cortex.ledger.codec`. Timed, encode and decode with validation, ending
with values the receiver uses:

- ``MatchRequest`` with 4,096 prompt tokens (ids below a 152k vocabulary) and with 256
  block keys, in the ``repeated`` fields (what other schedulers' grpcio clients send) and in
  the packed ``*_le`` twins (what Cortex sends): the twins are the baseline of the ratio;
- a 32-worker ``MatchResponse``;
- an ``UpdateBatch`` of 64 four-block stores (ingest → index), encoded as ingest does and
  decoded into validated ledger updates;
- a ``ReplicaBatch`` of 64 journal records (index → gateways), decoded into view ops.

Writes a markdown report (default ``docs/bench/wire.md``).
Run: ``cortex bench wire [--out DIR] [--seconds S]`` or ``python -m cortex.bench.wire``.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from cortex.bench.report import cpu_model, package_version, table
from cortex.bench.timed import add_timed_parser, timed_main
from cortex.hashing import Engine, HashDomain, pack_keys, pack_tokens
from cortex.index import match_args, match_reply
from cortex.ingest import UpdateEncoder, encode_batch_bytes
from cortex.ledger.codec import op_from_pb, pb, update_from_pb
from cortex.ledger.match import Match, SourceMatch
from cortex.ledger.model import LedgerState, Source
from cortex.ledger.replica import journal_batch
from cortex.ledger.view import Store, ViewOp

__all__ = ["Row", "build_rows", "measure", "register", "render", "run"]

TOKENS = 4096
KEYS = 256
WORKERS = 32
UPDATES = 64
VOCAB = 152_064
DEFAULT_SECONDS = 0.25
_BATCH_S = 0.005  # one timed batch: long enough to dwarf timer overhead
DOMAIN = HashDomain("bench-model", 16, Engine.SGLANG)


@dataclass(frozen=True, slots=True)
class Row:
    """One message and encoding: encode / decode operations (None = not applicable)."""

    message: str
    form: str
    encode: Callable[[], object] | None
    decode: Callable[[], object]


def _lcg(n: int, seed: int, modulo: int) -> list[int]:
    state, out = seed, []
    for _ in range(n):
        state = (state * 6364136223846793005 + 1442695040888963407) % 2**64
        out.append((state >> 33) % modulo if modulo else state)
    return out


def build_rows() -> list[Row]:
    """Every message x encoding, with prepared inputs (so only the codec is timed)."""
    tokens, keys = _lcg(TOKENS, 7, VOCAB), _lcg(KEYS, 11, 0)
    rep_tok = pb.MatchRequest(model="m", token_ids=tokens).SerializeToString()
    rep_key = pb.MatchRequest(model="m", block_keys=keys).SerializeToString()
    twin_tok = pb.MatchRequest(model="m", token_ids_le=pack_tokens(tokens)).SerializeToString()
    twin_key = pb.MatchRequest(model="m", block_keys_le=pack_keys(keys)).SerializeToString()

    def args(data: bytes) -> object:
        return match_args(pb.MatchRequest.FromString(data))

    result = Match.of([
        SourceMatch(Source(f"worker-{i:03d}", i % 2), i % 5 * 40, LedgerState.READY)
        for i in range(WORKERS)
    ], 1_234_567, KEYS, DOMAIN)
    requested = match_args(pb.MatchRequest.FromString(twin_key))
    reply = match_reply(result, requested).SerializeToString()

    def reply_decode() -> object:
        return [(m.worker_id, m.dp_rank, m.matched_blocks, m.state)
                for m in pb.MatchResponse.FromString(reply).matches]

    encoder = UpdateEncoder(Source("worker-007", 0), DOMAIN)
    chain = [keys[i:i + 4] for i in range(0, UPDATES * 4, 4)]

    def batch_encode() -> bytes:
        return encode_batch_bytes("ingest-0", [
            encoder.store(7, seq, c[0], c) for seq, c in enumerate(chain, 1)])

    batch = batch_encode()
    ops: list[ViewOp] = [Store(Source("worker-007", 0), c[0], np.array(c, np.uint64))
                         for c in chain]

    def journal_encode() -> bytes:
        return journal_batch(ops, "index-0", 1, 0.0).SerializeToString()

    journal = journal_encode()
    rows = [
        Row(f"MatchRequest, {TOKENS:,} tokens", "repeated",
            lambda: pb.MatchRequest(model="m", token_ids=tokens).SerializeToString(),
            lambda: args(rep_tok)),
        Row(f"MatchRequest, {TOKENS:,} tokens", "`*_le` twin",
            lambda: pb.MatchRequest(model="m", token_ids_le=pack_tokens(tokens))
            .SerializeToString(), lambda: args(twin_tok)),
        Row(f"MatchRequest, {KEYS} keys", "repeated",
            lambda: pb.MatchRequest(model="m", block_keys=keys).SerializeToString(),
            lambda: args(rep_key)),
        Row(f"MatchRequest, {KEYS} keys", "`*_le` twin",
            lambda: pb.MatchRequest(model="m", block_keys_le=pack_keys(keys)).SerializeToString(),
            lambda: args(twin_key)),
        Row(f"MatchResponse, {WORKERS} workers", "-",
            lambda: match_reply(result, requested).SerializeToString(), reply_decode),
        Row(f"UpdateBatch, {UPDATES} stores", "`*_le` twin", batch_encode,
            lambda: [update_from_pb(u) for u in pb.UpdateBatch.FromString(batch).updates]),
        Row(f"ReplicaBatch, {UPDATES} stores", "`*_le` twin", journal_encode,
            lambda: [op_from_pb(o) for o in pb.ReplicaBatch.FromString(journal).ops]),
    ]
    _check(rows, tokens, keys)
    return rows


def _check(rows: Sequence[Row], tokens: list[int], keys: list[int]) -> None:
    """Every decode must give the right values: a benchmark of wrong code is worthless."""
    for row in rows:
        value: Any = row.decode()
        if row.message.startswith("MatchRequest"):
            got = value.token_ids if "tokens" in row.message else value.block_keys
            assert list(got) == (tokens if "tokens" in row.message else keys), row
        else:
            assert len(value) == (WORKERS if "Response" in row.message else UPDATES), row


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


def render(rows: Sequence[Row], timings: dict[tuple[str, str, str], float], seconds: float) -> str:
    """The markdown report: µs per message, medians."""

    def cell(row: Row, op: str) -> str:
        value = timings.get((row.message, row.form, op))
        return "-" if value is None else f"{value * 1e6:,.1f}"

    lines = [
        "# Wire benchmark: the hot index messages",
        "",
        f"Generated by `cortex bench wire` on {datetime.now(UTC):%Y-%m-%d %H:%M} UTC. "
        f"µs per message, median of ~5 ms batches over {seconds:g} s per cell, GC off, "
        "one process.",
        "",
        f"- machine: {cpu_model()}, {os.cpu_count()} cores; "
        f"Python {platform.python_version()}",
        f"- protobuf {package_version('protobuf')} (upb), numpy {package_version('numpy')}",
        "",
        *table(("message", "lists as", "encode", "decode + validate"),
               [(row.message, row.form, cell(row, "enc"), cell(row, "dec")) for row in rows],
               "llrr"),
    ]
    lines += [
        "",
        "Reading it: decodes end with the values the receiver uses (lists of ints, validated",
        "ledger updates, view ops); the `*_le` twins cost one memcpy each way, the `repeated`",
        "fields (another scheduler's grpcio client) a varint loop in C plus Python ints.",
        "",
    ]
    return "\n".join(lines)


def run(out_dir: Path, seconds: float = DEFAULT_SECONDS) -> Path:
    """Time every cell and write ``out_dir/wire.md``; returns the report path."""
    rows = build_rows()
    timings: dict[tuple[str, str, str], float] = {}
    for row in rows:
        if row.encode is not None:
            timings[(row.message, row.form, "enc")] = measure(row.encode, seconds)
        timings[(row.message, row.form, "dec")] = measure(row.decode, seconds)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "wire.md"
    path.write_text(render(rows, timings, seconds), encoding="utf-8")
    return path


def register(bench_subparsers: argparse._SubParsersAction[Any]) -> None:
    """Add ``wire`` to ``cortex bench``."""
    add_timed_parser(bench_subparsers, "wire", run, DEFAULT_SECONDS,
                     help="codec timings of the hot index messages",
                     description="Time the protobuf (upb) codec on Match, Sync and replica "
                                 "messages.")


def main(argv: Sequence[str] | None = None) -> int:
    return timed_main("wire", run, DEFAULT_SECONDS, argv)


if __name__ == "__main__":
    sys.exit(main())
