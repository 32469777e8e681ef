"""The registry's exceptions: one small hierarchy, grouped by who should react."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["DiscoveryError", "RegistryError", "RegistryUnavailable", "SpecError"]


class RegistryError(Exception):
    """Base of every error the registry library raises."""


class SpecError(RegistryError, ValueError):
    """A worker spec is invalid. The caller (operator, admin API) fixes its input; nothing
    was written."""


class DiscoveryError(SpecError):
    """A worker did not say enough about itself for a spec: ``missing`` names the fields
    neither its endpoints nor the caller supplied, ``problems`` what could not be read. The
    operator passes those fields explicitly (or fixes the worker); nothing was written."""

    def __init__(self, url: str, missing: Sequence[str], problems: Sequence[str] = ()) -> None:
        self.url = url
        self.missing = tuple(missing)
        self.problems = tuple(problems)
        why = f" ({'; '.join(self.problems)})" if self.problems else ""
        super().__init__(
            f"could not learn {', '.join(self.missing)} from {url}{why}; "
            f"supply {'it' if len(self.missing) == 1 else 'them'} explicitly")


class RegistryUnavailable(RegistryError):
    """The backing store (Redis) cannot be reached or answered with an error. Services keep
    their last known registry and report ``degraded``; the operation may be retried."""
