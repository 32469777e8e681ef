"""What one load poll costs a real vLLM engine: its processes' CPU per ``/metrics`` request,
the whole text against the samples a Cortex gateway's poll names (``/metrics/?name[]=…``).

Starts one engine (``--model``, caches of ``--kv-blocks``), sends a few requests so its
counters exist, then ``--calls`` requests of each kind in ``--rounds`` alternating rounds,
reading the engine's session CPU (API server, EngineCore, worker) from ``/proc`` around each
round. Run by the project's venv, under the heavy-run lock::

    flock /tmp/cortex-heavy.lock .venv/bin/python tools/realengines/metrics_cost.py
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import urllib.request
from pathlib import Path

from cortex.bench.procstat import session_cpu_s
from cortex.bench.routing import real
from cortex.gateway.fleet.load import VLLM_LOAD_PATH
from cortex.testing.vllm_engines import VllmInstall


def _round(url: str, path: str, calls: int, session: int) -> tuple[float, int]:
    """(engine CPU ms per call, bytes of one answer)."""
    size = 0
    before = session_cpu_s(session)
    for _ in range(calls):
        with urllib.request.urlopen(url + path, timeout=30) as response:
            size = len(response.read())
    return (session_cpu_s(session) - before) / calls * 1000, size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="model-qwen-slow")
    parser.add_argument("--kv-blocks", type=int, default=real.KV_BLOCKS)
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    found = VllmInstall.find(models=(args.model,))
    if isinstance(found, str):
        raise SystemExit(found)
    results: dict[str, list[float]] = {"/metrics": [], VLLM_LOAD_PATH: []}
    sizes: dict[str, int] = {}
    with (tempfile.TemporaryDirectory(prefix="metrics-cost-") as tmp,
          real.running_engines(found, Path(tmp), args.model, args.kv_blocks) as engines):
        engine = engines[0]
        real._workload([engine.url], 3, 4, 0, engine.served_name)
        for i in range(args.rounds):
            order = list(results) if i % 2 == 0 else list(results)[::-1]
            for path in order:
                ms, sizes[path] = _round(engine.url, path, args.calls, engine.proc.pid)
                results[path].append(ms)
                print(f"round {i} {path[:20]}: {ms:.2f} ms CPU per call, {sizes[path]} bytes",
                      flush=True)
    for path, values in results.items():
        print(f"{path[:20]:20} median {statistics.median(values):.2f} ms per call "
              f"({', '.join(f'{v:.2f}' for v in values)}), {sizes[path]} bytes")


if __name__ == "__main__":
    main()
