"""What a routing tier costs two real vLLM engines on shared cores when it routes nothing.

Runs the real-engine benchmark's workload (:mod:`cortex.bench.routing.real`: seeded
multi-turn chat, streamed; sequential, or ``--clients`` at once) straight at the engines,
round robin, with caches emptied before each window, in each of ``--modes``:
- ``quiet``: nothing else runs;
- ``polls``: a thread asks each engine for the samples a Cortex gateway's load poll reads
  (``GET /metrics/?name[]=…``) every ``--interval-s``, as one gateway does;
- ``cortex``: a whole Cortex deployment (Redis, index, ingest, one gateway) runs beside the
  engines, learning their KV events and polling their load, but the client bypasses it;
- ``burnN``: a process that does nothing but take N ms of CPU per second, in
  ``--burn-chunk-ms`` slices at random (Poisson) times, at ``--burn-nice``: how much any
  routing tier's CPU on these cores costs the engines, whatever the work.
The workload and its placement are the same in every window, so request n of a window is
compared with request n of the ``quiet`` window of the same repetition: any difference is
the bystander's CPU taken from the engines. Repetitions alternate the modes' order. Run by
the project's venv, under the heavy-run lock::

    flock /tmp/cortex-heavy.lock .venv/bin/python tools/realengines/bystander_cost.py \
        --kv-blocks 256
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from cortex.bench.procstat import cpu_s
from cortex.bench.routing import real
from cortex.gateway.fleet.load import VLLM_LOAD_PATH
from cortex.testing.vllm_engines import VllmEngine, VllmInstall


class Poller(real.Sampler):
    """A gateway's load poll (:data:`VLLM_LOAD_PATH`) on every engine each
    ``interval_s`` until stopped."""

    def __init__(self, urls: list[str], interval_s: float) -> None:
        super().__init__(interval_s)
        self.urls = urls

    def sample(self) -> None:
        for url in self.urls:
            with urllib.request.urlopen(url + VLLM_LOAD_PATH, timeout=10) as response:
                response.read()


_BURN = """
import os, random, sys, time
chunk_s, share, nice = float(sys.argv[1]) / 1e3, float(sys.argv[2]) / 1e3, int(sys.argv[3])
os.nice(nice)
rng = random.Random(0)
while True:
    time.sleep(rng.expovariate(share / chunk_s))
    end = time.thread_time() + chunk_s
    while time.thread_time() < end:
        pass
"""


class Burner:
    """A process taking ``ms_per_s`` of CPU in ``chunk_ms`` slices until stopped; ``used``:
    the CPU ms per second it really took."""

    def __init__(self, ms_per_s: float, chunk_ms: float, nice: int) -> None:
        self.args = [str(chunk_ms), str(ms_per_s), str(nice)]
        self.used = 0.0

    def __enter__(self) -> Burner:
        self._proc = subprocess.Popen([sys.executable, "-c", _BURN, *self.args])
        self._started = time.monotonic()
        return self

    def __exit__(self, *exc: object) -> None:
        used_s = cpu_s(self._proc.pid) or 0.0
        self.used = used_s * 1000 / (time.monotonic() - self._started)
        self._proc.kill()
        self._proc.wait()


def _window(engines: list[VllmEngine], install: VllmInstall, run_dir: Path,
            args: argparse.Namespace, mode: str) -> list[float]:
    served = engines[0].served_name
    real.empty_caches(engines, served)
    urls = [e.url for e in engines]
    bystander: contextlib.AbstractContextManager[object] = contextlib.nullcontext()
    if mode == "polls":
        bystander = Poller(urls, args.interval_s)
    elif mode == "cortex":
        bystander = real._cortex(engines, install, run_dir / "cortex", 1)
    elif mode.startswith("burn"):
        bystander = Burner(float(mode[4:]), args.burn_chunk_ms, args.burn_nice)
    with bystander:
        shots = real._workload(urls, args.requests, 32, args.seed, served,
                               clients=args.clients)
    if isinstance(bystander, Burner):
        print(f"  {mode}: took {bystander.used:.1f} CPU ms/s", flush=True)
    return [s.ttft_s * 1000 for s in shots]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="model-qwen-slow")
    parser.add_argument("--requests", type=int, default=120)
    parser.add_argument("--kv-blocks", type=int, default=real.KV_BLOCKS)
    parser.add_argument("--interval-s", type=float, default=0.5)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--modes", default="quiet,cortex",
                        help="quiet, polls, cortex, burnN (N CPU ms per second)")
    parser.add_argument("--burn-chunk-ms", type=float, default=2.0)
    parser.add_argument("--burn-nice", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--clients", type=int, default=1, help="clients sending at once")
    parser.add_argument("--pin-engines", action="store_true",
                        help="each engine's processes on a core of their own")
    args = parser.parse_args()
    found = VllmInstall.find(models=(args.model,))
    if isinstance(found, str):
        raise SystemExit(found)
    modes = args.modes.split(",")
    runs: dict[str, list[list[float]]] = {mode: [] for mode in modes}
    with (tempfile.TemporaryDirectory(prefix="bystander-") as tmp,
          real.running_engines(found, Path(tmp), args.model, args.kv_blocks,
                               args.pin_engines) as engines):
        served = engines[0].served_name
        real._workload([e.url for e in engines], 6, 32, args.seed + 1, served)  # warm-up
        for repeat in range(args.repeats):
            for mode in modes if repeat % 2 == 0 else modes[::-1]:
                started = time.monotonic()
                runs[mode].append(_window(engines, found, Path(tmp), args, mode))
                print(f"repeat {repeat} {mode}: {time.monotonic() - started:.0f} s",
                      flush=True)
    for mode, windows in runs.items():
        pooled = sorted(t for w in windows for t in w)
        line = (f"{mode:7} TTFT p50 {statistics.median(pooled):6.1f}  "
                f"p90 {real._percentile(pooled, 0.9):6.1f} ms")
        if mode != "quiet" and "quiet" in runs:
            ratios = sorted(t / q for w, qw in zip(windows, runs["quiet"], strict=True)
                            for t, q in zip(w, qw, strict=True))
            line += (f"   per request / quiet: median {statistics.median(ratios):.3f}  "
                     f"p10 {real._percentile(ratios, 0.1):.3f}  "
                     f"p90 {real._percentile(ratios, 0.9):.3f}")
        print(line)


if __name__ == "__main__":
    main()
