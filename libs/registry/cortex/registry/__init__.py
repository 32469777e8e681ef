"""The worker registry: Redis leases of worker specs, shared by every Cortex service.

- :class:`WorkerSpec` — a validated worker description (JSON at ``cortex:v1:worker:<id>``);
- :class:`Registry` — register / reassert / renew / deregister / remove (a tombstone) /
  get / list / changes, implemented by :class:`RedisRegistry` and :class:`MemoryRegistry`;
- :class:`RegistryWatcher` — the last known registry, polled (≤ 1 s) and woken by the
  channel, ``degraded`` while the store is unreachable;
- :class:`LeaseKeeper` — hold a lease while a context is open;
- :func:`discover` — what a worker's engine says about itself (:class:`Discovery`: engine,
  model, block size, KV-event / replay endpoints, DP size, context length), turned into a
  spec with :meth:`Discovery.spec` (:class:`DiscoveryError` names what it could not learn).
"""

from cortex.registry.base import DEFAULT_TTL_S, Assertion, Listing, Registry, Tombstone
from cortex.registry.endpoint import Endpoint, parse_endpoint
from cortex.registry.engine_probe import discover
from cortex.registry.engine_spec import Discovery, default_worker_id
from cortex.registry.errors import DiscoveryError, RegistryError, RegistryUnavailable, SpecError
from cortex.registry.lease import LeaseKeeper
from cortex.registry.memory import MemoryRegistry
from cortex.registry.redis_registry import DEFAULT_NAMESPACE, RedisRegistry
from cortex.registry.spec import SPEC_VERSION, WorkerRole, WorkerSpec
from cortex.registry.watcher import RegistryDiff, RegistryHealth, RegistryWatcher, diff_specs

__all__ = [
    "DEFAULT_NAMESPACE",
    "DEFAULT_TTL_S",
    "SPEC_VERSION",
    "Assertion",
    "Discovery",
    "DiscoveryError",
    "Endpoint",
    "LeaseKeeper",
    "Listing",
    "MemoryRegistry",
    "RedisRegistry",
    "Registry",
    "RegistryDiff",
    "RegistryError",
    "RegistryHealth",
    "RegistryUnavailable",
    "RegistryWatcher",
    "SpecError",
    "Tombstone",
    "WorkerRole",
    "WorkerSpec",
    "default_worker_id",
    "diff_specs",
    "discover",
    "parse_endpoint",
]
