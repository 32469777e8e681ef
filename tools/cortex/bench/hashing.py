"""``cortex bench hashing``: Cortex key throughput vs the engine-hash replicas.

Hashes one 4,096-token prompt (a fixed pseudo-random prompt over a 152k
vocabulary) again and again for a fixed time per case, and writes a markdown
report (default ``docs/bench/hashing.md``): best and median microseconds per
prompt and tokens per second (of the best batch), for Cortex keys from each
input form and for the vLLM / SGLang replicas at the same block sizes.

Run: ``cortex bench hashing [--out DIR] [--seconds S]`` or
``python -m cortex.bench.hashing``.
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
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from cortex.bench.report import cpu_model, package_version, table
from cortex.bench.timed import add_timed_parser, timed_main
from cortex.hashing import (
    HASH_VERSION,
    Engine,
    HashDomain,
    pack_tokens,
    sglang_page_hashes,
    vllm_block_hashes,
)

__all__ = ["Case", "Result", "build_cases", "measure", "register", "render", "run"]

PROMPT_TOKENS = 4096
VOCAB = 152_064
BLOCK_SIZES = (16, 64)
DEFAULT_SECONDS = 0.4
_BATCH_S = 0.01  # one timed batch: long enough to dwarf timer overhead


@dataclass(frozen=True, slots=True)
class Case:
    """One thing to time: ``fn`` hashes ``tokens`` tokens per call."""

    group: str
    name: str
    block_size: int
    tokens: int
    fn: Callable[[], object]


@dataclass(frozen=True, slots=True)
class Result:
    """Per-call timings of a case, in seconds."""

    case: Case
    calls: int
    median_s: float
    best_s: float

    @property
    def tokens_per_s(self) -> float:
        """Throughput of the best batch, tokens per second (the least disturbed run)."""
        return self.case.tokens / self.best_s


def _prompt() -> list[int]:
    state, out = 7, []
    for _ in range(PROMPT_TOKENS):
        state = (state * 6364136223846793005 + 1442695040888963407) % 2**64
        out.append((state >> 33) % VOCAB)
    return out


def build_cases() -> list[Case]:
    """Every timed case, Cortex keys first."""
    tokens = _prompt()
    packed = pack_tokens(tokens)
    u32 = np.array(tokens, dtype=np.uint32)
    n = len(tokens)
    cases = [Case("cortex", "pack_tokens(list) only", 0, n, partial(pack_tokens, tokens))]
    for block_size in BLOCK_SIZES:
        domain = HashDomain("bench-model", block_size, Engine.SGLANG)
        for label, form in (("list[int]", tokens), ("packed bytes", packed), ("numpy uint32", u32)):
            cases.append(
                Case("cortex", f"keys from {label}", block_size, n, partial(domain.keys, form))
            )
    salted = HashDomain("bench-model", 16, Engine.VLLM)
    salted_keys = partial(salted.keys, tokens, "adapter-a", "tenant-1")
    cases.append(Case("cortex", "keys from list[int], LoRA + salt root", 16, n, salted_keys))
    for block_size in BLOCK_SIZES:
        for algo in ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor"):
            vllm = partial(vllm_block_hashes, tokens, block_size, algo=algo)
            cases.append(Case("engine", f"vLLM {algo}", block_size, n, vllm))
        sglang = partial(sglang_page_hashes, tokens, block_size)
        cases.append(Case("engine", "SGLang sha256", block_size, n, sglang))
    cases.append(Case("engine", "SGLang sha256", 1, n, partial(sglang_page_hashes, tokens, 1)))
    return cases


def measure(fn: Callable[[], object], seconds: float) -> tuple[int, float, float]:
    """Time ``fn`` for about ``seconds``: (calls, median s/call, best s/call).

    Calls run in batches of ~10 ms (calibrated on the first calls); the median
    and best are over batch means. The garbage collector is off while timing.
    """
    fn()  # warm caches (lru caches, first-call imports)
    per_batch = 1
    start = time.perf_counter()
    while True:
        fn()
        elapsed = time.perf_counter() - start
        if elapsed >= _BATCH_S or per_batch >= 1_000_000:
            break
        per_batch += 1
    samples: list[float] = []
    calls = 0
    deadline = time.perf_counter() + seconds
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        while not samples or time.perf_counter() < deadline:
            begin = time.perf_counter()
            for _ in range(per_batch):
                fn()
            samples.append((time.perf_counter() - begin) / per_batch)
            calls += per_batch
    finally:
        if was_enabled:
            gc.enable()
    return calls, statistics.median(samples), min(samples)


def _load() -> str:
    try:
        return f"{os.getloadavg()[0]:.2f}"
    except OSError:  # pragma: no cover - platforms without getloadavg
        return "?"


def render(results: Sequence[Result], seconds: float) -> str:
    """The markdown report of a run."""
    baseline = {
        r.case.block_size: r.best_s
        for r in results
        if r.case.group == "cortex" and r.case.name == "keys from list[int]"
    }
    lines = [
        "# Hashing benchmark",
        "",
        f"Generated by `cortex bench hashing` on {datetime.now(UTC):%Y-%m-%d %H:%M} UTC. "
        f"One {PROMPT_TOKENS:,}-token prompt (pseudo-random ids below {VOCAB:,}), hashed "
        f"repeatedly for {seconds:g} s per case in ~10 ms batches, GC off. Throughput and "
        "ratios use the best batch (the least disturbed by other processes); the median "
        "shows how much the machine's load moved it.",
        "",
        f"- machine: {cpu_model()}, {os.cpu_count()} cores, load average {_load()}; "
        f"Python {platform.python_version()}",
        f"- xxhash {package_version('xxhash')}, cbor2 {package_version('cbor2')}, "
        f"numpy {package_version('numpy')}; "
        f"Cortex HASH_VERSION {HASH_VERSION}",
        "",
    ]
    rows = []
    for result in results:
        case = result.case
        base = baseline.get(case.block_size)
        rows.append((case.name, case.block_size or "-", f"{result.best_s * 1e6:,.1f}",
                     f"{result.median_s * 1e6:,.1f}", f"{result.tokens_per_s / 1e6:,.1f}",
                     f"{result.best_s / base:.1f}" if base and case.group == "engine" else ""))
    lines += table(("what", "block size", "µs / prompt (best)", "µs (median)", "M tokens/s",
                    "x slower than Cortex keys from a list"), rows, "lrrrrr")
    lines += [
        "",
        "Reading it:",
        "",
        "- Cortex keys chain xxh3-64 over the packed `uint32` tokens of each block: one C call",
        "  per block. Callers holding packed tokens (the proto's `token_ids_le`, a numpy",
        "  `uint32` array) skip `pack_tokens`, the list-to-bytes conversion.",
        "- The engine replicas do what the engines do: vLLM pickles (or CBOR-encodes)",
        "  `(parent, tuple(block), extra_keys)` per block and hashes it; SGLang hashes",
        "  `parent || uint32 tokens`. They serve the simulator and ingest alignment checks,",
        "  not the request path. SGLang's default page size is 1: one sha256 per token.",
        "",
    ]
    return "\n".join(lines)


def run(out_dir: Path, seconds: float = DEFAULT_SECONDS) -> Path:
    """Run every case and write ``out_dir/hashing.md``; returns the report path."""
    results = []
    for case in build_cases():
        calls, median_s, best_s = measure(case.fn, seconds)
        results.append(Result(case, calls, median_s, best_s))
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "hashing.md"
    path.write_text(render(results, seconds), encoding="utf-8")
    return path


def register(bench_subparsers: argparse._SubParsersAction[Any]) -> None:
    """Add ``hashing`` to ``cortex bench``."""
    add_timed_parser(bench_subparsers, "hashing", run, DEFAULT_SECONDS,
                     help="Cortex key and engine-hash throughput",
                     description="Time Cortex keys and engine-hash replicas on 4k-token prompts.")


def main(argv: Sequence[str] | None = None) -> int:
    return timed_main("hashing", run, DEFAULT_SECONDS, argv)


if __name__ == "__main__":
    sys.exit(main())
