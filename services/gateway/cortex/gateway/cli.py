"""``cortex gateway``: run the gateway until SIGINT/SIGTERM.

Configuration comes from ``--config`` (TOML or JSON; default ``$CORTEX_GATEWAY_CONFIG``) and
``CORTEX_GATEWAY_*`` environment variables (see :mod:`cortex.gateway.config`); ``--host``,
``--port`` and the admission flags (sglang-router's names: ``--max-concurrent-requests``,
``--queue-size``, ``--queue-timeout-secs``) override both. Exit codes: 0 clean stop, 2 bad
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

from cortex.telemetry import add_logging_flags, configure_logging, stop_signals

__all__ = ["register"]

GC_THRESHOLDS = (10_000, 10, 10)
"""Cyclic GC generations' thresholds in the gateway process (CPython's are 700, 10, 10):
requests allocate many short-lived containers, and the default made collections ~5 % of
the CPU under load."""


def register(subparsers: argparse._SubParsersAction[Any]) -> None:
    parser = subparsers.add_parser("gateway", help="run the OpenAI-compatible gateway")
    parser.add_argument("--config", help="config file (.toml or .json)")
    parser.add_argument("--host", help="listen address (overrides server.host)")
    parser.add_argument("--port", type=int, help="listen port (overrides server.port)")
    parser.add_argument("--max-concurrent-requests", type=int, metavar="N",
                        help="inference requests in service at once, 0 = no limit "
                             "(overrides admission.max_concurrent_requests)")
    parser.add_argument("--queue-size", type=int, metavar="N",
                        help="requests waiting for a slot (overrides admission.queue_size)")
    parser.add_argument("--queue-timeout-secs", type=float, metavar="S",
                        help="longest wait for a slot (overrides admission.queue_timeout_s)")
    parser.add_argument("--epp-port", type=int, metavar="PORT",
                        help="also serve Envoy's ext_proc as a Gateway API Inference Extension "
                             "endpoint picker on this gRPC port (docs/kubernetes.md)")
    parser.add_argument("--epp-host", default="0.0.0.0",
                        help="address of the endpoint picker (default: 0.0.0.0)")
    add_logging_flags(parser, log_format="json")
    parser.add_argument("--hash-key", action="store_true",
                        help="print the sha256:<hex> digest of the API key read from stdin "
                             "(for auth.keys) and exit")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from cortex.gateway.auth import hash_key
    from cortex.gateway.config import load_config
    from cortex.gateway.errors import ConfigError

    if args.hash_key:
        key = sys.stdin.readline().strip()
        if not key:
            print("cortex gateway: no key on stdin", file=sys.stderr)
            return 2
        print(hash_key(key))
        return 0

    configure_logging(args.log_level, args.log_format)
    env = dict(os.environ)
    if args.host:
        env["CORTEX_GATEWAY_SERVER_HOST"] = args.host
    if args.port is not None:
        env["CORTEX_GATEWAY_SERVER_PORT"] = str(args.port)
    for flag, var in (("max_concurrent_requests", "MAX_CONCURRENT_REQUESTS"),
                      ("queue_size", "QUEUE_SIZE"), ("queue_timeout_secs", "QUEUE_TIMEOUT_S")):
        if getattr(args, flag) is not None:
            env[f"CORTEX_GATEWAY_ADMISSION_{var}"] = str(getattr(args, flag))
    try:
        config = load_config(args.config, env)
    except ConfigError as exc:
        print(f"cortex gateway: invalid configuration: {exc}", file=sys.stderr)
        return 2
    if args.epp_port is not None and not 0 <= args.epp_port <= 65535:
        print(f"cortex gateway: --epp-port must be in 0..65535, got {args.epp_port}",
              file=sys.stderr)
        return 2
    epp = None if args.epp_port is None else (args.epp_host, args.epp_port)
    try:
        asyncio.run(_serve(config, env, epp))
    except ConfigError as exc:  # what only start-up can check (a token file, say)
        print(f"cortex gateway: invalid configuration: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:
        logging.getLogger("cortex.gateway").error("gateway failed: %s (%r)", exc, exc.__cause__)
        return 1
    return 0


async def _serve(config: Any, env: dict[str, str], epp: tuple[str, int] | None = None
                 ) -> None:
    with stop_signals() as stop:
        await _run(config, env, epp, stop)


async def _run(config: Any, env: dict[str, str], epp: tuple[str, int] | None,
               stop: asyncio.Event) -> None:
    import contextlib

    from cortex.gateway.server import GatewayServer

    async with GatewayServer(config, environ=env) as server, \
            contextlib.AsyncExitStack() as stack:
        if epp is not None:
            from cortex.gateway.epp_server import EppServer

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
