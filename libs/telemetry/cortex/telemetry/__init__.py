"""What every Cortex service shares for observability: one logging setup (JSON lines or
text, the same fields everywhere) and OpenTelemetry tracing over OTLP/HTTP."""

from cortex.telemetry.logs import (
    LOG_FORMATS,
    LOG_LEVELS,
    JsonFormatter,
    add_logging_flags,
    configure_logging,
)

__all__ = ["LOG_FORMATS", "LOG_LEVELS", "JsonFormatter", "add_logging_flags",
           "configure_logging"]
