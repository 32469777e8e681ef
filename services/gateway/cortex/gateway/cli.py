"""``cortex gateway``: run the gateway until SIGINT/SIGTERM.

Configuration comes from ``--config`` (TOML or JSON; default ``$CORTEX_GATEWAY_CONFIG``) and
``CORTEX_GATEWAY_*`` environment variables (see :mod:`cortex.gateway.config.gateway`); the flags
``--server-host`` / ``--host``, ``--server-port`` / ``--port`` and the admission ones (also
under sglang-router's names: ``--max-concurrent-requests``, ``--queue-size``,
``--queue-timeout-secs``) override both. Exit codes: 0 clean stop, 2 bad
configuration, 1 start failure.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import sys
from typing import Any

from cortex.edge.serve import add_logging_flags, serve
from cortex.gateway.config.gateway import FLAGS, SETTINGS

__all__ = ["register"]

GC_THRESHOLDS = (10_000, 10, 10)
"""Cyclic GC generations' thresholds in the gateway process (CPython's are 700, 10, 10):
requests allocate many short-lived containers, and the default made collections ~5 % of
the CPU under load."""


def register(subparsers: argparse._SubParsersAction[Any]) -> None:
    parser = subparsers.add_parser("gateway", help="run the OpenAI-compatible gateway")
    SETTINGS.add_arguments(parser, only=FLAGS)
    parser.add_argument("--epp-port", type=int, metavar="PORT",
                        help="also serve Envoy's ext_proc as a Gateway API Inference Extension "
                             "endpoint picker on this gRPC port (docs/kubernetes.md)")
    parser.add_argument("--epp-host", default="0.0.0.0",
                        help="address of the endpoint picker (default: 0.0.0.0)")
    add_logging_flags(parser, "gateway", log_format="json")
    parser.add_argument("--hash-key", action="store_true",
                        help="print the sha256:<hex> digest of the API key read from stdin "
                             "(for auth.keys) and exit")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from cortex.gateway.config.gateway import load_config
    from cortex.gateway.errors import ConfigError
    from cortex.gateway.http.auth import hash_key

    if args.hash_key:
        key = sys.stdin.readline().strip()
        if not key:
            print("cortex gateway: no key on stdin", file=sys.stderr)
            return 2
        print(hash_key(key))
        return 0

    if args.epp_port is not None and not 0 <= args.epp_port <= 65535:
        print(f"cortex gateway: --epp-port must be in 0..65535, got {args.epp_port}",
              file=sys.stderr)
        return 2
    epp = None if args.epp_port is None else (args.epp_host, args.epp_port)
    env = dict(os.environ)

    async def main(config: Any, stop: asyncio.Event) -> None:
        await _serve(config, env, epp, stop)

    # RuntimeError: what the gateway raises when it cannot start
    return serve("gateway", args, env, lambda: load_config(None, env, args=args), main,
                 config_errors=(ConfigError,), start_errors=(RuntimeError, OSError))


async def _serve(config: Any, env: dict[str, str], epp: tuple[str, int] | None,
                 stop: asyncio.Event) -> None:
    import contextlib

    from cortex.gateway.server import GatewayServer

    async with GatewayServer(config, environ=env) as server, \
            contextlib.AsyncExitStack() as stack:
        if epp is not None:
            from cortex.gateway.epp.server import EppServer

            await stack.enter_async_context(EppServer(server.gateway, *epp))
        # what start-up built (tokenizers, templates, modules) lives as long as the process:
        # out of the collector's sight, old-generation passes no longer walk it
        gc.collect()
        gc.freeze()
        gc.set_threshold(*GC_THRESHOLDS)
        logging.getLogger("cortex.gateway").info("gateway listening on %s", server.url)
        await stop.wait()
        stop.clear()  # a second signal cuts the drain delay short
        drain = asyncio.create_task(server.drain())
        again = asyncio.create_task(stop.wait())
        await asyncio.wait((drain, again), return_when=asyncio.FIRST_COMPLETED)
        drain.cancel()
        again.cancel()
        logging.getLogger("cortex.gateway").info("closing the listener; in-flight requests "
                                                 "finish")
