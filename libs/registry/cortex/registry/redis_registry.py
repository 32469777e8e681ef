"""``RedisRegistry``: worker leases as Redis keys with a TTL.

Layout (``namespace`` defaults to ``cortex:v1:``):

- ``<ns>worker:<id>`` → the spec's JSON, expiring with the lease (``PX``);
- ``<ns>tombstone:<id>`` → ``{"id", "reason", "at"}`` of an operator's removal, expiring
  with its own TTL or never (until the worker is registered again);
- ``<ns>workers`` → a pub/sub channel carrying ``put <id>`` / ``del <id>`` on register and
  deregister, so watchers react faster than their polling interval;
- ``<ns>generation`` → a counter every write that adds, replaces or drops an entry or a
  tombstone increments in the same transaction. With the keys a listing found, it tells a
  watcher's poll in one small round trip whether anything but a lease's remaining time
  changed since (:meth:`RedisRegistry.changed_since`); only then does it list again.

Re-asserting a lease is one Lua script (atomic with a concurrent removal: a tombstone
written between a gateway's probe and its write always wins).

Every redis error is translated into :class:`RegistryUnavailable` at this boundary.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from cortex.registry.base import DEFAULT_TTL_S, Assertion, Listing, Registry, Tombstone
from cortex.registry.errors import RegistryUnavailable, SpecError
from cortex.registry.spec import WorkerSpec

__all__ = ["DEFAULT_NAMESPACE", "RedisRegistry"]

log = logging.getLogger(__name__)

DEFAULT_NAMESPACE = "cortex:v1:"
_SCAN_COUNT = 500
_T = TypeVar("_T")

# KEYS: worker key, tombstone key, generation key. ARGV: spec JSON, lease ms (0 = none),
# replace (0|1), channel, worker id. Returns the Assertion's value.
_REASSERT = """
if redis.call('EXISTS', KEYS[2]) == 1 then return 'tombstoned' end
local ttl = tonumber(ARGV[2])
local existed = redis.call('EXISTS', KEYS[1]) == 1
if existed and ARGV[3] == '0' then
  if ttl > 0 then redis.call('PEXPIRE', KEYS[1], ttl) else redis.call('PERSIST', KEYS[1]) end
  return 'renewed'
end
if ttl > 0 then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ttl)
else
  redis.call('SET', KEYS[1], ARGV[1])
end
redis.call('INCR', KEYS[3])
redis.call('PUBLISH', ARGV[4], 'put ' .. ARGV[5])
if existed then return 'replaced' end
return 'created'
"""

# KEYS: generation key, then every key a listing found. ARGV: that listing's generation.
# 1 when the generation moved or one of those keys is gone (a lease or tombstone lapsed).
_CHANGED = """
if (redis.call('GET', KEYS[1]) or '0') ~= ARGV[1] then return 1 end
for i = 2, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 0 then return 1 end
end
return 0
"""


@dataclass(frozen=True, slots=True)
class _Stamp:
    """What :meth:`RedisRegistry.changed_since` compares: the generation a listing began
    at and the keys it found."""

    generation: bytes
    keys: tuple[bytes, ...]


class RedisRegistry(Registry):
    """Leases in Redis. ``op_timeout_s`` bounds every command (connect included); there are
    no hidden retries: callers decide (watchers poll again, CLIs report the error)."""

    def __init__(
        self,
        url: str,
        *,
        default_ttl_s: float = DEFAULT_TTL_S,
        namespace: str = DEFAULT_NAMESPACE,
        op_timeout_s: float = 2.0,
    ) -> None:
        super().__init__(default_ttl_s)
        if op_timeout_s <= 0:
            raise ValueError(f"op_timeout_s must be > 0, got {op_timeout_s}")
        self.url = url
        self.namespace = namespace
        self.channel = f"{namespace}workers"
        self._prefix = f"{namespace}worker:"
        self._tomb_prefix = f"{namespace}tombstone:"
        self._generation = f"{namespace}generation"
        try:
            self._client: aioredis.Redis = aioredis.Redis.from_url(
                url,
                socket_timeout=op_timeout_s,
                socket_connect_timeout=op_timeout_s,
                retry=Retry(NoBackoff(), 0),
                decode_responses=False,
            )
        except ValueError as exc:
            raise RegistryUnavailable(f"bad redis URL {url!r}: {exc}") from None
        self._reassert = self._client.register_script(_REASSERT)
        self._changed = self._client.register_script(_CHANGED)
        self._specs: dict[bytes, WorkerSpec] = {}  # the last listing's entries, parsed
        self._closed = False

    def __repr__(self) -> str:
        return f"RedisRegistry(url={self._safe_url()!r}, namespace={self.namespace!r})"

    def _safe_url(self) -> str:
        # never print a password
        _, sep, tail = self.url.rpartition("@")
        return f"{self.url.split('://', 1)[0]}://***@{tail}" if sep else self.url

    def key(self, worker_id: str) -> str:
        return f"{self._prefix}{worker_id}"

    def tombstone_key(self, worker_id: str) -> str:
        return f"{self._tomb_prefix}{worker_id}"

    async def _run(self, what: str, call: Awaitable[_T]) -> _T:
        task = asyncio.current_task()
        requested = task.cancelling() if task is not None else 0
        try:
            result = await call
        except (RedisError, OSError) as exc:
            _raise_lost_cancel(task, requested)
            raise RegistryUnavailable(f"redis {self._safe_url()}: {what} failed: {exc}") from exc
        _raise_lost_cancel(task, requested)
        return result

    async def register(self, spec: WorkerSpec, ttl_s: float | None = None) -> None:
        ttl = self._ttl(ttl_s)
        payload = spec.to_json()

        async def call() -> None:
            async with self._client.pipeline(transaction=True) as pipe:
                pipe.delete(self.tombstone_key(spec.id))
                if ttl:
                    pipe.set(self.key(spec.id), payload, px=_ms(ttl))
                else:
                    pipe.set(self.key(spec.id), payload)
                pipe.incr(self._generation)
                pipe.publish(self.channel, f"put {spec.id}")
                await pipe.execute()

        await self._run(f"register {spec.id}", call())

    async def reassert(self, spec: WorkerSpec, ttl_s: float | None = None, *,
                       replace: bool = False) -> Assertion:
        ttl = self._ttl(ttl_s)
        reply = await self._run(f"reassert {spec.id}", self._reassert(
            keys=[self.key(spec.id), self.tombstone_key(spec.id), self._generation],
            args=[spec.to_json(), _ms(ttl) if ttl else 0, int(replace), self.channel,
                  spec.id]))
        text = reply.decode() if isinstance(reply, bytes) else str(reply)
        try:
            return Assertion(text)
        except ValueError:
            raise RegistryUnavailable(f"redis: reassert {spec.id}: unexpected reply "
                                      f"{text[:40]!r}") from None

    async def renew(self, worker_id: str, ttl_s: float | None = None) -> bool:
        ttl = self._ttl(ttl_s)
        if ttl:
            done = await self._run(
                f"renew {worker_id}", self._client.pexpire(self.key(worker_id), _ms(ttl)))
            return bool(done)

        async def persist() -> bool:
            async with self._client.pipeline(transaction=True) as pipe:
                pipe.persist(self.key(worker_id))
                pipe.exists(self.key(worker_id))
                _, exists = await pipe.execute()
            return bool(exists)

        return await self._run(f"renew {worker_id}", persist())

    async def deregister(self, worker_id: str) -> bool:
        async def call() -> bool:
            async with self._client.pipeline(transaction=True) as pipe:
                pipe.delete(self.key(worker_id))
                pipe.incr(self._generation)
                pipe.publish(self.channel, f"del {worker_id}")
                deleted, _, _ = await pipe.execute()
            return bool(deleted)

        return await self._run(f"deregister {worker_id}", call())

    async def remove(self, worker_id: str, *, tombstone_ttl_s: float | None = None,
                     reason: str = "") -> bool:
        ttl = self._tombstone_ttl(tombstone_ttl_s)
        stone = json.dumps({"id": worker_id, "reason": reason, "at": round(time.time(), 3)})

        async def call() -> bool:
            async with self._client.pipeline(transaction=True) as pipe:
                pipe.delete(self.key(worker_id))
                if ttl is None:
                    pipe.set(self.tombstone_key(worker_id), stone)
                else:
                    pipe.set(self.tombstone_key(worker_id), stone, px=_ms(ttl))
                pipe.incr(self._generation)
                pipe.publish(self.channel, f"del {worker_id}")
                deleted, _, _, _ = await pipe.execute()
            return bool(deleted)

        return await self._run(f"remove {worker_id}", call())

    async def get(self, worker_id: str) -> WorkerSpec | None:
        raw = await self._run(f"get {worker_id}", self._client.get(self.key(worker_id)))
        if raw is None:
            return None
        try:
            return WorkerSpec.from_json(raw)
        except SpecError as exc:
            log.warning("unreadable registry entry worker=%s: %s", worker_id, exc,
                        extra={"worker": worker_id})
            return None

    async def list(self) -> Listing:
        return await self._run("list", self._list())

    async def _list(self) -> Listing:
        # the generation first: a write during the listing moves it past the one recorded
        generation = cast(bytes, await self._client.get(self._generation) or b"0")
        prefix, tomb_prefix = self._prefix.encode(), self._tomb_prefix.encode()
        keys: list[bytes] = []
        stones: list[bytes] = []
        async for key in self._client.scan_iter(match=f"{self.namespace}*", count=_SCAN_COUNT):
            if key.startswith(prefix):
                keys.append(key)
            elif key.startswith(tomb_prefix):
                stones.append(key)
        found: list[bytes] = []
        workers: dict[str, WorkerSpec] = {}
        ttls: dict[str, float | None] = {}
        invalid: dict[str, str] = {}
        specs: dict[bytes, WorkerSpec] = {}
        async for key, worker_id, raw, ttl in self._values(keys, len(prefix)):
            found.append(key)
            spec = self._specs.get(raw)
            if spec is None:
                try:
                    spec = WorkerSpec.from_json(raw)
                except SpecError as exc:
                    invalid[worker_id] = str(exc)
                    continue
            if spec.id != worker_id:
                invalid[worker_id] = f"entry holds a spec for {spec.id!r}"
                continue
            specs[raw] = workers[worker_id] = spec
            ttls[worker_id] = ttl
        self._specs = specs  # an unchanged entry is not parsed again
        tombstones: dict[str, Tombstone] = {}
        async for key, worker_id, raw, ttl in self._values(stones, len(tomb_prefix)):
            found.append(key)
            tombstones[worker_id] = _tombstone(worker_id, raw, ttl)
        return Listing(workers=workers, ttl_s=ttls, invalid=invalid, tombstones=tombstones,
                       stamp=_Stamp(generation, tuple(found)))

    async def changed_since(self, listing: Listing) -> bool:
        stamp = listing.stamp
        if not isinstance(stamp, _Stamp):
            return True
        moved = await self._run("changed", self._changed(
            keys=[self._generation, *stamp.keys], args=[stamp.generation]))
        return bool(moved)

    async def _values(self, keys: Sequence[bytes], skip: int
                      ) -> AsyncIterator[tuple[bytes, str, bytes, float | None]]:
        """``(key, id, value, remaining TTL in s or None)`` of each key still there
        (``skip``: the prefix length), one pipelined round trip per ``_SCAN_COUNT`` keys."""
        for start in range(0, len(keys), _SCAN_COUNT):
            chunk = keys[start : start + _SCAN_COUNT]
            async with self._client.pipeline(transaction=False) as pipe:
                for key in chunk:
                    pipe.get(key)
                    pipe.pttl(key)
                replies: list[Any] = await pipe.execute()
            for i, key in enumerate(chunk):
                raw, pttl = replies[2 * i], replies[2 * i + 1]
                if raw is not None:  # else: expired between SCAN and GET
                    yield key, key.decode(errors="replace")[skip:], raw, (
                        pttl / 1000 if pttl >= 0 else None)

    async def changes(self) -> AsyncIterator[str]:
        pubsub = self._client.pubsub(ignore_subscribe_messages=True)
        try:
            await self._run("subscribe", pubsub.subscribe(self.channel))
            while True:
                message = await self._run(
                    "channel read", pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                )
                if message is None or message.get("type") != "message":
                    continue
                data = message.get("data", b"")
                text = data.decode(errors="replace") if isinstance(data, bytes) else str(data)
                _, _, worker_id = text.partition(" ")
                if worker_id:
                    yield worker_id
        finally:
            try:
                await pubsub.aclose()
            except (RedisError, OSError):
                pass

    async def ping(self) -> None:
        """Raise ``RegistryUnavailable`` unless Redis answers."""
        await self._run("ping", self._client.ping())

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await self._client.aclose()
        except (RedisError, OSError):
            pass


def _tombstone(worker_id: str, raw: bytes, ttl_s: float | None) -> Tombstone:
    """A stored tombstone; an unreadable one still keeps its worker out."""
    try:
        data = json.loads(raw)
        return Tombstone(worker_id, str(data.get("reason", "")), float(data.get("at", 0.0)),
                         ttl_s)
    except (ValueError, TypeError, AttributeError):
        return Tombstone(worker_id, "unreadable tombstone", 0.0, ttl_s)


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


def _raise_lost_cancel(task: asyncio.Task[object] | None, requested: int) -> None:
    """Raise the cancellation a redis call swallowed, if it did.

    redis-py writes every command under ``asyncio.wait_for``, which on Python 3.11 returns
    the result and drops a cancellation that arrives as the write completes (fixed in 3.12).
    The task then carries on, still counted as cancelling: a watcher's channel loop went on
    reading forever and stopping it hung. ``asyncio.timeout`` takes back its own requests,
    so a count above the one before the call is a caller's request that was never honoured.
    """
    if task is not None and task.cancelling() > requested:
        raise asyncio.CancelledError
