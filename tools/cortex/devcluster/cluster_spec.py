"""What ``cortex up`` starts (:class:`ClusterSpec`), what a started sim bound
(:class:`WorkerInfo`), and the launcher's one error. Pure; re-exported by
:mod:`cortex.devcluster.cluster`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from cortex.hashing import Engine
from cortex.registry import WorkerRole, WorkerSpec

__all__ = ["DEFAULT_GATEWAY_PORT", "LOOPBACK", "ClusterError", "ClusterSpec", "WorkerInfo"]

DEFAULT_GATEWAY_PORT = 8080
LOOPBACK = "127.0.0.1"


class ClusterError(RuntimeError):
    """The cluster could not start or a step failed; the message says what and how to fix it
    (with the log tail of the process at fault). The launcher prints it and exits 1."""


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    """What to start. Validated on creation (``ValueError`` naming the field).

    ``workers``: simulated workers (0 = the services alone, for workers registered by hand).
    ``pd``: the workers form a prefill/decode pool, ``ceil(workers/2)`` prefill and the rest
    decode (needs ``workers >= 2``). ``gateways``: replicas (0 = none). ``port``: the first
    gateway's port (0 = free ports). ``host``: the gateways' bind address.
    ``services``: start Redis, index and ingest and register the workers; ``False`` starts
    bare sims only (e.g. behind another router; then ``gateways`` must be 0).
    ``redis_url``: use this Redis instead of a private ``redis-server``.
    ``model``, ``block_size``: the served model name and tokens per KV block (one domain).
    ``kv_capacity_blocks``, ``max_running``, ``zero_cost``: the sims' KV pool (blocks),
    concurrency and timing (``zero_cost``: no simulated time); ``sim_args``: more
    ``cortex sim`` flags for every worker (``--prefill-ms-per-token 0.05``, ...).
    ``lease_ttl_s``: registry lease (s); gateways probe and the services poll the registry
    every ``min(1, ttl/4)`` s so renewals stay well inside it. With no gateway nobody renews
    leases, so workers are registered without expiry.
    ``external``: workers that already run elsewhere (``cortex serve``): registered and
    waited for like the sims, never started or stopped.
    ``gateway_config``: sections merged into every gateway's generated config
    (``{"routing": {"weights": {"beta": 32}}}``); ``index_args`` / ``ingest_args`` /
    ``gateway_args``: extra flags. ``ready_timeout_s``: the whole start-up's deadline.
    ``ledger_grace_s``: how long start-up waits for the ledgers of ``external`` workers once
    the gateways route them (``None``: until the deadline); a worker whose ledger is not READY
    by then is routed by load and named in :attr:`LocalCluster.ledger_pending`.
    ``eagle_lookahead``: the sims run speculative decoding with prefix caching (``cortex sim
    --eagle-lookahead``) and are registered with that ``kv_lookahead``; ``eagle_drop``: vLLM
    EAGLE on legacy hashes (``--eagle-drop``, registered with ``kv_eagle_drop``).
    """

    workers: int = 2
    engine: Engine = Engine.SGLANG
    pd: bool = False
    gateways: int = 1
    port: int = DEFAULT_GATEWAY_PORT
    host: str = LOOPBACK
    services: bool = True
    redis_url: str | None = None
    model: str = "cortex-sim"
    block_size: int = 16
    kv_capacity_blocks: int = 8192
    max_running: int = 64
    zero_cost: bool = False
    sim_args: tuple[str, ...] = ()
    lease_ttl_s: float = 10.0
    gateway_config: Mapping[str, Any] = field(default_factory=dict)
    external: tuple[WorkerSpec, ...] = ()
    index_args: tuple[str, ...] = ()
    ingest_args: tuple[str, ...] = ()
    gateway_args: tuple[str, ...] = ()
    ready_timeout_s: float = 90.0
    ledger_grace_s: float | None = None
    eagle_lookahead: int = 0
    eagle_drop: bool = False

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "engine", Engine(self.engine))
        except ValueError:
            raise ValueError(f"engine: {self.engine!r} is not one of sglang, vllm") from None
        for name in ("workers", "gateways"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        if self.pd and self.workers < 2:
            raise ValueError("pd: a prefill/decode pool needs workers >= 2")
        if not 0 <= self.port <= 65535 or self.port + max(self.gateways - 1, 0) > 65535:
            raise ValueError(f"port: {self.port} (+{self.gateways} gateways) is out of range")
        if not self.services and self.gateways:
            raise ValueError("gateways: gateways need the services (services=False: gateways=0)")
        for name in ("block_size", "kv_capacity_blocks", "max_running"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        for name in ("lease_ttl_s", "ready_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        if self.ledger_grace_s is not None and not self.ledger_grace_s >= 0:
            raise ValueError(f"ledger_grace_s: must be >= 0, got {self.ledger_grace_s}")
        if not self.model.strip():
            raise ValueError("model: must be a non-empty name")
        object.__setattr__(self, "sim_args", tuple(self.sim_args))
        object.__setattr__(self, "index_args", tuple(self.index_args))
        object.__setattr__(self, "ingest_args", tuple(self.ingest_args))
        object.__setattr__(self, "gateway_args", tuple(self.gateway_args))
        object.__setattr__(self, "gateway_config", MappingProxyType(dict(self.gateway_config)))
        object.__setattr__(self, "external", tuple(self.external))
        ids = [wid for wid, _ in self.worker_roles()] + [w.id for w in self.external]
        if len(set(ids)) != len(ids):
            raise ValueError(f"external: worker ids must be unique, got {ids}")
        if self.external and not self.services:
            raise ValueError("external: registering workers needs the services")

    @property
    def poll_interval_s(self) -> float:
        """Registry polling and gateway health-probe interval (s)."""
        return min(1.0, self.lease_ttl_s / 4)

    def worker_roles(self) -> list[tuple[str, WorkerRole]]:
        """Worker ids and roles, in start order."""
        if not self.pd:
            return [(f"worker-{i}", WorkerRole.REGULAR) for i in range(self.workers)]
        prefill = (self.workers + 1) // 2
        return ([(f"prefill-{i}", WorkerRole.PREFILL) for i in range(prefill)]
                + [(f"decode-{i}", WorkerRole.DECODE) for i in range(self.workers - prefill)])


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """A started sim: its registry identity and the addresses it bound."""

    id: str
    role: WorkerRole
    engine: Engine
    url: str
    kv_events: str
    replay: str
    bootstrap_port: int | None

    def spec(self, model: str, block_size: int, kv_lookahead: int | None = None,
             kv_eagle_drop: bool = False) -> WorkerSpec:
        """The registry entry of this worker."""
        return WorkerSpec(id=self.id, url=self.url, engine=self.engine, model=model,
                          role=self.role, kv_events=self.kv_events, replay=self.replay,
                          bootstrap_port=self.bootstrap_port, block_size=block_size,
                          kv_lookahead=kv_lookahead, kv_eagle_drop=kv_eagle_drop)
