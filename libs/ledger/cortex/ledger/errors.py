"""The ledger library's one exception."""

from __future__ import annotations

__all__ = ["InvalidArgument"]


class InvalidArgument(ValueError):
    """A query, update or replica message is malformed or out of range: the *sender* must fix
    it. Servers answer ``INVALID_ARGUMENT`` with ``str(exc)``, so messages name the offending
    field and never carry internals."""
