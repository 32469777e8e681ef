"""The registry's exceptions: one small hierarchy, grouped by who should react."""

from __future__ import annotations

__all__ = ["RegistryError", "RegistryUnavailable", "SpecError"]


class RegistryError(Exception):
    """Base of every error the registry library raises."""


class SpecError(RegistryError, ValueError):
    """A worker spec is invalid. The caller (operator, admin API) fixes its input; nothing
    was written."""


class RegistryUnavailable(RegistryError):
    """The backing store (Redis) cannot be reached or answered with an error. Services keep
    their last known registry and report ``degraded``; the operation may be retried."""
