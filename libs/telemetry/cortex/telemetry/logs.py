"""One logging setup for the services (their ``--log-format json|text`` and ``--log-level``
flags are :func:`cortex.edge.serve.add_logging_flags`).

JSON lines carry ``ts`` (Unix seconds), ``level``, ``logger``, ``msg`` and every structured
field a call passed in ``extra`` (``worker``, ``request_id``, ``mode``, ``model``, ``status``,
``latency_ms``, …), so one log pipeline parses all three services the same way.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import IO, Any

__all__ = ["LOG_FORMATS", "LOG_LEVELS", "JsonFormatter", "configure_logging"]

LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("json", "text")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# what every LogRecord has: anything else on a record came from ``extra``
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: the record's basics and its structured fields."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for name, value in vars(record).items():
            if name not in _STANDARD and not name.startswith("_") and value is not None:
                entry[name] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure_logging(level: str, log_format: str, stream: IO[str] | None = None) -> None:
    """Route the root logger to ``stream`` (stderr) in ``log_format`` at ``level``."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json"
                         else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
