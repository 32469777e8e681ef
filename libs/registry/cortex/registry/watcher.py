"""``RegistryWatcher``: the last known registry, kept fresh by polling plus the channel.

Polling (every ``interval_s``, default 1 s) is the source of truth: it is the only way to
see a lease expire. The pub/sub channel only wakes the poller early. When the registry is
unreachable the watcher keeps the last known workers, reports ``degraded`` and reconciles
(emits the accumulated diff) on the first successful poll.

A poll first asks the registry whether anything changed since the last listing
(:meth:`Registry.changed_since`: for Redis one small script, not a scan and every entry's
JSON) and lists again only when it did. A wake-up by the channel, a poll after a failed one
and every ``full_every``-th poll list whatever the answer, so a writer that does not keep
the registry's change count (an older release during an upgrade) is seen within
``full_every`` polls.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType, TracebackType

from cortex.edge.tasks import stop_tasks
from cortex.registry.base import Listing, Registry, Tombstone
from cortex.registry.errors import RegistryUnavailable
from cortex.registry.spec import WorkerSpec

__all__ = ["RegistryDiff", "RegistryHealth", "RegistryWatcher", "diff_specs"]

log = logging.getLogger(__name__)


class RegistryHealth(StrEnum):
    STARTING = "starting"  # no poll finished yet
    OK = "ok"
    DEGRADED = "degraded"  # the last poll failed: serving the last known registry


@dataclass(frozen=True, slots=True)
class RegistryDiff:
    """What changed between two views: ``changed`` maps an id to ``(old, new)``."""

    added: Mapping[str, WorkerSpec] = field(default_factory=dict)
    removed: Mapping[str, WorkerSpec] = field(default_factory=dict)
    changed: Mapping[str, tuple[WorkerSpec, WorkerSpec]] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.added or self.removed or self.changed)

    def __repr__(self) -> str:
        return (
            f"RegistryDiff(added={sorted(self.added)}, removed={sorted(self.removed)}, "
            f"changed={sorted(self.changed)})"
        )


def diff_specs(old: Mapping[str, WorkerSpec], new: Mapping[str, WorkerSpec]) -> RegistryDiff:
    """Pure diff of two id → spec views."""
    return RegistryDiff(
        added={wid: spec for wid, spec in new.items() if wid not in old},
        removed={wid: spec for wid, spec in old.items() if wid not in new},
        changed={
            wid: (old[wid], spec) for wid, spec in new.items() if wid in old and old[wid] != spec
        },
    )


class RegistryWatcher:
    """Use as ``async with RegistryWatcher(registry) as watcher:``.

    ``__aenter__`` performs the first poll (a failure leaves the view empty and the watcher
    degraded, never raises). Consumers read :attr:`workers` and wait with
    :meth:`wait_changed`, or iterate :meth:`diffs`.
    """

    def __init__(
        self,
        registry: Registry,
        *,
        interval_s: float = 1.0,
        use_channel: bool = True,
        channel_backoff_max_s: float = 5.0,
        full_every: int = 10,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        if full_every < 1:
            raise ValueError(f"full_every must be >= 1, got {full_every}")
        self.registry = registry
        self.interval_s = interval_s
        self.full_every = full_every
        self.use_channel = use_channel
        self.channel_backoff_max_s = channel_backoff_max_s
        self.health = RegistryHealth.STARTING
        self.version = 0  # bumped whenever the view changes
        self.polls = 0
        self.listings = 0  # polls that read the whole registry
        self.poll_errors = 0
        self.last_error: str | None = None
        self.last_ok_monotonic: float | None = None
        self.view_taken_at: float | None = None  # monotonic s the current view was requested
        self._listing = Listing()
        self._invalid_logged: dict[str, str] = {}
        self._wake = asyncio.Event()
        self._changed = asyncio.Condition()
        self._tasks: list[asyncio.Task[None]] = []

    def __repr__(self) -> str:
        return (
            f"RegistryWatcher(health={self.health.value}, workers={len(self._listing.workers)}, "
            f"version={self.version}, polls={self.polls}, errors={self.poll_errors})"
        )

    # ---- the view ----

    @property
    def workers(self) -> Mapping[str, WorkerSpec]:
        """Last known workers (read-only)."""
        return MappingProxyType(dict(self._listing.workers))

    @property
    def tombstones(self) -> Mapping[str, Tombstone]:
        """Workers an operator removed, as last seen (read-only)."""
        return MappingProxyType(dict(self._listing.tombstones))

    @property
    def listing(self) -> Listing:
        """The last successful listing (with invalid entries, and lease TTLs as of when it
        was read)."""
        return self._listing

    @property
    def degraded(self) -> bool:
        return self.health is RegistryHealth.DEGRADED

    # ---- lifecycle ----

    async def __aenter__(self) -> RegistryWatcher:
        await self.refresh()
        self._tasks.append(asyncio.create_task(self._poll_loop(), name="registry-poll"))
        if self.use_channel:
            self._tasks.append(asyncio.create_task(self._channel_loop(), name="registry-channel"))
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        tasks, self._tasks = self._tasks, []
        await stop_tasks(tasks)  # also when cancelled: no poll or channel read outlives us

    def poke(self) -> None:
        """Poll now instead of at the next interval."""
        self._wake.set()

    async def refresh(self, full: bool = True) -> bool:
        """Poll once; ``True`` on success. Updates health and, on change, the view.
        ``full=False``: list only if the registry says something changed since the last
        listing (a poll after a failed one lists anyway)."""
        self.polls += 1
        requested = time.monotonic()
        try:
            if (not full and self.health is RegistryHealth.OK
                    and not await self.registry.changed_since(self._listing)):
                self.last_ok_monotonic = time.monotonic()
                self.view_taken_at = requested
                return True
            self.listings += 1
            listing = await self.registry.list()
        except RegistryUnavailable as exc:
            self.poll_errors += 1
            self.last_error = str(exc)
            if self.health is not RegistryHealth.DEGRADED:
                log.warning(
                    "registry unreachable, keeping the last known %d workers: %s",
                    len(self._listing.workers), exc,
                )
                self.health = RegistryHealth.DEGRADED
                await self._bump()
            return False
        was = self.health
        self.health = RegistryHealth.OK
        self.last_error = None
        self.last_ok_monotonic = time.monotonic()
        self.view_taken_at = requested
        self._log_invalid(listing.invalid)
        diff = diff_specs(self._listing.workers, listing.workers)
        stones_changed = listing.tombstones.keys() != self._listing.tombstones.keys()
        self._listing = listing
        if was is RegistryHealth.DEGRADED:
            log.info("registry reachable again; reconciled %r", diff)
        if diff or stones_changed or was is not RegistryHealth.OK:
            await self._bump()
        return True

    def _log_invalid(self, invalid: Mapping[str, str]) -> None:
        for worker_id, reason in invalid.items():
            if self._invalid_logged.get(worker_id) != reason:
                log.warning("skipping unreadable registry entry worker=%s: %s", worker_id, reason,
                            extra={"worker": worker_id})
        self._invalid_logged = dict(invalid)

    async def _bump(self) -> None:
        async with self._changed:
            self.version += 1
            self._changed.notify_all()

    async def wait_changed(self, version: int, timeout_s: float | None = None) -> int:
        """Wait until :attr:`version` exceeds ``version`` (or ``timeout_s``); return it."""
        async with self._changed:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout_s):
                    await self._changed.wait_for(lambda: self.version > version)
            return self.version

    async def diffs(self) -> AsyncIterator[RegistryDiff]:
        """Coalesced diffs for one consumer; the first holds every known worker as added."""
        seen: Mapping[str, WorkerSpec] = {}
        version = -1
        while True:
            version = await self.wait_changed(version)
            current = dict(self._listing.workers)
            diff = diff_specs(seen, current)
            seen = current
            if diff:
                yield diff

    # ---- background loops ----

    async def _poll_loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.interval_s):
                    await self._wake.wait()
            woken = self._wake.is_set()
            self._wake.clear()
            await self.refresh(full=woken or self.polls % self.full_every == 0)

    async def _channel_loop(self) -> None:
        backoff = 0.1
        while True:
            try:
                async for _worker_id in self.registry.changes():
                    backoff = 0.1
                    self._wake.set()
            except RegistryUnavailable as exc:
                log.debug("registry channel lost (%s); polling continues", exc)
            # reconnect with capped exponential backoff; polling covers the gap meanwhile
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.channel_backoff_max_s)
