"""``cortex sim``: run one simulated SGLang / vLLM worker until SIGTERM / SIGINT.

Once every listener is bound it prints one line to stdout,
``CORTEX_SIM_READY {json}`` with the real ports (useful with port 0; with ``--dp-size`` N
also ``dp_size``: rank r publishes on ``kv_events_port + r`` and replays on
``replay_port + r``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
from typing import Any

from cortex.hashing import Engine
from cortex.sim.config import FaultConfig, FaultScope, Role, SimConfig, TimingConfig

__all__ = ["READY_PREFIX", "build_config", "register", "run"]

READY_PREFIX = "CORTEX_SIM_READY "

log = logging.getLogger(__name__)

_DEFAULT_HTTP_PORT = {Engine.SGLANG: 30000, Engine.VLLM: 8000}


def _output_range(text: str) -> tuple[int, int]:
    low, sep, high = text.partition(":")
    try:
        return (int(low), int(high if sep else low))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN:MAX tokens, got {text!r}") from None


def register(subparsers: argparse._SubParsersAction[Any]) -> None:
    p = subparsers.add_parser(
        "sim", help="run a simulated SGLang / vLLM worker (no GPU)",
        description="A simulated SGLang or vLLM worker: the engine's HTTP API, paged prefix "
        "cache with LRU eviction, real KV events (ZMQ PUB + replay), timing model, PD "
        "handshakes and fault injection.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("engine")
    g.add_argument("--engine", required=True, choices=[e.value for e in Engine])
    g.add_argument("--engine-version", default="",
                   help="wire format version (default: SGLang 0.5.23, vLLM 0.33.0)")
    g.add_argument("--role", default=Role.REGULAR.value, choices=[r.value for r in Role])
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=None,
                   help="HTTP port (0 = any free port; default SGLang 30000, vLLM 8000)")
    g.add_argument("--advertise-host", default=None,
                   help="host peers dial when --host is a wildcard")
    g.add_argument("--model", default="cortex-sim", help="served model name")
    g.add_argument("--tokenizer", default=None,
                   help="tokenizer.json or its directory (default: DeepSeek-V4 tokenizer)")
    g.add_argument("--chat-template", default=None,
                   help="Jinja chat template file (default: the repo's DeepSeek-V4 template)")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block / page")
    g.add_argument("--eagle-lookahead", type=int, default=0, metavar="L",
                   help="speculative decoding with prefix caching: tokens after a block its"
                        " reuse needs (vLLM EAGLE 1, MTP: speculative tokens; SGLang EAGLE 1)")
    g.add_argument("--eagle-drop", action="store_true",
                   help="vLLM EAGLE with legacy block hashes (a KV connector is configured):"
                        " a lookup drops the last block it matched")
    g.add_argument("--kv-capacity-blocks", type=int, default=8192, help="KV pool size (blocks)")
    g.add_argument("--host-capacity-blocks", type=int, default=0,
                   help="host tier for blocks evicted from the GPU (blocks; 0 = none)")
    g.add_argument("--lora-adapters", default="",
                   help="comma list of LoRA adapter names served on top of the model")
    g.add_argument("--max-running", type=int, default=64, help="requests in service at once")
    g.add_argument("--max-model-len", type=int, default=131072, help="context length (tokens)")
    g.add_argument("--seed", type=int, default=0, help="seed of the generated text")
    g.add_argument("--output-tokens", type=_output_range, default=(16, 64),
                   help="natural answer length range MIN:MAX (tokens)")
    g.add_argument("--engine-id", default=None, help="vLLM remote_engine_id to advertise")
    g.add_argument("--api-key", default=None,
                   help="require Authorization: Bearer <key> (like the engines' --api-key)")
    g.add_argument("--dp-size", type=int, default=1,
                   help="data-parallel ranks, each with its own KV pool, prefix cache and "
                   "KV-event PUB / replay on the base port + rank")
    e = p.add_argument_group("KV events")
    e.add_argument("--kv-events-port", type=int, default=5557, help="ZMQ PUB port (0 = any)")
    e.add_argument("--replay-port", type=int, default=None,
                   help="replay ROUTER port (0 = any; default: no replay socket)")
    e.add_argument("--topic", default="")
    e.add_argument("--buffer-steps", type=int, default=10_000,
                   help="batches kept for replay")
    t = p.add_argument_group("timing")
    t.add_argument("--prefill-ms-per-token", type=float, default=0.02,
                   help="prefill cost per uncached prompt token (ms)")
    t.add_argument("--prefill-overhead-ms", type=float, default=2.0,
                   help="fixed cost of every prefill (ms)")
    t.add_argument("--decode-ms-per-token", type=float, default=5.0,
                   help="cost of each further output token (ms)")
    t.add_argument("--host-load-ms-per-token", type=float, default=0.005,
                   help="cost of loading one cached token back from the host tier (ms)")
    t.add_argument("--zero-cost", action="store_true", help="no simulated time at all")
    d = p.add_argument_group("prefill/decode")
    d.add_argument("--bootstrap-port", type=int, default=None,
                   help="SGLang prefill bootstrap server port (default 8998; 0 = any)")
    d.add_argument("--transfer-port", type=int, default=0,
                   help="prefill KV side-channel port (0 = any)")
    d.add_argument("--bootstrap-timeout-s", type=float, default=300.0,
                   help="prefill: wait this long for the decode's handshake")
    d.add_argument("--transfer-timeout-s", type=float, default=300.0,
                   help="decode: wait this long for the prefill's KV")
    d.add_argument("--kv-hold-timeout-s", type=float, default=480.0,
                   help="vLLM prefill: free unread blocks after this long")
    f = p.add_argument_group("faults (also at run time: POST /sim/faults)")
    f.add_argument("--drop-batches", type=int, default=0, help="drop the next N event batches")
    f.add_argument("--duplicate-batches", type=int, default=0, help="send the next N twice")
    f.add_argument("--reorder-batches", type=int, default=0,
                   help="swap each of the next N batches with its successor")
    f.add_argument("--http-down", action="store_true", help="leave HTTP requests unanswered")
    f.add_argument("--error-rate", type=float, default=0.0, help="probability of an HTTP error")
    f.add_argument("--error-status", type=int, default=500)
    f.add_argument("--latency-ms", type=float, default=0.0, help="added to each request in scope")
    f.add_argument("--fault-paths", default=FaultScope.GENERATION.value,
                   choices=[scope.value for scope in FaultScope],
                   help="paths the three HTTP faults above hit: the generation endpoints, or "
                   "all engine paths (health and load probes too)")
    f.add_argument("--cut-stream-after", type=int, default=None,
                   help="cut streams after K chunks")
    f.add_argument("--stall-stream-after", type=int, default=None,
                   help="stall streams after K chunks (0: after the headers), connection open")
    p.add_argument("--log-level", default="info",
                   choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=run)


def build_config(args: argparse.Namespace) -> SimConfig:
    """The validated config of a parsed ``cortex sim`` command line (``ValueError``)."""
    engine = Engine(args.engine)
    return SimConfig(
        engine=engine,
        engine_version=args.engine_version,
        role=Role(args.role),
        host=args.host,
        port=_DEFAULT_HTTP_PORT[engine] if args.port is None else args.port,
        kv_events_port=args.kv_events_port,
        replay_port=args.replay_port,
        topic=args.topic,
        model=args.model,
        api_key=args.api_key,
        tokenizer=args.tokenizer,
        chat_template=args.chat_template,
        block_size=args.block_size,
        eagle_lookahead=args.eagle_lookahead,
        eagle_drop=args.eagle_drop,
        kv_capacity_blocks=args.kv_capacity_blocks,
        host_capacity_blocks=args.host_capacity_blocks,
        lora_adapters=tuple(a for a in args.lora_adapters.split(",") if a),
        max_running=args.max_running,
        max_model_len=args.max_model_len,
        buffer_steps=args.buffer_steps,
        timing=TimingConfig(
            prefill_ms_per_uncached_token=args.prefill_ms_per_token,
            prefill_overhead_ms=args.prefill_overhead_ms,
            decode_ms_per_token=args.decode_ms_per_token,
            host_load_ms_per_token=args.host_load_ms_per_token,
            zero_cost=args.zero_cost,
        ),
        faults=FaultConfig(
            drop_batches=args.drop_batches,
            duplicate_batches=args.duplicate_batches,
            reorder_batches=args.reorder_batches,
            http_down=args.http_down,
            error_rate=args.error_rate,
            error_status=args.error_status,
            latency_ms=args.latency_ms,
            cut_stream_after=args.cut_stream_after,
            stall_stream_after=args.stall_stream_after,
            fault_paths=FaultScope(args.fault_paths),
        ),
        bootstrap_port=args.bootstrap_port,
        transfer_port=args.transfer_port,
        bootstrap_timeout_s=args.bootstrap_timeout_s,
        transfer_timeout_s=args.transfer_timeout_s,
        kv_hold_timeout_s=args.kv_hold_timeout_s,
        seed=args.seed,
        output_tokens=args.output_tokens,
        advertise_host=args.advertise_host,
        engine_id=args.engine_id,
        dp_size=args.dp_size,
    )


async def serve(config: SimConfig) -> None:
    """Run one sim until SIGTERM / SIGINT; prints the ready line once bound."""
    from cortex.sim.server import SimServer

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        async with SimServer(config) as sim:
            ready = {"url": sim.url, "port": sim.port, "kv_events_port": sim.kv_events_port,
                     "replay_port": sim.replay_port, "bootstrap_port": sim.bootstrap_port,
                     "transfer_port": sim.transfer_port, "engine": config.engine.value,
                     "engine_version": config.engine_version, "role": config.role.value}
            if config.dp_size > 1:
                ready["dp_size"] = config.dp_size
            print(READY_PREFIX + json.dumps(ready), flush=True)
            await stop.wait()
            log.info("stopping")
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = build_config(args)
    except ValueError as exc:
        print(f"cortex sim: error: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(serve(config))
    except OSError as exc:
        print(f"cortex sim: cannot start: {exc}", file=sys.stderr)
        return 1
    return 0
