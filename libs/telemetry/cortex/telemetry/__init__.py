"""What every Cortex service shares at its edge: one logging setup (JSON lines or text, the
same fields everywhere), OpenTelemetry tracing over OTLP/HTTP, and how it is told to stop."""

from cortex.telemetry.logs import (
    LOG_FORMATS,
    LOG_LEVELS,
    JsonFormatter,
    configure_logging,
)
from cortex.telemetry.signals import stop_signals

__all__ = ["LOG_FORMATS", "LOG_LEVELS", "JsonFormatter", "configure_logging", "stop_signals"]
