"""The index's exceptions: one base, grouped by who has to react."""

from __future__ import annotations

__all__ = ["ConfigError", "IndexServiceError", "InvalidArgument"]


class IndexServiceError(Exception):
    """Base of every error the index raises on purpose."""


class InvalidArgument(IndexServiceError, ValueError):
    """A query or update is malformed or out of range: the *caller* must fix its request.

    The gRPC shell answers ``INVALID_ARGUMENT`` with ``str(exc)`` as the message, so messages
    name the offending field and never carry internals.
    """


class ConfigError(IndexServiceError, ValueError):
    """The index configuration is invalid: the *operator* must fix it before start."""
