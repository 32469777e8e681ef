"""The ``Registry`` interface every service uses, and what ``list()`` returns.

A registry holds one lease per worker: the worker's spec, valid for ``ttl_s`` seconds
unless renewed. Implementations: :class:`~cortex.registry.redis_registry.RedisRegistry`
(production) and :class:`~cortex.registry.memory.MemoryRegistry` (tests, single process).
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Self

from cortex.registry.spec import WorkerSpec

__all__ = ["DEFAULT_TTL_S", "Listing", "Registry"]

DEFAULT_TTL_S = 10.0
"""Default lease length (seconds): a worker no gateway can reach disappears after this."""


@dataclass(frozen=True, slots=True)
class Listing:
    """One consistent-enough read of the whole registry.

    ``ttl_s[id]`` is the remaining lease in seconds (``None``: a static entry without
    expiry). ``invalid`` maps the ids of unreadable entries to the reason; they are
    skipped, never guessed.
    """

    workers: Mapping[str, WorkerSpec] = field(default_factory=dict)
    ttl_s: Mapping[str, float | None] = field(default_factory=dict)
    invalid: Mapping[str, str] = field(default_factory=dict)


class Registry(abc.ABC):
    """Worker leases. Every method may raise
    :class:`~cortex.registry.errors.RegistryUnavailable`; ``register`` raises
    :class:`~cortex.registry.errors.SpecError` only for specs built around validation.
    """

    def __init__(self, default_ttl_s: float = DEFAULT_TTL_S) -> None:
        if default_ttl_s <= 0:
            raise ValueError(f"default_ttl_s must be > 0, got {default_ttl_s}")
        self.default_ttl_s = default_ttl_s

    def _ttl(self, ttl_s: float | None) -> float:
        """``None`` → the default lease; ``0`` → no expiry (a static entry)."""
        ttl = self.default_ttl_s if ttl_s is None else ttl_s
        if ttl < 0:
            raise ValueError(f"ttl_s must be >= 0, got {ttl}")
        return ttl

    @abc.abstractmethod
    async def register(self, spec: WorkerSpec, ttl_s: float | None = None) -> None:
        """Create or replace the worker's entry with a fresh lease (``ttl_s`` seconds,
        ``None`` = default, ``0`` = no expiry) and notify watchers."""

    @abc.abstractmethod
    async def renew(self, worker_id: str, ttl_s: float | None = None) -> bool:
        """Extend the lease; ``False`` when the entry is gone (expired or removed): the
        caller re-registers if it still wants the worker."""

    @abc.abstractmethod
    async def deregister(self, worker_id: str) -> bool:
        """Remove the entry now; ``False`` when there was none."""

    @abc.abstractmethod
    async def get(self, worker_id: str) -> WorkerSpec | None:
        """The worker's spec, or ``None`` (absent, expired or unreadable)."""

    @abc.abstractmethod
    async def list(self) -> Listing:
        """Every live entry."""

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
