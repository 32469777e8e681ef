"""PodApi + PodDiscovery against a recorded list and watch stream served over HTTP on
127.0.0.1 in the Kubernetes API's shapes (no API server can run here), and a real Redis.

The fake server (:mod:`cortex.testing.kubernetes`) answers from the recording: list pages in
order, and each watch from a queue the test feeds event by event, so every step of the
protocol is observed as it happens.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import pytest

from cortex.registry import RedisRegistry, RegistryWatcher
from cortex.registry.kubernetes import (
    REMOVAL_REASON,
    DiscoveryConfig,
    KubernetesUnavailable,
    PodApi,
    PodDiscovery,
    ResourceVersionGone,
)
from cortex.registry.kubernetes.api import LineSplitter
from cortex.registry.kubernetes.service import DiscoveryService
from cortex.sim.config import SimConfig, TimingConfig
from cortex.sim.server import SimServer
from cortex.testing import RedisServer, wait_until_async
from cortex.testing.kubernetes import FakeKubernetesApi, Watch, fake_kubernetes_api

pytestmark = pytest.mark.timeout(60)

RECORDING: dict[str, Any] = json.loads(
    (Path(__file__).parents[1] / "data/kubernetes_pods.json").read_text())
A, B, C, D = (f"sglang-7c9d5f6b8-{s}.llm" for s in ("2xkqp", "9wlzt", "q4m7d", "zr8nb"))


@pytest.fixture
async def api_server() -> AsyncIterator[tuple[FakeKubernetesApi, str]]:
    async with fake_kubernetes_api("llm") as api:
        yield api, api.url


def config_of(url: str, redis: str, token_file: Path | None = None,
              **changes: Any) -> DiscoveryConfig:
    fields: dict[str, Any] = {"lease_ttl_s": 3.0, "watch_timeout_s": 30.0,
                              "backoff_max_s": 0.5, "metrics_port": None, **changes}
    return DiscoveryConfig(api_url=url, namespace="llm", redis_url=redis,
                           token_file=str(token_file) if token_file else None, **fields)


async def next_watch(fake: FakeKubernetesApi) -> Watch:
    return await fake.next_watch()


async def test_list_watch_bookmarks_and_relist_keep_the_registry_equal_to_the_ready_pods(
    api_server: tuple[FakeKubernetesApi, str], redis_server: RedisServer, tmp_path: Path,
) -> None:
    fake, url = api_server
    token = tmp_path / "token"
    token.write_text("token-1\n")
    fake.lists.extend((200, page) for page in RECORDING["list_pages"])
    cfg = config_of(url, redis_server.url, token)
    async with aiohttp.ClientSession() as session, \
            RedisRegistry(redis_server.url) as registry, \
            RegistryWatcher(registry, interval_s=0.2) as gateway_view:
        api = PodApi(session, url, "llm", cfg.selector, token_file=cfg.token_file,
                     watch_timeout_s=cfg.watch_timeout_s)

        async def has(*ids: str) -> bool:
            return set((await registry.list()).workers) == set(ids)

        async with PodDiscovery(api, registry, cfg) as discovery:
            watch = await next_watch(fake)
            await wait_until_async(lambda: has(A), timeout=10, what="the one ready pod")
            spec = (await registry.list()).workers[A]
            assert spec.url == "http://10.244.1.17:30000" and spec.block_size == 16
            assert spec.kv_events == "tcp://10.244.1.17:5557" and spec.model == "Qwen/Qwen3-8B"
            # the list was paged; the watch resumed from its resourceVersion, with bookmarks
            (first, auth), (second, _) = fake.calls(watch=False)
            assert first == {"labelSelector": "cortex/engine", "limit": "500"}
            assert second["continue"] == RECORDING["list_pages"][0]["metadata"]["continue"]
            assert auth == "Bearer token-1"
            assert watch.query == {"labelSelector": "cortex/engine", "watch": "1",
                                   "allowWatchBookmarks": "true", "resourceVersion": "48250",
                                   "timeoutSeconds": "30"}
            assert discovery.metrics.pods.labels("invalid")._value.get() == 1  # pod c's port

            script = RECORDING["watch_1"]
            await watch.events.put(script[0])  # b turns Ready
            await wait_until_async(lambda: has(A, B), timeout=10, what="b registered")
            await watch.events.put(script[1])  # a bookmark moves the resume point
            await watch.events.put(script[2])  # a is terminating: out at once
            await wait_until_async(lambda: has(B), timeout=10, what="a removed")
            stone = (await registry.list()).tombstones[A]
            assert stone.reason == REMOVAL_REASON
            await watch.events.put(script[3])  # DELETED: nothing more to do
            assert discovery.table.resource_version == "48310"

            token.write_text("token-2\n")  # kubelet rotated the service account's token
            fake.lists.append((200, RECORDING["relist"]))
            await watch.events.put(script[4])  # ERROR 410: list again
            watch = await next_watch(fake)
            assert watch.query["resourceVersion"] == "49150"
            await wait_until_async(lambda: has(B, D), timeout=10, what="d from the relist")
            assert fake.calls(watch=False)[-1][1] == "Bearer token-2"
            assert discovery.metrics.lists.labels("gone")._value.get() == 1

            # the server ends the watch after a bookmark: resumed from the bookmark
            await watch.events.put(RECORDING["watch_2"][0])
            await watch.events.put(None)
            watch = await next_watch(fake)
            assert watch.query["resourceVersion"] == "49177"
            # a refusal (RBAC) backs off and retries from the same point
            fake.watch_statuses.append((403, RECORDING["forbidden_status"]))
            await watch.events.put(None)
            watch = await next_watch(fake)
            assert watch.query["resourceVersion"] == "49177"
            assert discovery.metrics.api_errors._value.get() == 1

            # an operator's removal sticks while the pod stays the same
            await registry.remove(D, reason="drained by ops")
            done = await discovery.wait_reconciled(discovery.reconciliations + 1, timeout_s=10)
            await discovery.wait_reconciled(done, timeout_s=10)
            assert await has(B) and discovery.last_plan.held == (D,)
            # the gateways' view of the registry is the same: they route to what was found
            await wait_until_async(lambda: set(gateway_view.workers) == {B}, timeout=10,
                                   what="the gateways' view")
            await watch.events.put(None)


async def test_the_api_adapter_translates_gone_and_errors(
    api_server: tuple[FakeKubernetesApi, str],
) -> None:
    fake, url = api_server
    async with aiohttp.ClientSession() as session:
        api = PodApi(session, url, "llm", "cortex/engine")
        fake.lists.append((410, RECORDING["gone_status"]))
        with pytest.raises(ResourceVersionGone):
            await api.list()
        fake.lists.append((200, {"kind": "Status"}))
        with pytest.raises(KubernetesUnavailable, match="not a PodList"):
            await api.list()
        fake.watch_statuses.append((410, RECORDING["gone_status"]))
        with pytest.raises(ResourceVersionGone):
            async for _ in api.watch("1"):
                pass
        fake.watch_statuses.append((403, RECORDING["forbidden_status"]))
        with pytest.raises(KubernetesUnavailable, match="HTTP 403"):
            async for _ in api.watch("1"):
                pass
        missing = PodApi(session, url, "llm", "x", token_file="/nonexistent/token")
        with pytest.raises(KubernetesUnavailable, match="cannot read the token file"):
            await missing.list()
    async with aiohttp.ClientSession() as session:
        dead = PodApi(session, "http://127.0.0.1:1", "llm", "x")
        with pytest.raises(KubernetesUnavailable, match="pod list failed"):
            await dead.list()


def test_the_line_splitter_frames_and_bounds_events() -> None:
    splitter = LineSplitter(max_line=8)
    assert splitter.feed(b'{"a"') == []
    assert splitter.feed(b':1}\n\n{"b":2}\n{') == [b'{"a":1}', b'{"b":2}']
    with pytest.raises(KubernetesUnavailable, match="exceeds 8 bytes"):
        splitter.feed(b"123456789")


async def test_the_service_serves_health_and_metrics(
    api_server: tuple[FakeKubernetesApi, str], redis_server: RedisServer,
) -> None:
    fake, url = api_server
    fake.lists.extend((200, page) for page in RECORDING["list_pages"])
    cfg = config_of(url, redis_server.url, metrics_port=0)
    async with DiscoveryService(cfg) as service, aiohttp.ClientSession() as http:
        watch = await next_watch(fake)
        base = f"http://127.0.0.1:{service.metrics_port}"
        assert service.discovery is not None

        async def ready() -> bool:
            async with http.get(f"{base}/health/ready") as resp:
                return resp.status == 200

        await wait_until_async(ready, timeout=10, what="ready")
        async with http.get(f"{base}/health/live") as resp:
            assert resp.status == 200
        async with http.get(f"{base}/metrics") as resp:
            text = await resp.text()
        assert 'cortex_discovery_pods{state="worker"} 1.0' in text
        assert 'cortex_discovery_lists_total{reason="start"} 1.0' in text
        await watch.events.put(None)


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
async def test_with_learning_a_bare_pod_is_described_by_its_engine(
    api_server: tuple[FakeKubernetesApi, str], redis_server: RedisServer, engine: str,
) -> None:
    """vLLM reports its publishers as bind addresses (tcp://*:PORT): registered at the pod's
    IP, as SGLang's, with the engine's hash algorithm as the ``hash_algo`` label."""
    fake, url = api_server
    config = SimConfig(engine=engine, port=0, kv_events_port=0, replay_port=0, block_size=16,
                       model="sim-m", timing=TimingConfig(zero_cost=True))
    async with SimServer(config) as sim:
        port = urlsplit(sim.url).port
        bare = {"kind": "Pod", "apiVersion": "v1",
                "metadata": {"name": "engine-0", "namespace": "llm", "uid": "u-1",
                             "resourceVersion": "5", "labels": {"cortex/engine": engine},
                             "annotations": {"cortex/port": str(port)}},
                "status": {"phase": "Running", "podIP": "127.0.0.1",
                           "conditions": [{"type": "Ready", "status": "True"}]}}
        fake.lists.append((200, {"kind": "PodList", "apiVersion": "v1",
                                 "metadata": {"resourceVersion": "5"}, "items": [bare]}))
        cfg = config_of(url, redis_server.url, learn_from_engines=True)
        async with aiohttp.ClientSession() as session, \
                RedisRegistry(redis_server.url) as registry:
            api = PodApi(session, url, "llm", cfg.selector)
            async with PodDiscovery(api, registry, cfg) as discovery:
                watch = await next_watch(fake)

                async def registered() -> bool:
                    return "engine-0.llm" in (await registry.list()).workers

                await wait_until_async(registered, timeout=10, what="the bare pod registered")
                spec = (await registry.list()).workers["engine-0.llm"]
                assert (spec.model, spec.block_size) == ("sim-m", 16)
                assert spec.kv_events == sim.kv_events_endpoint
                assert spec.replay == sim.replay_endpoint
                assert spec.labels.get("hash_algo") == ("sha256" if engine == "vllm" else None)
                asked = discovery.metrics.engine_queries.labels("learned")._value.get()
                await discovery.wait_reconciled(discovery.reconciliations, timeout_s=10)
                # asked once per pod and address, not every reconciliation
                assert discovery.metrics.engine_queries.labels("learned")._value.get() == asked
                await watch.events.put(None)
