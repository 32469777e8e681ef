"""The index's exceptions: one base, grouped by who has to react.

Malformed queries and updates raise the ledger library's :class:`InvalidArgument` (the
*caller* must fix its request); the gRPC shell answers ``INVALID_ARGUMENT``.
"""

from __future__ import annotations

from cortex.ledger.errors import InvalidArgument

__all__ = ["ConfigError", "IndexServiceError", "InvalidArgument"]


class IndexServiceError(Exception):
    """Base of every error the index raises on purpose besides :class:`InvalidArgument`."""


class ConfigError(IndexServiceError, ValueError):
    """The index configuration is invalid: the *operator* must fix it before start."""
