"""``cortex index``: run one index process until SIGTERM / SIGINT.

Settings come from flags, each with a ``CORTEX_INDEX_*`` environment fallback (the flag
wins); they are read here only and handed down as one :class:`IndexConfig`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Mapping
from typing import Any

from cortex.index.config import IndexConfig
from cortex.index.errors import ConfigError
from cortex.telemetry import add_logging_flags, configure_logging, stop_signals

__all__ = ["config_from_args", "register", "run"]

log = logging.getLogger(__name__)

# flag dest -> (type, help); the env fallback is CORTEX_INDEX_<DEST upper-cased>
_FIELDS: dict[str, tuple[type, str]] = {
    "host": (str, "gRPC bind address"),
    "port": (int, "gRPC port (0 = ephemeral)"),
    "metrics_host": (str, "Prometheus bind address"),
    "metrics_port": (int, "Prometheus /metrics port (0 = ephemeral, -1 = disabled)"),
    "peer_token_file": (str, "file with the token Sync / Replicate callers must present"),
    "query_token_file": (str, "file with the token Match / Workers / Stats / Changes need"),
    "memory_budget_bytes": (int, "estimated tree bytes before LRU leaf eviction (0 = none)"),
    "low_watermark": (float, "eviction stops at this fraction of the budget"),
    "max_query_blocks": (int, "most block keys in one Match"),
    "max_query_tokens": (int, "most token ids in one Match"),
    "changes_max_keys": (int, "removed keys kept for the change feed"),
    "changes_max_records": (int, "change records kept for the change feed"),
    "changes_batch_keys": (int, "most removed keys in one ChangeBatch"),
    "changes_heartbeat_s": (float, "idle change-feed heartbeat interval (s)"),
    "resync_retry_s": (float, "re-request a missing snapshot after this long (s)"),
    "max_tombstones": (int, "removed sources remembered"),
    "apply_slice_s": (float, "a Sync batch yields to queries after this much work (s)"),
    "ingest_grace_s": (float, "silent ingest's sources turn SYNCING after (s, 0 = never)"),
    "replica_heartbeat_s": (float, "idle replica-stream heartbeat interval (s)"),
    "replica_flush_s": (float, "changes within this long reach replicas as one batch (s)"),
    "replica_queue_bytes": (int, "bytes queued for one replica before it must resync"),
    "replica_chunk_bytes": (int, "largest snapshot batch sent to a replica (bytes)"),
    "shutdown_grace_s": (float, "grace for in-flight calls on SIGTERM (s)"),
}


def register(subparsers: argparse._SubParsersAction[Any]) -> None:
    """Add ``cortex index`` to the umbrella CLI."""
    parser = subparsers.add_parser(
        "index",
        help="run the index service (radix hash trees, Match / Sync / Changes over gRPC)",
        description=__doc__,
    )
    defaults = IndexConfig()
    for dest, (kind, text) in _FIELDS.items():
        default = getattr(defaults, dest)
        parser.add_argument(
            "--" + dest.replace("_", "-"),
            dest=dest,
            type=kind,
            default=None,
            help=f"{text} [env CORTEX_INDEX_{dest.upper()}, default {default}]",
        )
    add_logging_flags(parser, level=None)  # default: $CORTEX_INDEX_LOG_LEVEL, else info
    parser.set_defaults(func=run)


def config_from_args(args: argparse.Namespace, environ: Mapping[str, str]) -> IndexConfig:
    """The config of flags (first), ``CORTEX_INDEX_*`` variables, then defaults."""
    values: dict[str, Any] = {}
    for dest, (kind, _) in _FIELDS.items():
        value = getattr(args, dest, None)
        if value is None:
            raw = environ.get(f"CORTEX_INDEX_{dest.upper()}")
            if raw is None or raw == "":
                continue
            try:
                value = kind(raw)
            except ValueError as exc:
                raise ConfigError(f"CORTEX_INDEX_{dest.upper()}={raw!r}: {exc}") from exc
        values[dest] = value
    if values.get("metrics_port") == -1:
        values["metrics_port"] = None
    return IndexConfig(**values)


async def _serve(config: IndexConfig) -> None:
    from cortex.index.server import IndexServer

    with stop_signals() as stop:
        async with IndexServer(config) as server:
            print(f"cortex index: serving on {server.target} (index_id {server.index_id})",
                  flush=True)
            await stop.wait()
            log.info("signal received: draining")


def run(args: argparse.Namespace) -> int:
    """Entry of ``cortex index``: 0 after a clean stop, 2 on a configuration error."""
    level = args.log_level or os.environ.get("CORTEX_INDEX_LOG_LEVEL") or "info"
    configure_logging(level, args.log_format)
    try:
        config = config_from_args(args, os.environ)
    except (ConfigError, TypeError) as exc:
        print(f"cortex index: invalid configuration: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(_serve(config))
    except OSError as exc:
        print(f"cortex index: cannot serve: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:  # a token file that cannot be read
        print(f"cortex index: invalid configuration: {exc}", file=sys.stderr)
        return 2
    return 0
