"""Cache-aware routing end to end, through the processes ``cortex up`` starts.

One cluster for the module (two zero-cost SGLang sims, two gateway replicas, index, ingest,
private Redis); each test uses its own long prompt, so the tests do not depend on each other.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import aiohttp
import pytest

from cortex.devcluster.cluster import LocalCluster
from cortex.testing import wait_until_async

from .conftest import Client, acceptance_spec, chat, long_prompt

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with LocalCluster(acceptance_spec(gateways=2), tmp_path_factory.mktemp("cluster")) as c:
        yield c


@pytest.fixture
def client(cluster: LocalCluster, http: aiohttp.ClientSession) -> Client:
    cluster.check()
    return Client(cluster, http)


async def test_every_repeat_of_a_shared_prompt_lands_on_the_worker_that_holds_it(
    client: Client,
) -> None:
    system = long_prompt("repeats")
    first = await client.chat(chat(system, "question 0"))
    assert first.status == 200 and first.hit_tokens == 0 and first.cached_tokens == 0
    holder = first.worker

    replies = [await client.chat(chat(system, f"question {i}")) for i in range(1, 61)]

    assert [r.status for r in replies] == [200] * 60
    assert {r.worker for r in replies} == {holder}  # 100 %
    assert {r.mode for r in replies} == {"exact_kv"}
    for r in replies:
        assert r.cached_tokens is not None
        # the prompt's shared part is cached, and the gateway never claims more than the engine
        assert 0 < r.hit_tokens <= r.cached_tokens
    # once the ledger (not only the gateway's prediction) holds the prompt, the credit is a real
    # hit; while the engine's events are in flight it is a predicted one
    last = chat(system, "question 60")

    async def ledger_caught_up() -> bool:
        explained = await client.explain(last)
        held = next(c for c in explained["candidates"] if c["worker"] == holder)
        return held["index_tokens"] >= held["predicted_tokens"] > 0

    await wait_until_async(ledger_caught_up, timeout=15, interval=0.05,
                           what="the index to hold what the gateway predicted")
    settled = await client.chat(last)
    assert (settled.worker, settled.headers["x-cortex-match-reason"]) == (holder, "hit")


async def test_a_flushed_cache_loses_its_hits_and_the_next_request_rewarms_one_worker(
    client: Client, cluster: LocalCluster,
) -> None:
    system = long_prompt("flush")
    body = chat(system, "what is cached?")
    holder = (await client.chat(body)).worker
    await client.wait_indexed(body, holder)
    warm = await client.chat(body)
    assert (warm.worker, warm.mode) == (holder, "exact_kv") and warm.hit_tokens > 0

    cluster.flush_worker(holder)

    async def no_credit_left() -> bool:
        explained = await client.explain(chat(system, "probe"))
        return all(c["index_tokens"] == 0 and c["predicted_tokens"] == 0
                   for c in explained["candidates"])

    await wait_until_async(no_credit_left, timeout=15, interval=0.05,
                           what="the flushed worker to lose its credit")
    cold = await client.chat(body)
    assert cold.status == 200
    assert cold.hit_tokens == 0 and cold.cached_tokens == 0  # the hits vanished everywhere
    assert cold.mode == "load_aware"

    # that request warmed exactly one worker again: the next ones follow it
    rewarmed = cold.worker
    again = [await client.chat(chat(system, f"follow-up {i}")) for i in range(5)]
    assert {r.worker for r in again} == {rewarmed}
    assert {r.mode for r in again} == {"exact_kv"}
    assert all(0 < r.hit_tokens <= (r.cached_tokens or 0) for r in again)


async def test_a_burst_split_across_two_gateway_replicas_still_colocates(
    client: Client,
) -> None:
    system = long_prompt("burst")
    seed = await client.chat(chat(system, "seed"), gateway=0)
    holder = seed.worker
    # the second replica never saw a request with this prefix: it learns it from the index
    await client.wait_indexed(chat(system, "probe"), holder, gateway=1)

    burst = await asyncio.gather(*(client.chat(chat(system, f"burst {i}"), gateway=i % 2)
                                   for i in range(24)))

    assert [r.status for r in burst] == [200] * 24
    assert {r.worker for r in burst} == {holder}, [
        (r.worker, r.mode, r.headers["x-cortex-match-reason"], r.hit_tokens) for r in burst]
    assert {r.mode for r in burst} == {"exact_kv"}
    assert all(0 < r.hit_tokens <= (r.cached_tokens or 0) for r in burst)


async def test_a_simultaneous_burst_of_a_new_prefix_colocates_on_one_replica(
    client: Client,
) -> None:
    system = long_prompt("cold burst")
    burst = await asyncio.gather(*(client.chat(chat(system, f"cold {i}")) for i in range(16)))
    assert [r.status for r in burst] == [200] * 16
    assert len({r.worker for r in burst}) == 1, [r.worker for r in burst]
    # one decision placed the new prefix, the other 15 followed its credit
    assert sorted(r.mode for r in burst) == ["exact_kv"] * 15 + ["load_aware"], [
        (r.worker, r.mode, r.headers["x-cortex-match-reason"]) for r in burst]
    assert {r.headers["x-cortex-match-reason"] for r in burst if r.mode == "exact_kv"} <= {
        "predicted_hit", "hit"}
