"""The faults ``cortex bench faults`` injects, one class each: ``inject`` starts the fault,
``repair`` ends it after the hold (restarts what was killed, clears what was armed), and
``notes`` holds what the fault measured besides the requests (RSS, registry size, the
oversize request's answer...). Every call blocks; the bench runs them in the thread that
owns the cluster's processes. What the cluster should do by itself (resurrect workers,
re-register them) is never done by ``repair``: the bench's *restore* step does it between
faults, after the measurement.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import aiohttp

from cortex.bench.faults_agents import GarbageSource, SlowBodyClients, StallProxy
from cortex.bench.faults_load import MODEL, Canary, LoadGenerator, LoopThread
from cortex.bench.procstat import rss_mb
from cortex.devcluster.cluster import LocalCluster
from cortex.registry import RedisRegistry, WorkerSpec

__all__ = ["FAULTS", "Bench", "Fault"]


def _http(url: str, method: str = "GET", body: Any = None, token: str | None = None,
          timeout: float = 5.0) -> tuple[int | None, Any]:
    data = None if body is None else json.dumps(body).encode()
    headers = {"content-type": "application/json"}
    if token:
        headers["authorization"] = f"Bearer {token}"
    request = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            raw = response.read()
            status = response.status
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    except OSError:
        return None, None
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw


def wait_for(predicate: Callable[[], bool], timeout_s: float, step_s: float = 0.1) -> float | None:
    """Seconds (to 0.01 s) until ``predicate()`` held, ``None`` if it did not within
    ``timeout_s``."""
    start = time.monotonic()
    while True:
        if predicate():
            return round(time.monotonic() - start, 2)
        if time.monotonic() - start >= timeout_s:
            return None
        time.sleep(step_s)


@dataclass
class Bench:
    """What the faults act on: the cluster, the bench's event loop and the load on it."""

    cluster: LocalCluster
    loop: LoopThread
    load: LoadGenerator
    canary: Canary
    hold_s: float
    hang_hold_s: float
    observe_s: float
    long_generation_s: float = 60.0

    @property
    def worker_ids(self) -> list[str]:
        return list(self.cluster.workers)

    def spec_of(self, worker_id: str) -> WorkerSpec:
        return self.cluster.workers[worker_id].spec(self.cluster.spec.model,
                                                    self.cluster.spec.block_size)

    def admin_workers(self) -> dict[str, dict[str, Any]]:
        """The pool as the first answering gateway sees it (id -> entry)."""
        for url in self.cluster.gateway_urls:
            status, body = _http(url + "/admin/workers", token=self.cluster.admin_token)
            if status == 200 and isinstance(body, dict):
                return {w["id"]: w for w in body.get("workers", [])}
        return {}

    def in_pool(self, worker_id: str, url: str | None = None) -> bool:
        entry = self.admin_workers().get(worker_id)
        return bool(entry and entry["routable"] and entry["ledger"] == "ready"
                    and (url is None or entry["url"] == url))

    def registry(self, call: Callable[[RedisRegistry], Any]) -> Any:
        """Run ``await call(registry)`` against the cluster's Redis."""
        async def run() -> Any:
            async with RedisRegistry(self.cluster.redis_url or "", op_timeout_s=2.0) as reg:
                return await call(reg)
        return self.loop.call(run(), timeout_s=10)

    def registered(self) -> list[str]:
        try:
            listing = self.registry(lambda reg: reg.list())
        except Exception:  # Redis down: nothing is registered as far as anyone can tell
            return []
        return sorted(listing.workers)

    def register(self, spec: WorkerSpec, ttl_s: float | None = None) -> None:
        ttl = self.cluster.spec.lease_ttl_s if ttl_s is None else ttl_s
        self.registry(lambda reg: reg.register(spec, ttl))

    def sim_faults(self, worker_id: str, patch: dict[str, Any] | None) -> None:
        """Arm ``patch`` on a sim's ``/sim/faults`` (``None``: clear them)."""
        url = self.cluster.workers[worker_id].url + "/sim/faults"
        status, body = (_http(url, "POST", patch) if patch is not None
                        else _http(url, "DELETE"))
        if status not in (200, 204):
            raise RuntimeError(f"{url}: HTTP {status} {body!r}")

    def rss(self, name: str) -> float | None:
        """RSS of cluster process ``name`` in MB, to 0.1 MB."""
        mb = rss_mb(self.cluster.process(name).pid)
        return None if mb is None else round(mb, 1)


class Fault:
    """One fault. ``hold`` is ``"normal"`` (``Bench.hold_s``), ``"long"`` (longer than the
    hung-request bound: the fault must be able to hang a client), ``"lease"`` (longer than
    a registry lease: what a real engine restart takes) or ``"none"``."""

    name: ClassVar[str]
    title: ClassVar[str]
    hold: ClassVar[str] = "normal"

    def __init__(self) -> None:
        self.notes: dict[str, Any] = {}

    def inject(self, b: Bench) -> None:
        raise NotImplementedError

    def repair(self, b: Bench) -> None:
        """End the fault (default: nothing to undo)."""


class KillService(Fault):
    """kill -9 of a service, restarted on the same ports after the hold."""

    service: ClassVar[str]

    def inject(self, b: Bench) -> None:
        b.cluster.kill(self.service)

    def repair(self, b: Bench) -> None:
        b.cluster.restart(self.service)


class KillIndex(KillService):
    name, title, service = "kill_index", "kill -9 of the index", "index"


class KillIngest(KillService):
    name, title, service = "kill_ingest", "kill -9 of the ingest", "ingest"


class KillGateway(KillService):
    name, title, service = "kill_gateway", "kill -9 of a gateway (of 2)", "gateway-1"


class RedisEmpty(Fault):
    name, title = "redis_empty", "Redis restarted empty"

    def inject(self, b: Bench) -> None:
        b.cluster.kill("redis")
        b.cluster.restart("redis")  # no persistence: it comes back empty

    def repair(self, b: Bench) -> None:
        back = wait_for(lambda: set(b.registered()) >= set(b.worker_ids), b.observe_s, 0.25)
        self.notes["workers registered again after s"] = back
        self.notes["workers registered at the end"] = len(b.registered())


class WorkerRestart(Fault):
    name, title, hold = "worker_restart", "a worker down past its lease, restarted on the " \
        "same ports", "lease"
    worker = "worker-1"

    def inject(self, b: Bench) -> None:
        b.cluster.kill(self.worker)

    def repair(self, b: Bench) -> None:
        b.cluster.restart(self.worker)
        restarted = time.monotonic()
        url = b.cluster.workers[self.worker].url
        up = wait_for(lambda: _http(url + "/health", timeout=1.0)[0] == 200, 30.0)
        self.notes["sim serving again after s"] = up
        back = wait_for(lambda: b.in_pool(self.worker), b.observe_s, 0.25)
        self.notes["routable with a READY ledger after s"] = back
        served = wait_for(lambda: any(r.worker == self.worker and r.ok and r.started > restarted
                                      for r in list(b.load.records)), 5.0, 0.25)
        self.notes["serving load after s"] = (
            None if served is None else round(time.monotonic() - restarted, 2))


class SimFault(Fault):
    """A fault the sim arms itself (``/sim/faults``), cleared after the hold."""

    worker: ClassVar[str]
    patch: ClassVar[dict[str, Any]]

    def inject(self, b: Bench) -> None:
        b.sim_faults(self.worker, self.patch)

    def repair(self, b: Bench) -> None:
        b.sim_faults(self.worker, None)
        self.notes["worker in the pool after the fault"] = b.in_pool(self.worker)


class Worker500(SimFault):
    name, title = "worker_500", "a worker answering 500s"
    worker, patch = "worker-0", {"error_rate": 1.0, "error_status": 500}


class WorkerHang(SimFault):
    name, title, hold = "worker_hang", "a worker that hangs before the first byte", "long"
    worker, patch = "worker-1", {"http_down": True}  # probes still answer


class StreamStall(Fault):
    name, title, hold = "stream_stall", "a stream that stalls mid-way", "long"
    worker = "worker-2"

    def __init__(self) -> None:
        super().__init__()
        self.proxy: StallProxy | None = None

    def inject(self, b: Bench) -> None:
        spec = b.spec_of(self.worker)
        host, port = spec.url.removeprefix("http://").rsplit(":", 1)
        proxy = self.proxy = StallProxy(host, int(port))
        b.loop.call(proxy.start())
        via = f"http://127.0.0.1:{proxy.port}"
        b.register(WorkerSpec.from_dict({**spec.to_dict(), "url": via}))
        routed = wait_for(lambda: b.in_pool(self.worker, via), 15.0, 0.2)
        self.notes["routed through the proxy after s"] = routed
        proxy.stall()

    def repair(self, b: Bench) -> None:
        proxy = self.proxy
        if proxy is None:
            return
        self.notes["responses stalled"] = proxy.stalled
        b.register(b.spec_of(self.worker))
        wait_for(lambda: b.in_pool(self.worker, b.spec_of(self.worker).url), 15.0, 0.2)
        b.loop.call(proxy.close())


class EventGarbage(Fault):
    name, title = "event_garbage", "garbage and oversize event batches (replay held open)"
    worker_id = "garbage-0"

    def inject(self, b: Bench) -> None:
        source = self.source = GarbageSource()
        spec = b.spec_of("worker-0")
        b.register(WorkerSpec.from_dict({**spec.to_dict(), "id": self.worker_id,
                                         "kv_events": source.endpoint,
                                         "replay": source.replay_endpoint}))
        self.notes["ingest RSS before (MB)"] = b.rss("ingest")
        subscribed = wait_for(lambda: _ingest_sources(b).get(f"{self.worker_id}#0")
                              is not None, 15.0, 0.2)
        self.notes["ingest following the source after s"] = subscribed
        time.sleep(0.5)  # its first replay is open (and never answered) by now
        source.send(b"\xc1" * (40 << 20))  # over --max-message-bytes (32 MiB)
        flood = b.loop.submit(source.flood(b.hold_s, rate=25.0, size=1 << 20))
        peak = 0.0
        while not flood.done():
            peak = max(peak, b.rss("ingest") or 0.0)
            time.sleep(0.25)
        flood.result()
        self.notes["ingest RSS peak (MB)"] = round(peak, 1)
        self.notes["garbage sent (MiB)"] = round(source.sent_bytes / (1 << 20), 1)

    def repair(self, b: Bench) -> None:
        b.registry(lambda reg: reg.deregister(self.worker_id))
        self.source.close()
        states = _ingest_sources(b)
        self.notes["real ledgers READY"] = all(
            states.get(f"{w}#0") == "READY" for w in b.worker_ids)
        time.sleep(1.0)
        self.notes["ingest RSS after (MB)"] = b.rss("ingest")


class OversizePrompt(Fault):
    name, title, hold = "oversize_prompt", "one 15 MiB completion prompt", "none"

    def inject(self, b: Bench) -> None:
        self.notes["workers registered before"] = len(b.registered())
        prompt = "cache " * ((15 << 20) // 6)
        started = time.monotonic()
        status = b.loop.call(_post(b.cluster.gateway_urls[0] + "/v1/completions",
                                   {"model": MODEL, "prompt": prompt, "max_tokens": 1}, 120.0))
        self.notes["answer"] = status
        self.notes["answered after ms"] = round((time.monotonic() - started) * 1000, 1)

    def repair(self, b: Bench) -> None:
        time.sleep(b.cluster.spec.lease_ttl_s)  # a worker stuck on it would lapse by now
        self.notes["workers registered a lease later"] = len(b.registered())


class SlowBody(Fault):
    name, title, hold = "slow_body", "50 clients sending their body at 1 byte/s", "long"

    def inject(self, b: Bench) -> None:
        host, port = b.cluster.gateway_urls[0].removeprefix("http://").rsplit(":", 1)
        self.clients = SlowBodyClients(host, int(port), 50)
        b.loop.call(_start(self.clients))

    def repair(self, b: Bench) -> None:
        c = self.clients
        self.notes["connections opened"] = c.opened
        self.notes["still open at the end of the hold"] = c.open
        self.notes["first cut by the gateway after s"] = (
            None if c.first_closed_after_s is None else round(c.first_closed_after_s, 1))
        b.loop.call(c.stop())


async def _start(clients: SlowBodyClients) -> None:
    clients.start()


async def _post(url: str, body: dict[str, Any], timeout_s: float) -> str:
    try:
        async with aiohttp.ClientSession() as session, session.post(
                url, json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            text = await resp.text()
            code = ""
            try:
                error = json.loads(text).get("error") or {}
                code = f" {error.get('code') or error.get('type') or ''}".rstrip()
            except (ValueError, AttributeError):
                pass
            return f"HTTP {resp.status}{code}"
    except TimeoutError:
        return f"no answer within {timeout_s:g} s"
    except aiohttp.ClientError as exc:
        return type(exc).__name__


def _ingest_sources(b: Bench) -> dict[str, str]:
    status, body = _http(f"{b.cluster.ingest_url}/health/ready", timeout=2.0)
    return body.get("sources", {}) if status is not None and isinstance(body, dict) else {}


FAULTS: Sequence[type[Fault]] = (
    Worker500, EventGarbage, WorkerHang, StreamStall, SlowBody, OversizePrompt,
    WorkerRestart, KillGateway, KillIngest, KillIndex, RedisEmpty,
)
"""In the order they run: the ones that leave the cluster whole first."""

QUICK: Sequence[str] = ("worker_500", "kill_ingest", "event_garbage")
"""What ``--quick`` runs (and the CI test)."""
