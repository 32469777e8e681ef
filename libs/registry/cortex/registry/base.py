"""The ``Registry`` interface every service uses, and what ``list()`` returns.

A registry holds one lease per worker: the worker's spec, valid for ``ttl_s`` seconds
unless renewed, and one tombstone per worker an operator removed: a tombstone keeps the
worker out (no gateway may re-assert its lease) until it expires or the worker is
registered again. Implementations: :class:`~cortex.registry.redis_registry.RedisRegistry`
(production) and :class:`~cortex.registry.memory.MemoryRegistry` (tests, single process).
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import TracebackType
from typing import Self

from cortex.registry.spec import WorkerSpec

__all__ = ["DEFAULT_TTL_S", "Assertion", "Listing", "Registry", "Tombstone"]

DEFAULT_TTL_S = 10.0
"""Default lease length (seconds): a worker no gateway can reach disappears after this."""


class Assertion(StrEnum):
    """What :meth:`Registry.reassert` did."""

    RENEWED = "renewed"  # the entry was there: its lease was extended, its spec kept
    CREATED = "created"  # the entry was gone (lapsed, Redis restarted empty): written again
    REPLACED = "replaced"  # ``replace=True``: written over the entry that was there
    TOMBSTONED = "tombstoned"  # an operator removed the worker: nothing was written


@dataclass(frozen=True, slots=True)
class Tombstone:
    """An operator's removal of a worker. ``at``: wall-clock seconds (Unix) of the removal;
    ``ttl_s``: remaining seconds (``None``: until the worker is registered again)."""

    worker_id: str
    reason: str = ""
    at: float = 0.0
    ttl_s: float | None = None

    def to_dict(self) -> dict[str, object]:
        return {"id": self.worker_id, "reason": self.reason, "at": self.at,
                "ttl_s": self.ttl_s}


@dataclass(frozen=True, slots=True)
class Listing:
    """One consistent-enough read of the whole registry.

    ``ttl_s[id]`` is the remaining lease in seconds (``None``: a static entry without
    expiry). ``invalid`` maps the ids of unreadable entries to the reason; they are
    skipped, never guessed. ``tombstones``: workers an operator removed (they hold no lease).
    ``stamp``: the registry's own note of what it read, for :meth:`Registry.changed_since`.
    """

    workers: Mapping[str, WorkerSpec] = field(default_factory=dict)
    ttl_s: Mapping[str, float | None] = field(default_factory=dict)
    invalid: Mapping[str, str] = field(default_factory=dict)
    tombstones: Mapping[str, Tombstone] = field(default_factory=dict)
    stamp: object = None


class Registry(abc.ABC):
    """Worker leases. Every method may raise
    :class:`~cortex.registry.errors.RegistryUnavailable`; ``register`` raises
    :class:`~cortex.registry.errors.SpecError` only for specs built around validation.
    """

    def __init__(self, default_ttl_s: float = DEFAULT_TTL_S) -> None:
        if default_ttl_s <= 0:
            raise ValueError(f"default_ttl_s must be > 0, got {default_ttl_s}")
        self.default_ttl_s = default_ttl_s

    @staticmethod
    def _tombstone_ttl(ttl_s: float | None) -> float | None:
        if ttl_s is not None and not ttl_s > 0:
            raise ValueError(f"tombstone_ttl_s must be > 0 (or None), got {ttl_s}")
        return ttl_s

    def _ttl(self, ttl_s: float | None) -> float:
        """``None`` → the default lease; ``0`` → no expiry (a static entry)."""
        ttl = self.default_ttl_s if ttl_s is None else ttl_s
        if ttl < 0:
            raise ValueError(f"ttl_s must be >= 0, got {ttl}")
        return ttl

    @abc.abstractmethod
    async def register(self, spec: WorkerSpec, ttl_s: float | None = None) -> None:
        """An operator adds the worker: create or replace its entry with a fresh lease
        (``ttl_s`` seconds, ``None`` = default, ``0`` = no expiry), clear its tombstone if
        it had one, and notify watchers."""

    @abc.abstractmethod
    async def reassert(self, spec: WorkerSpec, ttl_s: float | None = None, *,
                       replace: bool = False) -> Assertion:
        """A gateway vouches for the worker (its probe passed): atomically, unless it is
        tombstoned, extend its lease or — when the entry is gone — write ``spec`` with a
        fresh lease (and notify). ``replace``: write ``spec`` over an existing entry too
        (static seeds). Never clears a tombstone."""

    @abc.abstractmethod
    async def renew(self, worker_id: str, ttl_s: float | None = None) -> bool:
        """Extend the lease; ``False`` when the entry is gone (expired or removed)."""

    @abc.abstractmethod
    async def deregister(self, worker_id: str) -> bool:
        """Drop the entry now, as a lapsed lease would (a gateway that still reaches the
        worker brings it back); ``False`` when there was none."""

    @abc.abstractmethod
    async def remove(self, worker_id: str, *, tombstone_ttl_s: float | None = None,
                     reason: str = "") -> bool:
        """An operator removes the worker for good: drop its entry and write a tombstone
        (expiring after ``tombstone_ttl_s`` seconds; ``None`` = until registered again),
        atomically, and notify. ``True`` when a lease was dropped; the tombstone is written
        either way (a lapsed worker must not come back either)."""

    @abc.abstractmethod
    async def get(self, worker_id: str) -> WorkerSpec | None:
        """The worker's spec, or ``None`` (absent, expired or unreadable)."""

    @abc.abstractmethod
    async def list(self) -> Listing:
        """Every live entry."""

    async def changed_since(self, listing: Listing) -> bool:
        """Whether :meth:`list` could now return something else than ``listing`` (one of
        this registry's), remaining lease times aside. ``True`` when it cannot tell cheaply:
        then a watcher lists again."""
        return True

    @abc.abstractmethod
    def changes(self) -> AsyncIterator[str]:
        """Ids of workers registered or removed, as they happen (a hint for watchers, not a
        source of truth: lease expiry is only seen by polling). Runs until cancelled; raises
        ``RegistryUnavailable`` when the channel breaks."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Release connections; idempotent."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()
