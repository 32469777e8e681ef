"""A whole Cortex cluster on one machine, in child processes: the engine behind ``cortex up``.

``LocalCluster(spec, log_dir)`` starts a private ``redis-server`` (or uses ``spec.redis_url``),
the index, one ingest, ``spec.gateways`` gateway replicas and ``spec.workers`` simulated
workers (``cortex sim``), registers the workers in the registry, and returns once everything
is ready: the index serves, every worker's ledger is READY at the ingest, every gateway is
``ready`` and sees every worker routable with a READY ledger. Leaving the ``with`` block stops
everything (process groups, SIGTERM then SIGKILL); children also die with the launcher.

```python
from cortex.devcluster.cluster import ClusterSpec, LocalCluster

spec = ClusterSpec(workers=2, gateways=2, port=0, zero_cost=True, lease_ttl_s=3)
with LocalCluster(spec, tmp_path) as cluster:
    cluster.gateway_urls            # ["http://127.0.0.1:41235", ...]
    cluster.workers["worker-0"].url # the sim's HTTP URL (also kv_events, replay, role, ...)
    cluster.state()                 # the --state-file JSON
    cluster.flush_worker("worker-0"); cluster.kill_worker("worker-1"); cluster.restart_index()
    cluster.kill("ingest"); cluster.restart("ingest")  # kill -9, then the same command again
```

Every call blocks (start-up polls HTTP / gRPC health with deadlines, never fixed sleeps).
From async code call it through ``asyncio.to_thread`` *only* with a thread that outlives the
cluster: children are tied to the thread that started them (``PR_SET_PDEATHSIG``).

Ports: the first gateway listens on ``spec.port`` (default 8080), the next on ``port + 1``,
...; ``port=0`` picks free ports for all. Everything else binds 127.0.0.1 on free ports.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import secrets
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from cortex.devcluster.cluster_spec import (
    DEFAULT_GATEWAY_PORT,
    LOOPBACK,
    ClusterError,
    ClusterSpec,
    WorkerInfo,
)
from cortex.devcluster.supervisor import Child, ChildExited, Supervisor
from cortex.edge.probes import (
    bindable,
    http_call,
    probe_grpc_health,
    probe_http,
    redis_ping,
    run_async,
)
from cortex.hashing import Engine
from cortex.registry import WorkerRole, WorkerSpec
from cortex.sim.cli import READY_PREFIX
from cortex.testing import free_port

__all__ = [
    "DEFAULT_GATEWAY_PORT",
    "LOOPBACK",
    "ClusterError",
    "ClusterSpec",
    "LocalCluster",
    "WorkerInfo",
    "probe_grpc_health",
    "probe_http",
]

STATE_VERSION = 1
_POLL_S = 0.05



class LocalCluster:
    """Starts, watches and stops one local cluster (see the module docstring).

    Attributes once started: ``redis_url``, ``index_target`` (``host:port``), ``ingest_url``,
    ``gateway_urls``, ``workers`` (id → :class:`WorkerInfo`), ``admin_token`` (the gateways'
    admin API bearer token), ``log_dir`` (one ``<process>.log`` each, gateway configs).
    """

    def __init__(self, spec: ClusterSpec, log_dir: Path | str) -> None:
        self.spec = spec
        self.log_dir = Path(log_dir)
        self.admin_token = secrets.token_urlsafe(24)
        # the index's peer token: ingest and the gateways present it, nobody else gets in
        self.index_token_file = self.log_dir / "index-peer.token"
        # and its query token: Match, Workers, Stats and Changes are not open to anyone
        self.index_query_token_file = self.log_dir / "index-query.token"
        self.redis_url: str | None = spec.redis_url
        self.index_target: str | None = None
        self.ingest_url: str | None = None
        self.gateway_urls: list[str] = []
        self.workers: dict[str, WorkerInfo] = {}
        self._supervisor: Supervisor | None = None
        self._children: dict[str, Child] = {}
        self._index_metrics_port: int | None = None
        self._ingest_port: int | None = None
        self._gateway_configs: list[Path] = []
        self._waiting_for: list[str] = []  # what the last readiness check still waited for
        # external workers whose ledger was not READY within spec.ledger_grace_s: routed by
        # load meanwhile (worker id -> what the ingest said of it)
        self.ledger_pending: dict[str, str] = {}
        self._last_seen: dict[str, str] = {}  # worker id -> its last state at a gateway

    # ---- lifecycle ------------------------------------------------------------------------

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def start(self) -> None:
        """Start everything and wait until ready (:class:`ClusterError` otherwise, after
        stopping what was started)."""
        if self._supervisor is not None:
            raise RuntimeError("the cluster is already started")
        spec = self.spec
        gateway_ports = self._gateway_ports()
        redis_binary = self._redis_binary()
        self._supervisor = Supervisor(self.log_dir)
        deadline = time.monotonic() + spec.ready_timeout_s
        try:
            launched = [(wid, role, self._launch_sim(wid, role)) for wid, role in
                        spec.worker_roles()]
            if redis_binary is not None:
                self._start_redis(redis_binary)
            if spec.services:
                self._start_index()
                self._start_ingest()
            for wid, role, offset in launched:
                self._wait_sim(wid, role, offset, deadline)
            if spec.services:
                # the gateways seed the workers: they re-assert them if Redis forgets them
                for i, port in enumerate(gateway_ports):
                    self._start_gateway(i, port)
                self._wait_services(deadline, register=not spec.gateways)
        except BaseException:
            self.stop()
            raise

    def stop(self, grace_s: float = 10.0) -> None:
        """Stop every process (idempotent); deregisters workers from an external Redis."""
        supervisor, self._supervisor = self._supervisor, None
        if supervisor is None:
            return
        try:
            ids = [*self.workers, *(w.id for w in self.spec.external)]
            if self.spec.redis_url and ids and self.spec.services:
                # a gateway re-asserts every worker it still reaches: stop them first
                for name, child in self._children.items():
                    if name.startswith("gateway-"):
                        supervisor.stop(child, grace_s)
                with contextlib.suppress(Exception):
                    run_async(_deregister(self.spec.redis_url, ids))
        finally:
            supervisor.stop_all(grace_s)

    def wait_ready(self, timeout_s: float | None = None) -> None:
        """Wait until the services are ready again with every live worker (after a restart
        or a worker loss)."""
        self._wait_services(time.monotonic() + (timeout_s or self.spec.ready_timeout_s))

    def crashed(self) -> list[Child]:
        """Processes that exited without being stopped or killed through the cluster."""
        return self._sup.crashed()

    def check(self) -> None:
        """Raise :class:`ClusterError` (with the log tail) if some process crashed."""
        try:
            self._sup.check()
        except ChildExited as exc:
            raise ClusterError(str(exc)) from None

    # ---- operations (tests, demos, benchmarks) --------------------------------------------

    def process(self, name: str) -> Child:
        """The child called ``name``: ``redis``, ``index``, ``ingest``, ``gateway-<i>`` or a
        worker id."""
        return self._children[name]

    def kill_worker(self, worker_id: str) -> None:
        """SIGKILL a worker (a crash); its lease then expires unless it comes back."""
        self._sup.kill(self._children[worker_id])

    def flush_worker(self, worker_id: str) -> None:
        """Empty a worker's prefix cache the engine's way (SGLang ``/flush_cache``, vLLM
        ``/reset_prefix_cache``); it publishes ``AllBlocksCleared``."""
        info = self.workers[worker_id]
        path = "/flush_cache" if info.engine is Engine.SGLANG else "/reset_prefix_cache"
        status, body = http_call(info.url + path, method="POST", timeout=10.0)
        if status != 200:
            raise ClusterError(f"flushing {worker_id} failed: HTTP {status} {body!r}")

    def restart_index(self, wait: bool = True) -> None:
        """Restart the index on the same ports (empty ledger); with ``wait``, return once
        ingest and gateways have re-converged (every ledger READY again)."""
        self._children["index"] = self._sup.restart(self._children["index"])
        if wait:
            self.wait_ready()

    def kill(self, name: str) -> None:
        """SIGKILL ``name`` (``redis``, ``index``, ``ingest``, ``gateway-<i>`` or a worker
        id) at once: a crash on purpose (not reported by :meth:`check`)."""
        self._sup.kill(self._children[name])

    def restart(self, name: str) -> None:
        """Start ``name`` again (stopping it first if it still runs) on the ports it had and
        return at once: Redis comes back empty, a worker with an empty cache and its seq
        restarting at 0, a service with nothing but its flags. :meth:`wait_ready` waits
        for the cluster (a worker: also wait for it yourself, its lease may have lapsed)."""
        child = self._children[name]
        info = self.workers.get(name)
        if info is not None:  # sims bind port 0 at first: pin the ports they got
            child.argv = _pinned_ports(child.argv, info)
        self._children[name] = self._sup.restart(child)

    # ---- what runs where --------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """One JSON-able object describing every started process (``cortex up --state-file``)."""
        spec = self.spec
        pids = {name: child.pid for name, child in self._children.items()}
        logs = {name: str(child.log_path) for name, child in self._children.items()}
        index = None
        if self.index_target is not None:
            index = {"grpc": self.index_target, "token_file": str(self.index_token_file),
                     "query_token_file": str(self.index_query_token_file),
                     "metrics_port": self._index_metrics_port,
                     "metrics_url": _metrics_url(self._index_metrics_port),
                     "pid": pids["index"], "log": logs["index"]}
        ingest = None
        if self.ingest_url is not None:
            ingest = {"url": self.ingest_url, "metrics_port": self._ingest_port,
                      "metrics_url": self.ingest_url + "/metrics",
                      "health_url": self.ingest_url + "/health/ready",
                      "pid": pids["ingest"], "log": logs["ingest"]}
        return {
            "version": STATE_VERSION,
            "launcher_pid": os.getpid(),
            "log_dir": str(self.log_dir),
            "model": spec.model,
            "engine": spec.engine.value,
            "block_size": spec.block_size,
            "pd": spec.pd,
            "lease_ttl_s": spec.lease_ttl_s if spec.gateways else 0.0,  # 0: no expiry
            "admin_token": self.admin_token if spec.gateways else None,
            "redis": None if self.redis_url is None else {
                "url": self.redis_url, "pid": pids.get("redis"), "log": logs.get("redis")},
            "index": index,
            "ingest": ingest,
            "gateways": [
                {"id": f"gateway-{i}", "url": url, "port": int(url.rsplit(":", 1)[1]),
                 "metrics_url": url + "/metrics", "config": str(self._gateway_configs[i]),
                 "pid": pids[f"gateway-{i}"], "log": logs[f"gateway-{i}"]}
                for i, url in enumerate(self.gateway_urls)
            ],
            "workers": [
                {"id": w.id, "url": w.url, "engine": w.engine.value, "role": w.role.value,
                 "model": spec.model, "kv_events": w.kv_events, "replay": w.replay,
                 "bootstrap_port": w.bootstrap_port, "metrics_url": w.url + "/metrics",
                 "pid": pids[w.id], "log": logs[w.id]}
                for w in self.workers.values()
            ] + [
                {"id": w.id, "url": w.url, "engine": w.engine.value, "role": w.role.value,
                 "model": w.model, "kv_events": w.kv_events, "replay": w.replay,
                 "bootstrap_port": w.bootstrap_port, "metrics_url": w.url + "/metrics",
                 "block_size": w.block_size, "dp_size": w.dp_size, "pid": None, "log": None,
                 "ledger_pending": self.ledger_pending.get(w.id)}
                for w in spec.external
            ],
        }

    def __repr__(self) -> str:
        state = "stopped" if self._supervisor is None else "running"
        return (f"LocalCluster({state}, workers={list(self.workers)}, "
                f"gateways={self.gateway_urls}, index={self.index_target})")

    # ---- start-up steps -------------------------------------------------------------------

    @property
    def _sup(self) -> Supervisor:
        if self._supervisor is None:
            raise RuntimeError("the cluster is not running")
        return self._supervisor

    def _start(self, name: str, args: Sequence[str]) -> Child:
        child = self._children[name] = self._sup.start_cortex(name, args)
        return child

    def _gateway_ports(self) -> list[int]:
        spec = self.spec
        if spec.port == 0:
            return [free_port() for _ in range(spec.gateways)]
        ports = [spec.port + i for i in range(spec.gateways)]
        for port in ports:
            if not bindable(spec.host, port):
                raise ClusterError(
                    f"port {port} on {spec.host} is already in use (another `cortex up`?): "
                    "pass --port N for another first gateway port, or --port 0 for free ports")
        return ports

    def _redis_binary(self) -> str | None:
        if not self.spec.services or self.spec.redis_url is not None:
            return None
        binary = shutil.which("redis-server")
        if binary is None:
            raise ClusterError(
                "redis-server not found on PATH. Install it (Debian/Ubuntu: "
                "`sudo apt-get install redis-server`; macOS: `brew install redis`), or point "
                "the cluster at a running Redis with --redis-url redis://HOST:PORT/0")
        return binary

    def _start_redis(self, binary: str) -> None:
        port = free_port()
        data = self.log_dir / "redis-data"
        data.mkdir(parents=True, exist_ok=True)
        child = self._children["redis"] = self._sup.start("redis", [
            binary, "--port", str(port), "--bind", LOOPBACK, "--save", "", "--appendonly", "no",
            "--dir", str(data), "--logfile", ""])
        self.redis_url = f"redis://{LOOPBACK}:{port}/0"
        self._wait("redis", lambda: redis_ping(LOOPBACK, port),
                   time.monotonic() + 15.0, child)

    def _start_index(self) -> None:
        port, self._index_metrics_port = free_port(), free_port()
        self.index_target = f"{LOOPBACK}:{port}"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for token in (self.index_token_file, self.index_query_token_file):
            token.write_text(secrets.token_urlsafe(32))
            token.chmod(0o600)
        self._start("index", ["index", "--host", LOOPBACK, "--port", str(port),
                              "--peer-token-file", str(self.index_token_file),
                              "--query-token-file", str(self.index_query_token_file),
                              "--metrics-host", LOOPBACK,
                              "--metrics-port", str(self._index_metrics_port),
                              *self.spec.index_args])

    def _start_ingest(self) -> None:
        assert self.redis_url is not None and self.index_target is not None
        self._ingest_port = free_port()
        self.ingest_url = f"http://{LOOPBACK}:{self._ingest_port}"
        self._start("ingest", ["ingest", "run", "--redis-url", self.redis_url,
                               "--index", self.index_target, "--ingest-id", "ingest-0",
                               "--index-token-file", str(self.index_token_file),
                               "--metrics-host", LOOPBACK,
                               "--metrics-port", str(self._ingest_port),
                               "--poll-interval-s", str(self.spec.poll_interval_s),
                               *self.spec.ingest_args])

    def _gateway_document(self, index: int, port: int) -> dict[str, Any]:
        spec = self.spec
        interval = spec.poll_interval_s
        document: dict[str, Any] = {
            "gateway_id": f"gateway-{index}",
            "server": {"host": spec.host, "port": port, "admin_token": self.admin_token},
            "models": [{"name": spec.model, "engine": spec.engine.value,
                        "block_size": spec.block_size}],
            "index": {"targets": [self.index_target],
                      "token_file": str(self.index_token_file)},
            "registry": {"redis_url": self.redis_url, "lease_ttl_s": spec.lease_ttl_s,
                         "poll_interval_s": interval},
            # a dead dev worker leaves within its lease (production waits health.remove_after_s
            # first); probe timeouts of a worker busy with a gateway's request never count
            "health": {"interval_s": interval, "timeout_s": min(2.0, max(interval, 0.5)),
                       "remove_after_s": 0},
            "workers": [w.to_dict() for w in self._sim_specs()]
                       + [w.to_dict() for w in spec.external],
        }
        return _merge(document, spec.gateway_config)

    def _start_gateway(self, index: int, port: int) -> None:
        path = self.log_dir / f"gateway-{index}.json"
        path.write_text(json.dumps(self._gateway_document(index, port), indent=2) + "\n")
        path.chmod(0o600)  # holds the admin token
        self._gateway_configs.append(path)
        self._start(f"gateway-{index}", ["gateway", "--config", str(path),
                                         "--log-format", "text", *self.spec.gateway_args])
        connect = LOOPBACK if self.spec.host in ("0.0.0.0", "::", "") else self.spec.host
        self.gateway_urls.append(f"http://{connect}:{port}")

    def _launch_sim(self, worker_id: str, role: WorkerRole) -> int:
        """Start one sim on free ports; returns its log offset (the ready line follows it)."""
        spec = self.spec
        log = self.log_dir / f"{worker_id}.log"
        offset = log.stat().st_size if log.exists() else 0
        args = ["sim", "--engine", spec.engine.value, "--role", role.value,
                "--host", LOOPBACK, "--port", "0", "--kv-events-port", "0",
                "--replay-port", "0", "--model", spec.model,
                "--block-size", str(spec.block_size),
                "--kv-capacity-blocks", str(spec.kv_capacity_blocks),
                "--max-running", str(spec.max_running)]
        if role is WorkerRole.PREFILL and spec.engine is Engine.SGLANG:
            args += ["--bootstrap-port", "0"]
        if spec.zero_cost:
            args.append("--zero-cost")
        if spec.eagle_lookahead:
            args += ["--eagle-lookahead", str(spec.eagle_lookahead)]
        if spec.eagle_drop:
            args.append("--eagle-drop")
        self._start(worker_id, [*args, *spec.sim_args])
        return offset

    def _wait_sim(self, worker_id: str, role: WorkerRole, offset: int, deadline: float) -> None:
        child = self._children[worker_id]
        found: dict[str, Any] = {}

        def ready() -> bool:
            line = _ready_line(child.log_path, offset)
            if line is not None:
                found.update(line)
            return line is not None

        self._wait(f"worker {worker_id}", ready, deadline, child)
        host = LOOPBACK
        self.workers[worker_id] = WorkerInfo(
            id=worker_id, role=role, engine=self.spec.engine, url=str(found["url"]),
            kv_events=f"tcp://{host}:{found['kv_events_port']}",
            replay=f"tcp://{host}:{found['replay_port']}",
            bootstrap_port=found.get("bootstrap_port") if role is WorkerRole.PREFILL
            and self.spec.engine is Engine.SGLANG else None)

    def _wait_services(self, deadline: float, register: bool = False) -> None:
        assert self.index_target is not None and self.ingest_url is not None
        host, port = self.index_target.rsplit(":", 1)
        self._wait("index", functools.partial(probe_grpc_health, host, int(port)), deadline,
                   self._children["index"])
        # gateways live before the workers are registered: their probes renew the leases
        for i, url in enumerate(self.gateway_urls):
            self._wait(f"gateway-{i}", functools.partial(probe_http, url + "/health/live"),
                       deadline, self._children[f"gateway-{i}"])
        if register:
            self._register_workers()
        self.ledger_pending = {}
        grace = self.spec.ledger_grace_s
        if grace is not None and self.spec.external and not self._poll_until(
                self._ingest_ready, min(deadline, time.monotonic() + grace)):
            # workers that run already: the gateway serves them by load meanwhile
            external = {w.id for w in self.spec.external}
            self.ledger_pending = {wid: line for line in self._waiting_for
                                   if (wid := line.split(" ", 1)[0]) in external}
        self._wait("ingest", self._ingest_ready, deadline, self._children["ingest"])
        for i, url in enumerate(self.gateway_urls):
            self._wait(f"gateway-{i}", functools.partial(self._gateway_ready, url), deadline,
                       self._children[f"gateway-{i}"])

    def _sim_specs(self) -> list[WorkerSpec]:
        spec = self.spec
        return [w.spec(spec.model, spec.block_size, spec.eagle_lookahead or None,
                       spec.eagle_drop) for w in self.workers.values()]

    def _register_workers(self) -> None:
        specs = [*self._sim_specs(), *self.spec.external]
        if not specs:
            return
        assert self.redis_url is not None
        ttl = self.spec.lease_ttl_s if self.spec.gateways else 0.0
        try:
            run_async(_register(self.redis_url, specs, ttl))
        except Exception as exc:
            raise ClusterError(f"cannot register the workers in {self.redis_url}: {exc}") from exc

    def _ingest_ready(self) -> bool:
        status, body = http_call(f"{self.ingest_url}/health/ready")
        if status != 200 or not isinstance(body, dict) or body.get("status") != "ok":
            return False
        sources = body.get("sources", {})
        self._waiting_for = [
            f"{w.id} ({w.url}) rank {rank}: ledger {sources.get(f'{w.id}#{rank}', 'unknown')}"
            for w in self._expected() if self._ledger_awaited(w) for rank in range(w.dp_size)
            if sources.get(f"{w.id}#{rank}") != "READY"]
        return not self._waiting_for

    def _gateway_ready(self, url: str) -> bool:
        status, body = http_call(url + "/health/ready")
        if not isinstance(body, dict):
            return False
        live = self._expected()
        if not live:  # nothing to route to: the dependencies must be there
            return body.get("index") == "available" and body.get("registry") == "ok"
        # ready means the gateway serves: workers that publish no KV events have no ledger
        # to wait for (they are routed by load), which the gateway calls no_ready_ledger
        ready = status == 200 and (body.get("status") == "ready" or (
            body.get("status") == "degraded"
            and set(body.get("degraded", ())) <= {"no_ready_ledger"}
            and not any(self._ledger_awaited(w) for w in live)))
        status, listing = http_call(url + "/admin/workers",
                                headers={"Authorization": f"Bearer {self.admin_token}"})
        if status != 200 or not isinstance(listing, dict):
            return False
        seen = {w["id"]: w for w in listing.get("workers", [])}
        waiting = []
        for w in live:
            entry = seen.get(w.id)
            if entry is not None and entry["routable"] and (
                    not self._ledger_awaited(w) or entry["ledger"] == "ready"):
                continue
            if entry is not None:
                error = entry.get("last_probe_error")
                self._last_seen[w.id] = (f"health {entry['health']}, ledger {entry['ledger']}"
                                         + (f", last probe error: {error}" if error else ""))
                waiting.append(f"{w.id} ({w.url}): {self._last_seen[w.id]}")
            else:
                last = self._last_seen.get(w.id)
                waiting.append(f"{w.id} ({w.url}): not in the pool"
                               + (f" (left it with {last})" if last else ""))
        self._waiting_for = waiting
        return ready and not waiting

    def _expected(self) -> list[WorkerSpec]:
        """The workers start-up waits for: the live sims and the external workers."""
        sims = [info.spec(self.spec.model, self.spec.block_size)
                for wid, info in self.workers.items() if self._children[wid].alive()]
        return sims + list(self.spec.external)

    def _ledger_awaited(self, worker: WorkerSpec) -> bool:
        """Start-up waits for this worker's ledger: it publishes KV events and its grace
        (``spec.ledger_grace_s``) has not run out."""
        return worker.kv_events is not None and worker.id not in self.ledger_pending

    def _poll_until(self, predicate: Callable[[], bool], until: float) -> bool:
        """Poll ``predicate`` until true (``True``) or ``until`` passes (``False``);
        :class:`ClusterError` when a process crashes."""
        self._waiting_for = []
        while True:
            self.check()
            if predicate():
                return True
            if time.monotonic() >= until:
                return False
            time.sleep(_POLL_S)

    def _wait(self, what: str, predicate: Callable[[], bool], deadline: float,
              child: Child) -> None:
        """Poll ``predicate`` until true; :class:`ClusterError` with ``child``'s log tail when
        any process crashes or the deadline passes."""
        if not self._poll_until(predicate, deadline):
            waiting = "".join(f"\n  waiting for {w}" for w in self._waiting_for)
            raise ClusterError(
                f"{what} not ready after {self.spec.ready_timeout_s:g} s;{waiting}\nlast "
                f"log lines ({child.log_path}):\n{child.log_tail()}")


async def _register(redis_url: str, specs: Sequence[WorkerSpec], ttl_s: float) -> None:
    from cortex.registry import RedisRegistry

    async with RedisRegistry(redis_url) as registry:
        for spec in specs:
            await registry.register(spec, ttl_s)


async def _deregister(redis_url: str, worker_ids: Sequence[str]) -> None:
    from cortex.registry import RedisRegistry

    async with RedisRegistry(redis_url) as registry:
        for worker_id in worker_ids:
            await registry.deregister(worker_id)


def _ready_line(log_path: Path, offset: int) -> dict[str, Any] | None:
    try:
        with open(log_path, "rb") as log:
            log.seek(offset)
            text = log.read().decode(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(READY_PREFIX):
            found: dict[str, Any] = json.loads(line[len(READY_PREFIX):])
            return found
    return None


def _pinned_ports(argv: Sequence[str], info: WorkerInfo) -> list[str]:
    """A sim's command line with the ports it bound instead of ``0``."""
    ports = {"--port": info.url.rsplit(":", 1)[1],
             "--kv-events-port": info.kv_events.rsplit(":", 1)[1],
             "--replay-port": info.replay.rsplit(":", 1)[1]}
    if info.bootstrap_port is not None:
        ports["--bootstrap-port"] = str(info.bootstrap_port)
    out = list(argv)
    for i, arg in enumerate(out[:-1]):
        if arg in ports:
            out[i + 1] = ports[arg]
    return out


def _metrics_url(port: int | None) -> str | None:
    return None if port is None else f"http://{LOOPBACK}:{port}/metrics"


def _merge(base: Mapping[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``extra`` merged in, tables recursively (``extra`` wins)."""
    merged = dict(base)
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged
