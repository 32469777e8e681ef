"""``cortex up --pd``: a prefill/decode pool per engine, serving disaggregated requests."""

from __future__ import annotations

import aiohttp
import pytest

from cortex.devcluster.cluster import LocalCluster

from .conftest import Client, acceptance_spec, chat, long_prompt

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
async def test_a_pd_pool_serves_disaggregated_with_prefill_affinity(
    engine: str, tmp_path_factory: pytest.TempPathFactory, http: aiohttp.ClientSession,
) -> None:
    spec = acceptance_spec(engine=engine, pd=True, workers=3)
    with LocalCluster(spec, tmp_path_factory.mktemp(f"pd-{engine}")) as cluster:
        assert {w.id: w.role.value for w in cluster.workers.values()} == {
            "prefill-0": "prefill", "prefill-1": "prefill", "decode-0": "decode"}
        if engine == "sglang":
            assert all(cluster.workers[w].bootstrap_port for w in ("prefill-0", "prefill-1"))
        client = Client(cluster, http)
        system = long_prompt(f"pd-{engine}")
        first = await client.chat(chat(system, "first"))
        assert first.status == 200, first.body
        assert first.headers["x-cortex-pd"] == "disaggregated"
        prefill = first.headers["x-cortex-prefill-worker"]
        assert prefill.startswith("prefill-")
        assert first.headers["x-cortex-decode-worker"] == "decode-0"

        again = [await client.chat(chat(system, f"again {i}")) for i in range(5)]
        assert {r.headers["x-cortex-prefill-worker"] for r in again} == {prefill}
        assert {r.mode for r in again} == {"exact_kv"}
        assert all(0 < r.hit_tokens <= (r.cached_tokens or 0) for r in again)
