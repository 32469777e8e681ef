"""Discovery over real HTTP: simulated SGLang and vLLM workers (in process, 127.0.0.1,
port 0) describe themselves in their engine's shapes; a server that is no engine and a port
nobody listens on give errors naming what could not be learned."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import pytest
from aiohttp import web

from cortex.hashing import Engine
from cortex.registry import DiscoveryError, WorkerRole, discover
from cortex.sim.config import Role, SimConfig, TimingConfig
from cortex.sim.server import SimServer
from cortex.testing import free_port

pytestmark = pytest.mark.timeout(30)

StartSim = Callable[..., Coroutine[Any, Any, SimServer]]


@pytest.fixture
async def start_sim() -> AsyncIterator[StartSim]:
    async with contextlib.AsyncExitStack() as stack:

        async def start(**fields: Any) -> SimServer:
            config = SimConfig(**{"port": 0, "kv_events_port": 0, "replay_port": 0,
                                  "block_size": 8, "kv_capacity_blocks": 64,
                                  "timing": TimingConfig(zero_cost=True), **fields})
            return await stack.enter_async_context(SimServer(config))

        yield start


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
async def test_a_sim_describes_itself_in_its_engines_shape(start_sim: StartSim,
                                                           engine: str) -> None:
    sim = await start_sim(engine=engine, model="org/model-a", dp_size=2, topic="kv",
                          max_model_len=4096)
    found = await discover(sim.url)
    assert found.problems == ()
    assert found.unlearned() == (("role", "bootstrap_port") if engine == "vllm" else ())
    spec = found.spec()
    assert (spec.engine, spec.model, spec.block_size, spec.dp_size, spec.context_length,
            spec.topic) == (Engine(engine), "org/model-a", 8, 2, 4096, "kv")
    assert spec.kv_events_endpoint(1) == f"tcp://127.0.0.1:{sim.kv_events_port + 1}"
    # registered where a subscriber connects (vLLM reports tcp://*:PORT, its bind address)
    assert spec.kv_events == f"tcp://127.0.0.1:{sim.kv_events_port}"
    assert spec.replay_endpoint(0) == f"tcp://127.0.0.1:{sim.replay_port}"
    assert found.models == ("org/model-a",)
    source = ("GET /server_info" if engine == "sglang" else  # vLLM reports its bind address
              f"GET /kv_event_sources, bound as tcp://*:{sim.kv_events_port}")
    assert found.sources["kv_events"] == source


async def test_an_sglang_prefill_says_its_role_and_bootstrap_port(start_sim: StartSim) -> None:
    sim = await start_sim(engine="sglang", role=Role.PREFILL, bootstrap_port=0)
    spec = (await discover(sim.url)).spec()
    assert (spec.role, spec.bootstrap_port) == (WorkerRole.PREFILL, sim.bootstrap_port)


async def test_a_worker_without_replay_says_so(start_sim: StartSim) -> None:
    for engine in ("sglang", "vllm"):
        sim = await start_sim(engine=engine, replay_port=None)
        found = await discover(sim.url)
        assert "replay" in found.learned and found.spec().replay is None


@contextlib.asynccontextmanager
async def serving(routes: dict[str, Any], key: str | None = None,
                  extra: dict[str, Any] | None = None) -> AsyncIterator[str]:
    """A plain HTTP server answering ``routes`` (path → JSON body), requiring
    ``Authorization: Bearer <key>`` when ``key`` is set, and ``extra`` (path → handler);
    yields its URL."""

    async def answer(request: web.Request) -> web.Response:
        if key is not None and request.headers.get("Authorization") != f"Bearer {key}":
            return web.json_response({"error": "Unauthorized"}, status=401)
        return web.json_response(routes[request.path])

    app = web.Application()
    for path in routes:
        app.router.add_get(path, answer)
    for path, handler in (extra or {}).items():
        app.router.add_get(path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def test_an_older_sglang_with_only_get_server_info() -> None:
    info = {"model_path": "/models/m", "page_size": 16, "dp_size": 1,
            "kv_events_config": '{"publisher": "zmq", "endpoint": "tcp://*:5557"}'}
    async with serving({"/get_server_info": info}) as url:
        found = await discover(url, timeout_s=2.0)
    spec = found.spec()
    assert (spec.engine, spec.model, spec.block_size) == (Engine.SGLANG, "/models/m", 16)
    assert spec.kv_events_endpoint() == "tcp://127.0.0.1:5557" and spec.replay is None
    assert found.sources["model"] == "GET /get_server_info"
    assert "GET /server_info: HTTP 404" in found.problems


async def test_an_engine_started_with_an_api_key_is_asked_with_it() -> None:
    models = {"object": "list", "data": [{"id": "m", "owned_by": "vllm", "parent": None,
                                          "max_model_len": 2048}]}
    async with serving({"/v1/models": models, "/kv_event_sources": {}}, key="sk-1") as url:
        refused = await discover(url, timeout_s=2.0)
        found = await discover(url, timeout_s=2.0, authorization="Bearer sk-1")
    assert "GET /v1/models: HTTP 401" in refused.problems and refused.engine is None
    spec = found.spec()
    assert (spec.engine, spec.model, spec.context_length, spec.kv_events) == (
        Engine.VLLM, "m", 2048, None)


async def test_a_metrics_answer_that_arrives_in_pieces_is_read_to_its_end() -> None:
    """A real vLLM's ``/metrics`` is ~50 KB and can reach the probe in more than one piece;
    the cache config comes last. Reading only the first piece lost it (CI, 2026-12-06)."""
    models = {"object": "list", "data": [{"id": "m", "owned_by": "vllm", "max_model_len": 64}]}
    other = "".join(f"vllm:other_{i}{{engine=\"0\"}} 0.0\n" for i in range(3000))
    config = 'vllm:cache_config_info{block_size="16",enable_prefix_caching="True"} 1.0\n'

    async def metrics(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/plain"})
        await response.prepare(request)
        await response.write(other.encode())
        await asyncio.sleep(0.05)  # the link: the rest comes later, as a second piece
        await response.write(config.encode())
        await response.write_eof()
        return response

    async with serving({"/v1/models": models, "/kv_event_sources": {}},
                       extra={"/metrics": metrics}) as url:
        found = await discover(url, timeout_s=2.0)
    assert found.problems == () and found.spec().block_size == 16


async def test_a_server_that_is_no_engine_names_the_missing_fields() -> None:
    async with serving({"/v1/models": {"object": "list", "data": []}}) as url:
        found = await discover(url, timeout_s=2.0)
    assert "GET /server_info: HTTP 404" in found.problems
    assert "GET /kv_event_sources: HTTP 404" in found.problems
    with pytest.raises(DiscoveryError) as caught:
        found.spec(require=("engine", "model", "block_size"))
    assert caught.value.missing == ("engine", "model", "block_size")
    assert f"could not learn engine, model, block_size from {url}" in str(caught.value)


async def test_nobody_listening_is_a_problem_not_an_exception() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    found = await discover(url, timeout_s=2.0)
    assert len(found.problems) == 1 and "cannot connect" in found.problems[0]
    with pytest.raises(DiscoveryError, match="could not learn engine, model"):
        found.spec()
