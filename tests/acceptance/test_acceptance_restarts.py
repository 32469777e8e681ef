"""An engine restarted under the same worker id after an ingest restart (issue 28's real-engine
sequence, on vLLM sims): the restarted engine's ledger holds nothing of its predecessor's, also
under a prefix the new engine computes again."""

from __future__ import annotations

from collections.abc import Iterator

import aiohttp
import pytest

from cortex.devcluster.cluster import LocalCluster
from cortex.hashing import Engine
from cortex.testing import wait_until_async

from .conftest import LEASE_TTL_S, Client, acceptance_spec, chat, long_prompt

pytestmark = pytest.mark.slow


@pytest.fixture
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with LocalCluster(acceptance_spec(engine=Engine.VLLM),
                      tmp_path_factory.mktemp("cluster")) as c:
        yield c


async def test_a_worker_back_under_its_id_is_credited_with_what_it_computed_only(
    cluster: LocalCluster, http: aiohttp.ClientSession,
) -> None:
    client = Client(cluster, http)
    system = long_prompt("restart")
    body = chat(system, "first")
    victim = (await client.chat(body)).worker
    await client.wait_indexed(body, victim)
    # the ingest restarted: the ledgers come back from the engines' replay
    cluster.kill("ingest")
    cluster.restart("ingest")
    cluster.wait_ready(timeout_s=30)
    await client.wait_indexed(body, victim)

    cluster.kill(victim)  # the engine dies; its lease lapses, every service drops it

    async def gone() -> bool:
        return victim not in await client.workers()

    await wait_until_async(gone, timeout=LEASE_TTL_S + 10, interval=0.05,
                           what=f"{victim} to leave the pool")
    cluster.restart(victim)  # same ports, same id, an empty cache, seq from 0

    async def back() -> bool:
        worker = (await client.workers()).get(victim)
        return worker is not None and worker["ledger"] == "ready"

    await wait_until_async(back, timeout=30, interval=0.05, what=f"{victim}'s ledger ready")
    assert (await client.index_tokens(body))[victim] == 0
    # the new engine computes the first half of the prompt (asked directly): its ledger
    # holds that half, and no block of the old engine's beyond it
    half = chat(system[: len(system) // 2], "second")
    async with http.post(cluster.workers[victim].url + "/v1/chat/completions",
                         json=half) as resp:
        assert resp.status == 200
    await client.wait_indexed(half, victim)
    held = (await client.index_tokens(half))[victim]
    assert 0 < (await client.index_tokens(body))[victim] <= held
    reply = await client.chat(body)
    assert reply.status == 200 and reply.hit_tokens <= (reply.cached_tokens or 0)
