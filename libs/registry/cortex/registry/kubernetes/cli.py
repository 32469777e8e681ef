"""``cortex discover-pods``: register the Ready worker pods of a namespace (until SIGTERM).

Settings are :class:`DiscoveryConfig`'s, read by :mod:`cortex.edge.settings`: a file
(``--config`` / ``CORTEX_DISCOVERY_CONFIG``), then ``CORTEX_DISCOVERY_<FIELD>`` variables
(``CORTEX_DISCOVERY_REDIS_URL``, ``CORTEX_DISCOVERY_NAMESPACE``, ``CORTEX_DISCOVERY_SELECTOR``,
``CORTEX_DISCOVERY_METRICS_HOST``, ``CORTEX_DISCOVERY_METRICS_PORT``, ...), then flags. In a
pod, what is not given defaults from the service account: the API server
(``$KUBERNETES_SERVICE_HOST`` / ``$KUBERNETES_SERVICE_PORT``), its token, CA and namespace
(``/var/run/secrets/kubernetes.io/serviceaccount/``). A bad setting exits 2.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cortex.edge.serve import add_logging_flags, serve
from cortex.edge.settings import SettingsSpec
from cortex.registry.kubernetes.config import DiscoveryConfig
from cortex.registry.kubernetes.service import DiscoveryService

__all__ = ["SERVICE_ACCOUNT", "SETTINGS", "build_config", "register"]

log = logging.getLogger(__name__)

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")

SETTINGS = SettingsSpec(
    DiscoveryConfig, "discovery",
    aliases={"CORTEX_REDIS_URL": "redis_url"},  # deprecated (docs/configuration.md)
    flag_names={"redis_url": ("--redis",), "lease_ttl_s": ("--lease-ttl",),
                "tombstone_ttl_s": ("--tombstone-ttl",),
                "watch_timeout_s": ("--watch-timeout",)},
)


def register(subparsers: argparse._SubParsersAction[Any]) -> None:
    parser = subparsers.add_parser(
        "discover-pods", help="register Kubernetes worker pods in the registry",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    SETTINGS.add_arguments(parser)
    add_logging_flags(parser, "discovery")
    parser.set_defaults(func=_cmd_run)


def _in_pod(name: str) -> str | None:
    path = SERVICE_ACCOUNT / name
    return str(path) if path.is_file() else None


def build_config(args: argparse.Namespace, environ: Mapping[str, str]) -> DiscoveryConfig:
    """Flags, ``CORTEX_DISCOVERY_*``, the file, then the in-cluster defaults -> a validated
    config; ``ValueError`` (a :class:`~cortex.edge.settings.SettingsError` names its key)."""
    data = SETTINGS.collect(args, environ)
    if not data.get("redis_url"):
        raise ValueError("--redis URL is required (or set $CORTEX_DISCOVERY_REDIS_URL)")
    if not data.get("api_url"):
        host, port = environ.get("KUBERNETES_SERVICE_HOST"), environ.get(
            "KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise ValueError("--api-url is required outside a pod ($KUBERNETES_SERVICE_HOST "
                             "is not set)")
        data["api_url"] = f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"
    if not data.get("namespace"):
        path = _in_pod("namespace")
        if path is None:
            raise ValueError("--namespace is required outside a pod")
        data["namespace"] = Path(path).read_text(encoding="utf-8").strip()
    for name, file in (("token_file", "token"), ("ca_file", "ca.crt")):
        if not data.get(name):
            data[name] = _in_pod(file)
    config: DiscoveryConfig = SETTINGS.build(data)
    return config


def _cmd_run(args: argparse.Namespace) -> int:
    return serve("discover-pods", args, os.environ, lambda: build_config(args, os.environ),
                 _serve, config_errors=(ValueError,))


async def _serve(config: DiscoveryConfig, stop: asyncio.Event) -> None:
    async with DiscoveryService(config) as service:
        log.info("discovering pods namespace=%s selector=%r at %s; metrics on port %s",
                 config.namespace, config.selector, config.api_url, service.metrics_port)
        await stop.wait()
