"""``serve``: the one way a Cortex service process runs.

Logging is configured first (``--log-level`` / ``--log-format``, falling back to
``CORTEX_<SERVICE>_LOG_LEVEL`` / ``_LOG_FORMAT``, then the service's defaults), then the
configuration is built, then the service's async main runs under :func:`stop_signals` until
SIGTERM / SIGINT, on the event loop ``CORTEX_EVENT_LOOP`` names (:mod:`cortex.edge.loop`:
uvloop where installed), logged at startup. Exit codes: 0 clean stop; 2 bad configuration
(one line ``cortex <service>: invalid configuration: …`` on stderr); 1 the service cannot
start (a port taken, say: ``cortex <service>: cannot start: …``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

from cortex.edge.convert import SettingsError
from cortex.edge.loop import EventLoop, choose_loop
from cortex.telemetry import LOG_FORMATS, LOG_LEVELS, configure_logging, stop_signals

__all__ = ["add_logging_flags", "serve"]

C = TypeVar("C")

log = logging.getLogger(__name__)


def add_logging_flags(parser: argparse.ArgumentParser, service: str, *, level: str = "info",
                      log_format: str = "text") -> None:
    """``--log-level`` / ``--log-format``: flag, else ``CORTEX_<SERVICE>_LOG_LEVEL`` /
    ``_LOG_FORMAT``, else ``level`` / ``log_format``."""
    prefix = f"CORTEX_{service.upper().replace('-', '_')}_"
    parser.set_defaults(log_defaults=(level, log_format), log_env_prefix=prefix)
    parser.add_argument("--log-level", default=None, type=str.lower, choices=LOG_LEVELS,
                        help=f"least severe level logged [env {prefix}LOG_LEVEL, default "
                             f"{level}]")
    parser.add_argument("--log-format", default=None, choices=LOG_FORMATS,
                        help=f"json: one object per line; text: for people [env "
                             f"{prefix}LOG_FORMAT, default {log_format}]")


def serve(service: str, args: argparse.Namespace, environ: Mapping[str, str],
          load: Callable[[], C], main: Callable[[C, asyncio.Event], Awaitable[None]], *,
          config_errors: tuple[type[BaseException], ...] = (),
          start_errors: tuple[type[BaseException], ...] = (OSError,)) -> int:
    """Run ``main(config, stop)`` with ``config = load()``; the exit code.

    ``config_errors`` (besides :class:`SettingsError`): what ``load`` — or the start of
    ``main`` (a token file that cannot be read) — raises for a bad setting: exit 2.
    ``start_errors``: what ``main`` raises when the service cannot start: exit 1.
    """
    level, log_format = _logging(args, environ)
    try:
        configure_logging(level, log_format)
    except ValueError as exc:
        return _fail(service, "invalid configuration", exc, 2)
    bad_config: tuple[type[BaseException], ...] = (SettingsError, *config_errors)
    try:
        loop = choose_loop(environ.get("CORTEX_EVENT_LOOP", "auto"))
    except ValueError as exc:
        return _fail(service, "invalid configuration", exc, 2)
    try:
        config = load()
    except bad_config as exc:
        return _fail(service, "invalid configuration", exc, 2)
    try:
        loop.run(_run(main, config, loop))
    except bad_config as exc:
        return _fail(service, "invalid configuration", exc, 2)
    except start_errors as exc:
        return _fail(service, "cannot start", exc, 1)
    return 0


def _logging(args: argparse.Namespace, environ: Mapping[str, str]) -> tuple[str, str]:
    level, log_format = getattr(args, "log_defaults", ("info", "text"))
    prefix = getattr(args, "log_env_prefix", "")
    level = args.log_level or (environ.get(prefix + "LOG_LEVEL") if prefix else None) or level
    log_format = args.log_format or (environ.get(prefix + "LOG_FORMAT") if prefix else None) \
        or log_format
    return str(level).lower(), str(log_format)


async def _run(main: Callable[[Any, asyncio.Event], Awaitable[None]], config: Any,
               loop: EventLoop) -> None:
    log.info("event loop: %s", loop.name, extra={"event_loop": loop.name})
    with stop_signals() as stop:
        await main(config, stop)


def _fail(service: str, what: str, exc: BaseException, code: int) -> int:
    print(f"cortex {service}: {what}: {exc}", file=sys.stderr)
    return code
