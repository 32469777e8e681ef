"""The contenders, each started in front of its own fresh set of ``cortex sim`` workers.

* ``cortex`` — the whole Cortex deployment (:class:`cortex.devcluster.cluster.LocalCluster`: private
  Redis, index, ingest, one gateway) with its documented default routing weights, or the
  ones given.
* ``cortex_load_only`` — the same deployment with ``routing.weights.alpha = 0``: cache credit
  never enters the score, so workers are ranked by load alone (the gateway has no switch that
  turns exact-KV routing off and still reports READY ledgers; alpha = 0 is the documented
  weight that does it, and keeps every other cost — tokenizing, matching — identical).
* ``cortex_gpu_only`` — the same deployment with ``host_hit = disk_hit = 0``: blocks the
  workers hold in host memory get no credit (GPU-only crediting, as before tiers existed).
* ``cortex_no_agents`` — the same deployment with ``session = session_home = kv_pressure =
  0``: live sessions are no load and full KV pools no cost (scoring before issue 29; the
  session hint still breaks ties and credits a session's unseen last turn). Opt-in.
* ``sglang_cache_aware`` / ``sglang_round_robin`` — ``sglang-router launch --policy …`` from
  PyPI with its defaults, in front of bare sims (no Redis, index or ingest running).
* ``vllm_cache_aware`` — ``vllm-router --policy cache_aware`` (the vLLM project's Rust router,
  PyPI) with its defaults, in front of bare sims; ``vllm_consistent_hash`` its session policy
  (requests with the same ``X-Session-ID`` go to the same worker; opt-in).

A :class:`Topology` changes the shape: ``replicas`` router replicas behind HAProxy (Cortex:
that many gateways sharing one index; peers: that many independent router processes), or a
prefill/decode pool (Cortex's PD orchestration; ``sglang-router --pd-disaggregation`` with
its cache-aware prefill policy).

Every deployment lists the processes it started, so the benchmark can charge their CPU.
Start deployments from the main thread (children die with the thread that started them).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import sys
import time
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cortex.bench.procstat import busy_cores, cpu_s, machine_busy_s
from cortex.bench.routing.balancer import HAPROXY_INSTALL, haproxy_binary, start_haproxy
from cortex.devcluster.cluster import ClusterError, ClusterSpec, LocalCluster, probe_http
from cortex.devcluster.supervisor import Child, ChildExited, Supervisor
from cortex.hashing import Engine
from cortex.registry import WorkerRole
from cortex.testing import (
    free_port,
    peer_program,
    sglang_router_argv,
    vllm_router_argv,
    wait_until,
)

__all__ = [
    "CONTENDERS",
    "OPT_IN",
    "VARIANT_ONLY",
    "CpuMeter",
    "Deployment",
    "SimSetup",
    "Topology",
    "cpu_split",
    "deploy",
    "machine_busy_cores",
    "missing_program",
    "pinned",
]

CONTENDERS = ("cortex", "cortex_load_only", "cortex_gpu_only", "cortex_no_agents",
              "sglang_cache_aware", "sglang_round_robin", "vllm_cache_aware",
              "vllm_consistent_hash")
OPT_IN = ("cortex_no_agents", "vllm_consistent_hash")
"""Contenders that run only when ``--contenders`` names them (``vllm-router``'s session
policy: it hashes ``X-Session-ID``; Cortex without its agent terms: the baseline of the
agent workload)."""
VARIANT_ONLY = ("cortex_gpu_only",)
"""Contenders that run only in the variants naming them (GPU-only crediting differs from
``cortex`` only where the workers have host tiers)."""
PEER_PROGRAMS = {"sglang": "sglang-router", "vllm": "vllm-router"}


@dataclass(frozen=True, slots=True)
class SimSetup:
    """The workers every contender gets: ``workers`` sims of ``engine`` (SGLang unless a
    workload asks for vLLM) with a KV pool of ``kv_capacity_blocks`` blocks of
    ``block_size`` tokens and the timing model. ``model_dir``: the served model's tokenizer
    and configs (the sims' and Cortex's; ``None``: the default tokenizer)."""

    workers: int
    kv_capacity_blocks: int
    block_size: int = 16
    max_running: int = 64
    prefill_ms_per_token: float = 0.1
    prefill_overhead_ms: float = 2.0
    decode_ms_per_token: float = 5.0
    model: str = "cortex-sim"
    host_capacity_blocks: int = 0
    engine: Engine = Engine.SGLANG
    model_dir: Path | None = None

    def sim_args(self) -> tuple[str, ...]:
        host = (("--host-capacity-blocks", str(self.host_capacity_blocks))
                if self.host_capacity_blocks else ())
        model = ("--tokenizer", str(self.model_dir)) if self.model_dir is not None else ()
        return ("--prefill-ms-per-token", f"{self.prefill_ms_per_token:g}",
                "--prefill-overhead-ms", f"{self.prefill_overhead_ms:g}",
                "--decode-ms-per-token", f"{self.decode_ms_per_token:g}",
                *host, *model, "--log-level", "warning")

    def spec(self, *, services: bool, gateway_config: Mapping[str, Any] | None = None,
             gateways: int = 1, pd: bool = False) -> ClusterSpec:
        config = dict(gateway_config or {})
        if self.model_dir is not None:  # the gateway reads the same tokenizer and configs
            config["models"] = [{"name": self.model, "engine": self.engine.value,
                                 "block_size": self.block_size,
                                 "tokenizer": str(self.model_dir)}]
        return ClusterSpec(
            workers=self.workers, gateways=gateways if services else 0, services=services,
            port=0, pd=pd, engine=self.engine, model=self.model, block_size=self.block_size,
            kv_capacity_blocks=self.kv_capacity_blocks, max_running=self.max_running,
            sim_args=self.sim_args(), gateway_config=config)


@dataclass(frozen=True, slots=True)
class Topology:
    """``replicas``: router replicas behind HAProxy, round robin (0: clients reach the one
    router directly). ``pd``: the workers form a prefill/decode pool (no replicas)."""

    replicas: int = 0
    pd: bool = False

    def __post_init__(self) -> None:
        if self.replicas < 0 or (self.pd and self.replicas):
            raise ValueError(f"replicas must be >= 0 and not combined with pd: {self}")

    @property
    def routers(self) -> int:
        return max(self.replicas, 1)


@dataclass(slots=True)
class Deployment:
    """A running contender: where to send requests, the workers behind it, its processes."""

    contender: str
    url: str
    workers: dict[str, str]
    pids: dict[str, int] = field(default_factory=dict)
    startup_s: float = 0.0
    description: str = ""
    gateway_urls: tuple[str, ...] = ()
    prefill: tuple[str, ...] = ()
    """The prefill pool's worker ids (PD deployments)."""


def machine_busy_cores(interval_s: float = 0.5) -> float:
    """Cores the whole machine keeps busy over the next ``interval_s`` seconds (blocks)."""
    start = machine_busy_s()
    time.sleep(interval_s)
    return busy_cores(start, machine_busy_s())


def _set_affinity(pid: int, cpus: set[int]) -> None:
    """Every thread of ``pid`` (the call takes one thread id at a time) onto ``cpus``."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        tids = [pid]
    for tid in tids:
        with contextlib.suppress(ProcessLookupError):  # a thread that just ended
            os.sched_setaffinity(tid, cpus)


def cpu_split() -> dict[str, list[int]] | None:
    """The CPUs :func:`pinned` gives each side (``None`` with fewer than two CPUs)."""
    mine = sorted(os.sched_getaffinity(0))
    if len(mine) < 2:
        return None
    return {"routing tier": mine[:1], "workers and load generator": mine[1:]}


@contextlib.contextmanager
def pinned(d: Deployment) -> Iterator[None]:
    """While inside: the deployment's routing tier (gateway, index, ingest, Redis, or
    sglang-router) alone on one CPU, its workers and this load generator on the others — as
    in production, where routers do not share cores with the engines (:func:`cpu_split`; no
    change with fewer than two CPUs). This process's affinity is restored on the way out."""
    split = cpu_split()
    if split is None:
        yield
        return
    mine = os.sched_getaffinity(0)
    routing, rest = set(split["routing tier"]), set(split["workers and load generator"])
    for name, pid in d.pids.items():
        _set_affinity(pid, rest if name in d.workers else routing)
    _set_affinity(os.getpid(), rest)
    try:
        yield
    finally:
        _set_affinity(os.getpid(), mine)


class CpuMeter:
    """CPU seconds spent by given processes (and this one) and by the whole machine."""

    def __init__(self, pids: Mapping[str, int]) -> None:
        self.pids = dict(pids)
        self._start = self._read()
        self._wall = time.monotonic()

    def _read(self) -> tuple[dict[str, float], float, float, float]:
        per = {name: cpu_s(pid) or 0.0 for name, pid in self.pids.items()}
        busy, total = machine_busy_s()
        return per, time.process_time(), busy, total

    def stop(self) -> dict[str, Any]:
        """Per process CPU seconds and the load generator's; in cores (CPU seconds per
        second): ours, the whole machine's, and the rest (``foreign``: other work on the
        machine, noise for this measurement)."""
        per0, self0, busy0, total0 = self._start
        per1, self1, busy1, total1 = self._read()
        wall = time.monotonic() - self._wall
        processes = {name: round(per1[name] - per0[name], 2) for name in per1}
        processes["load generator"] = round(self1 - self0, 2)
        ours = sum(processes.values()) / wall if wall else 0.0
        cores = os.cpu_count() or 1
        busy = busy_cores((busy0, total0), (busy1, total1))
        return {"wall_s": round(wall, 2), "processes": processes,
                "ours_cores": round(ours, 2), "machine_busy_cores": round(busy, 2),
                "foreign_cores": round(max(busy - ours, 0.0), 2), "cores": cores}


START_ATTEMPTS = 3
"""Start-ups tried per deployment: ports are picked free and bound a moment later, so on a
busy machine another process can take one in between (a start-up failure, not a result)."""


def _started(spec: ClusterSpec, log_dir: Path) -> LocalCluster:
    """A started :class:`LocalCluster`; a failed start-up is retried with fresh ports."""
    for attempt in range(START_ATTEMPTS):
        cluster = LocalCluster(spec, log_dir / f"attempt-{attempt}" if attempt else log_dir)
        try:
            cluster.start()
            return cluster
        except ClusterError as exc:
            if attempt == START_ATTEMPTS - 1:
                raise
            print(f"    start-up failed, trying again: {str(exc).splitlines()[0]}",
                  file=sys.stderr, flush=True)
    raise AssertionError("unreachable")


def missing_program(contender: str, topology: Topology) -> str | None:
    """Why ``contender`` cannot run in ``topology`` here (a program not installed), or
    ``None``."""
    if topology.replicas and haproxy_binary() is None:
        return f"haproxy is not installed (Debian: `{HAPROXY_INSTALL}`)"
    family = contender.split("_", 1)[0]
    program = PEER_PROGRAMS.get(family)
    if program is not None and shutil.which(peer_program(program)) is None:
        return f"{program} is not installed (`pip install {program}`)"
    return None


def _router_ready(child: Child, url: str) -> bool:
    if not child.alive():
        raise ChildExited(f"{child.name} exited: {child.log_tail(500)}")
    return probe_http(url + "/v1/models")


def _peer_argv(contender: str, port: int, cluster: LocalCluster) -> list[str]:
    """The command line of a peer router in front of ``cluster``'s workers."""
    family, policy = contender.split("_", 1)
    if family == "vllm":
        return vllm_router_argv(port, policy, [w.url for w in cluster.workers.values()])
    if not cluster.spec.pd:
        return sglang_router_argv(port, policy, [w.url for w in cluster.workers.values()])
    pd = ["--pd-disaggregation"]
    for w in cluster.workers.values():
        if w.role is WorkerRole.PREFILL:
            pd += ["--prefill", w.url, str(w.bootstrap_port)]
        else:
            pd += ["--decode", w.url]
    return sglang_router_argv(port, policy, pd_args=pd)


def _router(supervisor: Supervisor, contender: str, cluster: LocalCluster, name: str
            ) -> tuple[str, int]:
    """Start one peer router (fresh port on a failed start-up); its URL and pid."""
    for attempt in range(START_ATTEMPTS):
        port = free_port()
        child = supervisor.start(f"{name}-{attempt}", _peer_argv(contender, port, cluster))
        url = f"http://127.0.0.1:{port}"
        try:
            wait_until(functools.partial(_router_ready, child, url), 60, 0.05, name)
            return url, child.pid
        except (ChildExited, TimeoutError) as exc:
            supervisor.stop(child)
            if attempt == START_ATTEMPTS - 1:
                raise
            print(f"    {name} start-up failed, trying again: {exc}", file=sys.stderr,
                  flush=True)
    raise AssertionError("unreachable")


def _prefill_ids(cluster: LocalCluster) -> tuple[str, ...]:
    return tuple(wid for wid, w in cluster.workers.items() if w.role is WorkerRole.PREFILL)


def _balanced(supervisor: Supervisor, urls: list[str], log_dir: Path, pids: dict[str, int],
              topology: Topology) -> str:
    """The URL clients use: HAProxy over ``urls`` when the topology has replicas."""
    if not topology.replicas:
        return urls[0]
    url, child = start_haproxy(supervisor, urls, log_dir)
    pids["haproxy"] = child.pid
    return url


def _encoders_chosen(cluster: LocalCluster) -> bool:
    for url in cluster.gateway_urls:
        request = urllib.request.Request(url + "/admin/models", headers={
            "Authorization": f"Bearer {cluster.admin_token}"})
        with urllib.request.urlopen(request, timeout=5) as resp:
            models = json.loads(resp.read())["models"]
        if any("probe is running" in m["encoder_reason"] for m in models):
            return False
    return True


def _wait_encoders(cluster: LocalCluster) -> None:
    """Until every gateway has chosen its encoders (``tokenize.encoder: auto`` serves at once
    and probes ``fastokens`` in the background, 1-15 s here): a deployment is measured
    warmed up, as it serves after its first seconds."""
    wait_until(functools.partial(_encoders_chosen, cluster), 120, 0.25, "encoder choice")


@contextlib.contextmanager
def deploy(contender: str, sims: SimSetup, log_dir: Path,
           cortex_weights: Mapping[str, float] | None = None,
           topology: Topology = Topology()) -> Iterator[Deployment]:
    """Start ``contender`` with fresh sims in ``topology``; stop everything on exit."""
    if contender not in CONTENDERS:
        raise ValueError(f"unknown contender {contender!r}; one of {', '.join(CONTENDERS)}")
    log_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    shape = (f", {topology.replicas} replica(s) behind HAProxy" if topology.replicas else
             ", prefill/decode pool" if topology.pd else "")
    if contender.startswith("cortex"):
        weights = dict(cortex_weights or {})
        if contender == "cortex_load_only":
            weights["alpha"] = 0.0
        elif contender == "cortex_gpu_only":  # host / disk hits get no credit
            weights.update(host_hit=0.0, disk_hit=0.0)
        elif contender == "cortex_no_agents":  # no paced-session load, no KV pressure
            weights.update(session=0.0, session_home=0.0, kv_pressure=0.0)
        config = {"routing": {"weights": weights}} if weights else {}
        cluster = _started(sims.spec(services=True, gateway_config=config,
                                     gateways=topology.routers, pd=topology.pd), log_dir)
        gateways = [f"gateway-{i}" for i in range(topology.routers)]
        try:
            _wait_encoders(cluster)
            with Supervisor(log_dir / "balancer") as supervisor:
                pids = {name: cluster.process(name).pid
                        for name in ("redis", "index", "ingest", *gateways, *cluster.workers)}
                url = _balanced(supervisor, cluster.gateway_urls, log_dir, pids, topology)
                yield Deployment(
                    contender, url, {wid: w.url for wid, w in cluster.workers.items()}, pids,
                    time.monotonic() - started,
                    "Cortex gateway + index + ingest + Redis" + shape + (
                        f", routing weights {weights}" if weights else
                        ", default routing weights"),
                    tuple(cluster.gateway_urls), _prefill_ids(cluster))
        finally:
            cluster.stop()
        return
    family, policy = contender.split("_", 1)
    program = PEER_PROGRAMS[family]
    cluster = _started(sims.spec(services=False, pd=topology.pd), log_dir)
    try:
        with Supervisor(log_dir) as supervisor:
            workers = {wid: w.url for wid, w in cluster.workers.items()}
            pids = {wid: cluster.process(wid).pid for wid in cluster.workers}
            urls = []
            for i in range(topology.routers):
                url, pids[f"{program}-{i}"] = _router(supervisor, contender, cluster,
                                                      f"{program}-{i}")
                urls.append(url)
            yield Deployment(contender, _balanced(supervisor, urls, log_dir, pids, topology),
                             workers, pids, time.monotonic() - started,
                             f"{program} --policy {policy}, defaults otherwise" + shape,
                             prefill=_prefill_ids(cluster))
    finally:
        cluster.stop()
