"""``cortex index``: run one index process until SIGTERM / SIGINT.

Settings come from :class:`IndexConfig` through :mod:`cortex.edge.settings`: a file
(``--config`` / ``CORTEX_INDEX_CONFIG``), then ``CORTEX_INDEX_<FIELD>`` variables, then
``--<field>`` flags (the flag wins); they are read here only and handed down as one config.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from collections.abc import Mapping
from typing import Any

from cortex.edge.serve import add_logging_flags, serve
from cortex.edge.settings import SettingsError, SettingsSpec
from cortex.index.config import IndexConfig
from cortex.index.errors import ConfigError

__all__ = ["SETTINGS", "config_from_args", "register", "run"]

log = logging.getLogger(__name__)

SETTINGS = SettingsSpec(IndexConfig, "index")


def register(subparsers: argparse._SubParsersAction[Any]) -> None:
    """Add ``cortex index`` to the umbrella CLI."""
    parser = subparsers.add_parser(
        "index",
        help="run the index service (radix hash trees, Match / Sync / Changes over gRPC)",
        description=__doc__,
    )
    SETTINGS.add_arguments(parser)
    add_logging_flags(parser, "index")
    parser.set_defaults(func=run)


def config_from_args(args: argparse.Namespace, environ: Mapping[str, str]) -> IndexConfig:
    """The config of flags (first), ``CORTEX_INDEX_*`` variables, the file, then defaults;
    :class:`ConfigError` naming the bad key."""
    try:
        config: IndexConfig = SETTINGS.load(args, environ)
    except SettingsError as exc:
        raise ConfigError(str(exc)) from None
    return config


async def _serve(config: IndexConfig, stop: asyncio.Event) -> None:
    from cortex.index.server import IndexServer

    async with IndexServer(config) as server:
        print(f"cortex index: serving on {server.target} (index_id {server.index_id})",
              flush=True)
        await stop.wait()
        log.info("signal received: draining")


def run(args: argparse.Namespace) -> int:
    """Entry of ``cortex index``: 0 after a clean stop, 2 on a configuration error (a token
    file that cannot be read included), 1 when it cannot serve."""
    return serve("index", args, os.environ, lambda: config_from_args(args, os.environ), _serve,
                 config_errors=(ConfigError, ValueError))
