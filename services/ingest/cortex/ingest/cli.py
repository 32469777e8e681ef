"""``cortex ingest``: run an ingest process, or ask which shard owns a worker.

``cortex ingest run`` reads :class:`IngestConfig` through :mod:`cortex.edge.settings`: a file
(``--config`` / ``CORTEX_INGEST_CONFIG``), then ``CORTEX_INGEST_<FIELD>`` variables
(``CORTEX_INGEST_REDIS_URL``, ``CORTEX_INGEST_INDEX`` — comma separated ``HOST:PORT`` —,
``CORTEX_INGEST_SHARD``, ``CORTEX_INGEST_FORWARDER_HEARTBEAT_S``, ...), then ``--<field>``
flags; today's short flags (``--redis``, ``--index``, ``--max-pending``, ``--queue-max``,
``--heartbeat``, ...) still work. Sizes take ``KiB`` / ``MiB`` / ``GiB`` suffixes. Everything
is validated before anything starts; a bad setting exits 2 with a clear message. SIGTERM /
SIGINT stop the process cleanly.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys
from collections.abc import Mapping
from typing import Any

from cortex.edge.serve import add_logging_flags, serve
from cortex.edge.settings import SettingsError, SettingsSpec
from cortex.ingest.config import IngestConfig
from cortex.ingest.errors import ConfigError
from cortex.ingest.service import IngestService
from cortex.ingest.shard import ShardSpec, shard_of

__all__ = ["SETTINGS", "build_config", "register"]

log = logging.getLogger(__name__)

SETTINGS = SettingsSpec(
    IngestConfig, "ingest",
    aliases={  # deprecated names (docs/configuration.md: removed in the release after next)
        "CORTEX_REDIS_URL": "redis_url", "CORTEX_INDEX": "index", "CORTEX_INGEST_ID": "ingest_id",
    },
    flag_names={  # today's short spellings, kept for scripts
        "redis_url": ("--redis",), "registry_namespace": ("--namespace",),
        "poll_interval_s": ("--poll-interval",), "use_channel": ("--channel",),
        "replay_timeout_s": ("--replay-timeout",), "max_pending_batches": ("--max-pending",),
        "forwarder.queue_max_updates": ("--queue-max",),
        "forwarder.queue_max_bytes": ("--queue-max-bytes",),
        "forwarder.source_queue_max_bytes": ("--source-queue-max-bytes",),
        "forwarder.heartbeat_s": ("--heartbeat",),
    },
)


def register(subparsers: argparse._SubParsersAction[Any]) -> None:
    parser = subparsers.add_parser(
        "ingest", help="KV-event ingest: engines' events -> index ledgers",
        description="Follow every registered worker's KV events and feed the index.",
    )
    parser.set_defaults(func=lambda _args: _usage(parser))
    sub = parser.add_subparsers(dest="ingest_command", metavar="COMMAND")

    run = sub.add_parser("run", help="run an ingest process (until SIGTERM / SIGINT)",
                         description=__doc__,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    SETTINGS.add_arguments(run)
    add_logging_flags(run, "ingest")
    run.set_defaults(func=_cmd_run)

    owner = sub.add_parser("shard-of", help="print which shard owns each worker id")
    owner.add_argument("--shards", type=int, required=True, metavar="K")
    owner.add_argument("worker_ids", nargs="+", metavar="ID")
    owner.set_defaults(func=_cmd_shard_of)


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2


def build_config(args: argparse.Namespace, environ: Mapping[str, str] | None = None
                 ) -> IngestConfig:
    """Flags, then ``CORTEX_INGEST_*`` (and the deprecated names), then the file -> a
    validated config; :class:`ConfigError` naming the bad key."""
    environ = os.environ if environ is None else environ
    try:
        data = SETTINGS.collect(args, environ)
    except SettingsError as exc:
        raise ConfigError(str(exc)) from None
    if not data.get("redis_url"):
        raise ConfigError("--redis URL is required (or set $CORTEX_INGEST_REDIS_URL)")
    if not data.get("index"):
        raise ConfigError("at least one --index HOST:PORT is required (or set "
                          "$CORTEX_INGEST_INDEX)")
    if not data.get("ingest_id"):
        shard = data.get("shard") or ShardSpec()
        data["ingest_id"] = f"ingest-{shard.index}of{shard.count}@{socket.gethostname()}"
    try:
        config: IngestConfig = SETTINGS.build(data)
    except SettingsError as exc:
        raise ConfigError(str(exc)) from None
    return config


def _cmd_run(args: argparse.Namespace) -> int:
    return serve("ingest", args, os.environ, lambda: build_config(args), _serve,
                 config_errors=(ConfigError, ValueError))


async def _serve(config: IngestConfig, stop: asyncio.Event) -> None:
    async with IngestService(config, environ=os.environ) as service:
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
