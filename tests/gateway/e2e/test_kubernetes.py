"""Workers found by pod discovery are routed like any other: the fake Kubernetes API on
127.0.0.1 lists two pods that are real sims, the discovery registers them in a real Redis,
ingest follows their KV events into the index, and the gateway — with no static workers —
routes to them by cache and drops the one whose pod turns not Ready.
"""

from __future__ import annotations

import copy
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import pytest

from cortex.gateway.config.gateway import RegistryConfig
from cortex.index.server import IndexServer
from cortex.ingest.config import IngestConfig
from cortex.ingest.forwarder import IndexTarget
from cortex.ingest.service import IngestService
from cortex.registry.kubernetes import DiscoveryConfig
from cortex.registry.kubernetes.service import DiscoveryService
from cortex.sim.server import SimServer
from cortex.testing import RedisServer, wait_until_async
from cortex.testing.kubernetes import fake_kubernetes_api

from ..conftest import BLOCK, MODEL, StartGateway, StartSim, gateway_index
from .test_cluster import TAIL, Cluster, chat, wait_index_holds

pytestmark = pytest.mark.timeout(90)


def pod_of(name: str, sim: SimServer, version: int, *, ready: bool = True) -> dict[str, Any]:
    """The pod a sim would be, in the API's shape (every sim listens on 127.0.0.1)."""
    port = urlsplit(sim.url).port
    events = urlsplit(sim.kv_events_endpoint).port
    replay = urlsplit(sim.replay_endpoint or "").port
    return {
        "kind": "Pod", "apiVersion": "v1",
        "metadata": {"name": name, "namespace": "llm", "resourceVersion": str(version),
                     "labels": {"cortex/engine": "sglang"},
                     "annotations": {"cortex/model": MODEL, "cortex/port": str(port),
                                     "cortex/kv-events-port": str(events),
                                     "cortex/replay-port": str(replay),
                                     "cortex/block-size": str(BLOCK)}},
        "spec": {"nodeName": "node-1"},
        "status": {"phase": "Running", "podIP": "127.0.0.1",
                   "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


async def test_discovered_pods_are_routed_by_cache_and_leave_when_not_ready(
    redis_server: RedisServer, index_server: IndexServer, start_sim: StartSim,
    start_gateway: StartGateway, http: aiohttp.ClientSession,
) -> None:
    sims = {"sim-a": await start_sim(), "sim-b": await start_sim()}
    pods = {name: pod_of(name, sim, 10 + i) for i, (name, sim) in enumerate(sims.items())}
    ingest = IngestConfig(index=(IndexTarget("127.0.0.1", index_server.port),),
                          redis_url=redis_server.url, metrics_port=None, poll_interval_s=0.2,
                          ingest_id="test-ingest")
    async with fake_kubernetes_api("llm") as api:
        api.lists.append((200, {"kind": "PodList", "apiVersion": "v1",
                                "metadata": {"resourceVersion": "20"},
                                "items": list(pods.values())}))
        discovery = DiscoveryConfig(api_url=api.url, namespace="llm",
                                    redis_url=redis_server.url, lease_ttl_s=3.0,
                                    metrics_port=None)
        async with DiscoveryService(discovery), IngestService(ingest):
            gateway = await start_gateway(
                [], registry=RegistryConfig(redis_url=redis_server.url, poll_interval_s=0.2),
                index=gateway_index(index_server.target, retry_after_ms=200))
            watch = await api.next_watch()
            c = Cluster(gateway, {f"{n}.llm": s for n, s in sims.items()}, http)
            probes = iter(range(1000))

            async def all_ready() -> bool:
                explained = await c.explain(chat(f"warm up {next(probes)}{TAIL}"))
                ledgers = {x["worker"]: x["ledger"] for x in explained["candidates"]}
                return ledgers == {"sim-a.llm": "ready", "sim-b.llm": "ready"}

            await wait_until_async(all_ready, timeout=20, what="both pods' ledgers READY")
            headers, cached = await c.send(chat("which pod holds this?"))
            holder = headers["x-cortex-assigned-worker"]
            assert holder in c.sims and cached == 0
            again = chat("a second question on the same long prefix")
            await wait_index_holds(c, again, holder)
            headers, cached = await c.send(again)
            assert headers["x-cortex-assigned-worker"] == holder
            assert 0 < int(headers["x-cortex-cache-hit-tokens"]) <= cached

            # the holder's pod turns not Ready: out of routing everywhere, by the watch alone
            name = holder.removesuffix(".llm")
            not_ready = copy.deepcopy(pods[name])
            not_ready["status"]["conditions"][0]["status"] = "False"
            not_ready["metadata"]["resourceVersion"] = "30"
            await watch.events.put({"type": "MODIFIED", "object": not_ready})

            async def moved() -> bool:
                return [x["worker"] for x in (await c.explain(again))["candidates"]] == [
                    w for w in c.sims if w != holder]

            await wait_until_async(moved, timeout=10, what="the not-Ready pod out of routing")
            headers, _ = await c.send(again)
            assert headers["x-cortex-assigned-worker"] != holder
