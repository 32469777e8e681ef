"""Where a request's time to first token goes, request by request, with Cortex in front of
two real vLLM engines: the client's TTFT, the gateway's routing and its upstream first byte,
and the engine's own TTFT, queue and prefill time.

Runs the real-engine benchmark's workload (:mod:`cortex.bench.routing.real`: seeded
multi-turn chat, sequential, streamed) through Cortex alone. The per-request numbers are the
differences of histogram sums read before and after each request (requests are sequential,
so each difference is that request's): the gateway's ``cortex_gateway_routing_seconds`` and
``cortex_gateway_upstream_first_byte_seconds``, the engines' ``vllm:time_to_first_token_seconds``,
``vllm:request_queue_time_seconds`` and ``vllm:request_prefill_time_seconds``. Reading them
costs the engine a ``/metrics`` render after each request, outside the request's time.
Prints each request whose client TTFT is more than ``--show-over-ms`` above the engine's,
then p50 / p90 / max of the parts. Run by the project's venv, under the heavy-run lock::

    flock /tmp/cortex-heavy.lock .venv/bin/python tools/realengines/ttft_split.py --replicas 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from cortex.bench.routing import real
from cortex.bench.routing.real import metric_sums as sums
from cortex.testing.vllm_engines import VllmEngine, VllmInstall

GATEWAY = ('cortex_gateway_routing_seconds_sum{stage="total"}',
           "cortex_gateway_upstream_first_byte_seconds_sum")
ENGINE = ("vllm:time_to_first_token_seconds_sum", "vllm:request_queue_time_seconds_sum",
          "vllm:request_prefill_time_seconds_sum")


def quantiles(values: list[float]) -> str:
    return (f"p50 {statistics.median(values):.1f}  p90 {real._percentile(values, 0.9):.1f}"
            f"  max {max(values):.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="model-qwen-slow")
    parser.add_argument("--replicas", type=int, default=1, help="Cortex gateways")
    parser.add_argument("--requests", type=int, default=120)
    parser.add_argument("--kv-blocks", type=int, default=real.KV_BLOCKS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--show-over-ms", type=float, default=30.0)
    parser.add_argument("--json", type=Path, help="also write every request's row here")
    args = parser.parse_args()
    found = VllmInstall.find(models=(args.model,))
    if isinstance(found, str):
        raise SystemExit(found)
    with (tempfile.TemporaryDirectory(prefix="ttft-split-") as tmp,
          real.running_engines(found, Path(tmp), args.model, args.kv_blocks) as engines):
        rows = _run(engines, found, Path(tmp), args)
    _report(rows, args.show_over_ms)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


def _run(engines: list[VllmEngine], install: VllmInstall, run_dir: Path,
         args: argparse.Namespace) -> list[dict[str, float]]:
    served = engines[0].served_name
    real._workload([e.url for e in engines], 6, 32, args.seed + 1, served)  # engine warm-up
    real.empty_caches(engines, served)
    rows = []
    with real._cortex(engines, install, run_dir / "cortex", args.replicas) as (urls, _):
        chats, client = real.Conversations(32, args.seed), real.Client()
        try:
            for n in range(args.requests):
                i, messages = chats.next()
                body = {"model": served, "messages": messages, "stream": True,
                        "stream_options": {"include_usage": True}, "ignore_eos": True,
                        "temperature": 0, "max_tokens": chats.rng.randrange(4, 24)}
                url = urls[n % len(urls)]
                gateway0, engines0 = sums(url, GATEWAY), [sums(e.url, ENGINE) for e in engines]
                shot, answer = client.stream(url, body)
                gateway1, engines1 = sums(url, GATEWAY), [sums(e.url, ENGINE) for e in engines]
                chats.answered(i, messages, answer, shot.prompt_tokens)
                spent = [{k: (after[k] - before[k]) * 1000 for k in ENGINE}
                         for before, after in zip(engines0, engines1, strict=True)]
                served_by = max(range(len(engines)), key=lambda j: spent[j][ENGINE[0]])
                own = spent[served_by]
                rows.append({
                    "request": n, "gateway": n % len(urls), "engine": served_by,
                    "prompt": shot.prompt_tokens, "cached": shot.cached_tokens,
                    "ttft_ms": shot.ttft_s * 1000,
                    "routing_ms": (gateway1[GATEWAY[0]] - gateway0[GATEWAY[0]]) * 1000,
                    "upstream_first_byte_ms": (gateway1[GATEWAY[1]] - gateway0[GATEWAY[1]]) * 1000,
                    "engine_ttft_ms": own[ENGINE[0]], "engine_queue_ms": own[ENGINE[1]],
                    "engine_prefill_ms": own[ENGINE[2]]})
        finally:
            client.close()
    return rows


def _report(rows: list[dict[str, float]], show_over_ms: float) -> None:
    print("request gateway engine prompt cached | TTFT routing upstream-first-byte "
          "engine-TTFT (ms)")
    for r in rows:
        if r["ttft_ms"] - r["engine_ttft_ms"] > show_over_ms:
            print(f"{r['request']:4d} {r['gateway']} {r['engine']} {r['prompt']:5d} "
                  f"{r['cached']:5d} | {r['ttft_ms']:7.1f} {r['routing_ms']:6.1f} "
                  f"{r['upstream_first_byte_ms']:7.1f} {r['engine_ttft_ms']:7.1f}")
    parts = {
        "client TTFT - engine TTFT": [r["ttft_ms"] - r["engine_ttft_ms"] for r in rows],
        "routing": [r["routing_ms"] for r in rows],
        "upstream first byte - engine TTFT": [r["upstream_first_byte_ms"] - r["engine_ttft_ms"]
                                              for r in rows],
        "relay (TTFT - routing - upstream first byte)": [
            r["ttft_ms"] - r["routing_ms"] - r["upstream_first_byte_ms"] for r in rows],
    }
    for name, values in parts.items():
        print(f"{name:45} {quantiles(values)} ms")


if __name__ == "__main__":
    main()
