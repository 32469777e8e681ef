"""The ingest service's exceptions, grouped by who should react."""

from __future__ import annotations

__all__ = ["ConfigError", "IndexUnavailable", "IngestError"]


class IngestError(Exception):
    """Base of every error the ingest service raises."""


class ConfigError(IngestError, ValueError):
    """The ingest configuration is invalid: the operator fixes flags or config; nothing ran."""


class IndexUnavailable(IngestError):
    """An index replica cannot be reached or broke the Sync stream. The forwarder retries
    with backoff; other replicas are unaffected."""
