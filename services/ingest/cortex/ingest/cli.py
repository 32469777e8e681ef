"""``cortex ingest``: run an ingest process, or ask which shard owns a worker.

Flags win over environment variables (``CORTEX_REDIS_URL``, ``CORTEX_INDEX`` — comma
separated ``HOST:PORT`` —, ``CORTEX_INGEST_SHARD``, ``CORTEX_INGEST_METRICS_HOST``,
``CORTEX_INGEST_METRICS_PORT``, ``CORTEX_INGEST_ID``). Sizes take ``KiB`` / ``MiB`` /
``GiB`` suffixes. Everything is validated before anything starts; a bad setting exits 2
with a clear message. SIGTERM / SIGINT stop the process cleanly.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import socket
import sys
from typing import Any

from cortex.ingest.alignment import AUTO
from cortex.ingest.config import IngestConfig
from cortex.ingest.errors import ConfigError
from cortex.ingest.forwarder import ForwarderConfig, IndexTarget
from cortex.ingest.service import IngestService
from cortex.ingest.shard import ShardSpec, shard_of
from cortex.ledger.grpc import read_token
from cortex.telemetry import add_logging_flags, configure_logging, stop_signals

__all__ = ["build_config", "register"]

log = logging.getLogger(__name__)


def register(subparsers: argparse._SubParsersAction[Any]) -> None:
    parser = subparsers.add_parser(
        "ingest", help="KV-event ingest: engines' events -> index ledgers",
        description="Follow every registered worker's KV events and feed the index.",
    )
    parser.set_defaults(func=lambda _args: _usage(parser))
    sub = parser.add_subparsers(dest="ingest_command", metavar="COMMAND")

    env = os.environ.get
    run = sub.add_parser("run", help="run an ingest process (until SIGTERM / SIGINT)")
    run.add_argument("--redis", default=env("CORTEX_REDIS_URL"),
                     help="registry Redis URL (default: $CORTEX_REDIS_URL)")
    run.add_argument("--namespace", default="cortex:v1:", help="registry key prefix")
    run.add_argument("--index", action="append", default=[], metavar="HOST:PORT",
                     help="an index replica (repeatable; default: $CORTEX_INDEX, comma list)")
    run.add_argument("--shard", default=env("CORTEX_INGEST_SHARD", "0/1"), metavar="i/K",
                     help="own the workers whose id hashes to shard i of K (default: 0/1)")
    run.add_argument("--ingest-id", default=env("CORTEX_INGEST_ID", ""),
                     help="name reported to the index (default: ingest-<i>of<K>@<host>)")
    run.add_argument("--metrics-host", default=env("CORTEX_INGEST_METRICS_HOST", "127.0.0.1"),
                     help="address of /metrics and /health (default: 127.0.0.1; 0.0.0.0 "
                          "for every interface)")
    run.add_argument("--metrics-port", type=int,
                     default=int(env("CORTEX_INGEST_METRICS_PORT", "9465")),
                     help="HTTP port for /metrics and /health (-1 = off; default: 9465)")
    run.add_argument("--index-token-file", default=os.environ.get("CORTEX_INGEST_INDEX_TOKEN_FILE"),
                     metavar="PATH",
                     help="file with the index's peer token [env CORTEX_INGEST_INDEX_TOKEN_FILE]")
    run.add_argument("--poll-interval", type=float, default=1.0, metavar="S",
                     help="registry polling interval (<= 1 s)")
    run.add_argument("--no-channel", action="store_true",
                     help="do not subscribe to the registry's pub/sub channel")
    run.add_argument("--replay-timeout", type=float, default=2.0, metavar="S",
                     help="abandon a replay silent for this long")
    run.add_argument("--max-pending", type=int, default=10_000, metavar="N",
                     help="live batches held per source (replaying or waiting for its turn)")
    run.add_argument("--max-pending-bytes", type=_size, default="64MiB", metavar="SIZE",
                     help="payload bytes held per source; over it the source gives its held "
                          "batches up and resets its ledger (default: 64MiB)")
    run.add_argument("--max-held-bytes", type=_size, default="256MiB", metavar="SIZE",
                     help="payload bytes held by all sources; over it the largest holder "
                          "gives up (default: 256MiB)")
    run.add_argument("--turn-bytes", type=_size, default="64KiB", metavar="SIZE",
                     help="payload bytes one source decodes before the next one's turn "
                          "(default: 64KiB)")
    run.add_argument("--max-message-bytes", type=_size, default="32MiB", metavar="SIZE",
                     help="ZMQ MAXMSGSIZE of every event and replay socket (default: 32MiB)")
    run.add_argument("--queue-max", type=int, default=100_000, metavar="N",
                     help="updates queued per index replica before snapshots take over")
    run.add_argument("--queue-max-bytes", type=_size, default="64MiB", metavar="SIZE",
                     help="bytes of updates queued per index replica (default: 64MiB)")
    run.add_argument("--source-queue-max-bytes", type=_size, default="8MiB", metavar="SIZE",
                     help="bytes of updates queued per source and replica (default: 8MiB)")
    run.add_argument("--heartbeat", type=float, default=1.0, metavar="S",
                     help="an idle Sync stream sends an empty batch this often (keep it well "
                          "under the index's --ingest-grace-s)")
    run.add_argument("--align-every", type=int, default=64, metavar="N",
                     help="check 1 in N chain-start stores against engine hashes (0 = off)")
    run.add_argument("--hash-algo", default=AUTO,
                     help="vLLM --prefix-caching-hash-algo for the alignment check "
                          "(default: auto = learn)")
    run.add_argument("--hash-seed", default=None,
                     help="vLLM workers' PYTHONHASHSEED for the alignment check")
    add_logging_flags(run)
    run.set_defaults(func=_cmd_run)

    owner = sub.add_parser("shard-of", help="print which shard owns each worker id")
    owner.add_argument("--shards", type=int, required=True, metavar="K")
    owner.add_argument("worker_ids", nargs="+", metavar="ID")
    owner.set_defaults(func=_cmd_shard_of)


_SIZE = re.compile(r"\s*(\d+)\s*([KMG]i?B?)?\s*", re.IGNORECASE)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def _size(text: str) -> int:
    """``"64MiB"`` -> 67108864 (``K``/``M``/``G`` with or without ``iB``/``B`` are binary)."""
    match = _SIZE.fullmatch(text)
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 65536, 64KiB, 32MiB)")
    return int(match.group(1)) * _UNITS[(match.group(2) or "")[:1].upper()]


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2


def build_config(args: argparse.Namespace) -> IngestConfig:
    """Flags (and their environment defaults) -> a validated config; ``ConfigError``."""
    if not args.redis:
        raise ConfigError("--redis URL is required (or set $CORTEX_REDIS_URL)")
    addresses = list(args.index) or [
        a for a in os.environ.get("CORTEX_INDEX", "").split(",") if a.strip()
    ]
    if not addresses:
        raise ConfigError("at least one --index HOST:PORT is required (or set $CORTEX_INDEX)")
    shard = ShardSpec.parse(args.shard)
    metrics_port = None if args.metrics_port < 0 else args.metrics_port
    ingest_id = args.ingest_id or f"ingest-{shard.index}of{shard.count}@{socket.gethostname()}"
    return IngestConfig(
        index=tuple(IndexTarget.parse(a) for a in addresses),
        index_token=read_token(args.index_token_file) if args.index_token_file else None,
        redis_url=args.redis,
        registry_namespace=args.namespace,
        shard=shard,
        ingest_id=ingest_id,
        metrics_host=args.metrics_host,
        metrics_port=metrics_port,
        poll_interval_s=args.poll_interval,
        use_channel=not args.no_channel,
        replay_timeout_s=args.replay_timeout,
        max_pending_batches=args.max_pending,
        max_pending_bytes=args.max_pending_bytes,
        max_held_bytes=args.max_held_bytes,
        turn_bytes=args.turn_bytes,
        max_message_bytes=args.max_message_bytes,
        align_every=args.align_every,
        hash_algo=args.hash_algo,
        hash_seed=args.hash_seed,
        forwarder=ForwarderConfig(
            queue_max_updates=args.queue_max,
            queue_max_bytes=args.queue_max_bytes,
            source_queue_max_bytes=args.source_queue_max_bytes,
            heartbeat_s=args.heartbeat,
        ),
    )


def _cmd_run(args: argparse.Namespace) -> int:
    try:
        config = build_config(args)
    except (ConfigError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    configure_logging(args.log_level, args.log_format)
    try:
        asyncio.run(_serve(config))
    except OSError as exc:  # e.g. the metrics port is taken
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


async def _serve(config: IngestConfig) -> None:
    with stop_signals() as stop:
        async with IngestService(config) as service:
            log.info("ingest %s running; metrics on port %s", config.ingest_id,
                     service.metrics_port)
            await stop.wait()
            log.info("ingest %s stopping", config.ingest_id)


def _cmd_shard_of(args: argparse.Namespace) -> int:
    if args.shards < 1:
        print("error: --shards must be >= 1", file=sys.stderr)
        return 2
    for worker_id in args.worker_ids:
        print(f"{worker_id}\t{shard_of(worker_id, args.shards)}/{args.shards}")
    return 0
