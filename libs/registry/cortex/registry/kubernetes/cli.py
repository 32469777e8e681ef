"""``cortex discover-pods``: register the Ready worker pods of a namespace (until SIGTERM).

In a pod, everything defaults from the service account: the API server
(``$KUBERNETES_SERVICE_HOST`` / ``$KUBERNETES_SERVICE_PORT``), its token, CA and namespace
(``/var/run/secrets/kubernetes.io/serviceaccount/``). Flags win over environment variables
(``CORTEX_REDIS_URL``, ``CORTEX_DISCOVERY_NAMESPACE``, ``CORTEX_DISCOVERY_SELECTOR``,
``CORTEX_DISCOVERY_METRICS_HOST``, ``CORTEX_DISCOVERY_METRICS_PORT``). A bad setting exits 2.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cortex.registry.kubernetes.config import DiscoveryConfig
from cortex.registry.kubernetes.service import DiscoveryService
from cortex.registry.redis_registry import DEFAULT_NAMESPACE
from cortex.telemetry import add_logging_flags, configure_logging, stop_signals

__all__ = ["SERVICE_ACCOUNT", "build_config", "register"]

log = logging.getLogger(__name__)

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")


def register(subparsers: argparse._SubParsersAction[Any]) -> None:
    env = os.environ.get
    parser = subparsers.add_parser(
        "discover-pods", help="register Kubernetes worker pods in the registry",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--redis", default=env("CORTEX_REDIS_URL"),
                        help="registry Redis URL (default: $CORTEX_REDIS_URL)")
    parser.add_argument("--registry-namespace", default=DEFAULT_NAMESPACE,
                        help="registry key prefix")
    parser.add_argument("--namespace", default=env("CORTEX_DISCOVERY_NAMESPACE"),
                        help="namespace of the worker pods (default: the service account's)")
    parser.add_argument("--selector", default=env("CORTEX_DISCOVERY_SELECTOR", "cortex/engine"),
                        help="label selector of the worker pods (default: cortex/engine)")
    parser.add_argument("--api-url", default=None,
                        help="Kubernetes API server URL (default: the in-cluster one)")
    parser.add_argument("--token-file", default=None, metavar="PATH",
                        help="bearer token file (default: the service account's)")
    parser.add_argument("--ca-file", default=None, metavar="PATH",
                        help="CA bundle of the API server (default: the service account's)")
    parser.add_argument("--lease-ttl", type=float, default=10.0, metavar="S",
                        help="lease of a discovered worker, renewed every third (default: 10)")
    parser.add_argument("--tombstone-ttl", type=float, default=300.0, metavar="S",
                        help="a pod that left stays out this long (default: 300)")
    parser.add_argument("--watch-timeout", type=float, default=300.0, metavar="S",
                        help="each watch is resumed after this long (default: 300)")
    parser.add_argument("--learn-from-engines", action="store_true",
                        help="ask each Ready pod's engine what its annotations do not say "
                             "(model, KV-event endpoints, block size...)")
    parser.add_argument("--metrics-host", default=env("CORTEX_DISCOVERY_METRICS_HOST",
                                                      "127.0.0.1"),
                        help="address of /metrics and /health (default: 127.0.0.1)")
    parser.add_argument("--metrics-port", type=int,
                        default=int(env("CORTEX_DISCOVERY_METRICS_PORT", "9466")),
                        help="HTTP port of /metrics and /health (-1 = off; default: 9466)")
    add_logging_flags(parser)
    parser.set_defaults(func=_cmd_run)


def _in_pod(name: str) -> str | None:
    path = SERVICE_ACCOUNT / name
    return str(path) if path.is_file() else None


def build_config(args: argparse.Namespace, environ: Mapping[str, str]) -> DiscoveryConfig:
    """Flags, then the in-cluster defaults -> a validated config; ``ValueError``."""
    if not args.redis:
        raise ValueError("--redis URL is required (or set $CORTEX_REDIS_URL)")
    api_url = args.api_url
    if api_url is None:
        host, port = environ.get("KUBERNETES_SERVICE_HOST"), environ.get(
            "KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise ValueError("--api-url is required outside a pod ($KUBERNETES_SERVICE_HOST "
                             "is not set)")
        api_url = f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"
    namespace = args.namespace
    if not namespace:
        path = _in_pod("namespace")
        if path is None:
            raise ValueError("--namespace is required outside a pod")
        namespace = Path(path).read_text(encoding="utf-8").strip()
    return DiscoveryConfig(
        api_url=api_url, namespace=namespace, redis_url=args.redis, selector=args.selector,
        token_file=args.token_file or _in_pod("token"), ca_file=args.ca_file or _in_pod("ca.crt"),
        registry_namespace=args.registry_namespace, lease_ttl_s=args.lease_ttl,
        tombstone_ttl_s=args.tombstone_ttl, watch_timeout_s=args.watch_timeout,
        metrics_host=args.metrics_host,
        metrics_port=None if args.metrics_port < 0 else args.metrics_port,
        learn_from_engines=args.learn_from_engines,
    )


def _cmd_run(args: argparse.Namespace) -> int:
    try:
        config = build_config(args, os.environ)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    configure_logging(args.log_level, args.log_format)
    try:
        asyncio.run(_serve(config))
    except OSError as exc:  # e.g. the metrics port is taken
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


async def _serve(config: DiscoveryConfig) -> None:
    with stop_signals() as stop:
        async with DiscoveryService(config) as service:
            log.info("discovering pods namespace=%s selector=%r at %s; metrics on port %s",
                     config.namespace, config.selector, config.api_url, service.metrics_port)
            await stop.wait()
