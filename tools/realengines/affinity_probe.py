"""Does a cold prefill on two real vLLM engines sharing these cores depend on which engine
served the request before it?

An idle vLLM worker on CPU spins (``sched_yield``) for a second after its last step before it
sleeps, so while requests alternate between two engines both workers spin, and a prefill
shares the cores with the other engine's spinning worker. Sends ``--requests`` cold chat
requests (unique text, ~``--words`` words each, so nothing is cached) one at a time in
blocks of ten, each block either alternating between the two engines or all to the engine
that served the block before, and prints each way's TTFT p50 / p90. Run by the project's
venv, under the heavy-run lock::

    flock /tmp/cortex-heavy.lock .venv/bin/python tools/realengines/affinity_probe.py
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
from pathlib import Path

from cortex.bench.routing import real
from cortex.testing.vllm_engines import VllmInstall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="model-qwen-slow")
    parser.add_argument("--requests", type=int, default=120)
    parser.add_argument("--words", type=int, default=700)
    parser.add_argument("--kv-blocks", type=int, default=real.KV_BLOCKS)
    args = parser.parse_args()
    found = VllmInstall.find(models=(args.model,))
    if isinstance(found, str):
        raise SystemExit(found)
    rng = random.Random(0)
    ttfts: dict[str, list[float]] = {"alternating": [], "same engine": []}
    client = real.Client()
    with (tempfile.TemporaryDirectory(prefix="affinity-") as tmp,
          real.running_engines(found, Path(tmp), args.model, args.kv_blocks) as engines):
        served = engines[0].served_name
        urls = [e.url for e in engines]
        try:
            for n in range(args.requests):
                block = n // 10
                way = "alternating" if block % 2 == 0 else "same engine"
                url = urls[n % 2] if way == "alternating" else urls[0]
                text = " ".join(rng.choice(real._WORDS) for _ in range(args.words))
                body = {"model": served, "stream": True, "max_tokens": 8, "ignore_eos": True,
                        "stream_options": {"include_usage": True}, "temperature": 0,
                        "messages": [{"role": "user", "content": f"[{n}] {text}"}]}
                shot, _ = client.stream(url, body)
                if shot.cached_tokens == 0 and n % 10:  # a block's first request warms it
                    ttfts[way].append(shot.ttft_s * 1000)
        finally:
            client.close()
    for way, values in ttfts.items():
        print(f"{way:12} {len(values)} cold requests: TTFT p50 {statistics.median(values):.1f}"
              f"  p90 {real._percentile(values, 0.9):.1f} ms")


if __name__ == "__main__":
    main()
