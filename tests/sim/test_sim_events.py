"""KV events on real ZMQ sockets: decoded by Cortex's codec, they describe the cache exactly."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import aiohttp
import pytest
import zmq
import zmq.asyncio

from cortex.hashing import engine_event_ints
from cortex.kvevents.codec import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch
from cortex.kvevents.frames import ReplayEnd, parse_replay_reply, replay_request
from cortex.sim.server import SimServer
from cortex.sim.testkit import EventSubscriber, StartSim, chat_body, mirror

Subscribe = Callable[[SimServer], EventSubscriber]


async def chat(http: aiohttp.ClientSession, sim: SimServer, text: str, max_tokens: int = 3
               ) -> dict[str, object]:
    async with http.post(sim.url + "/v1/chat/completions",
                         json=chat_body(text, max_tokens=max_tokens)) as resp:
        assert resp.status == 200
        body: dict[str, object] = await resp.json()
        return body


async def replay(endpoint: str, start: int) -> list[int]:
    """Seqs a DEALER gets back for ``start`` (until the end marker)."""
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        await sock.send_multipart(replay_request(start))
        seqs: list[int] = []
        while True:
            reply = parse_replay_reply(await asyncio.wait_for(sock.recv_multipart(), 10))
            if isinstance(reply, ReplayEnd):
                return seqs
            seqs.append(reply.seq)
    finally:
        sock.close(linger=0)
        ctx.term()


@pytest.mark.parametrize(("engine", "version"), [("sglang", "0.5.23"), ("vllm", "0.33.0"),
                                                  ("vllm", "0.11.0"), ("sglang", "0.4.7")])
async def test_events_mirror_the_cache_and_carry_engine_hashes(
        start_sim: StartSim, subscribe: Subscribe, http: aiohttp.ClientSession, engine: str,
        version: str) -> None:
    sim = await start_sim(engine=engine, engine_version=version, kv_capacity_blocks=24)
    sub = subscribe(sim)
    await sub.sync(http, sim.url)
    texts = [f"Conversation {i % 3}: tell me about topic {i} in some detail please" for i in
             range(12)]
    for text in texts:
        await chat(http, sim, text)
    cache = sim.engine.cache
    await sub.wait_for(lambda: mirror(sub.events, 4) == cache.contents())
    assert sub.seqs == list(range(sub.seqs[0], sub.seqs[0] + len(sub.seqs)))
    assert any(isinstance(e, BlockRemoved) for e in sub.events)  # capacity forced evictions
    # Every stored hash is the engine's own hash of those tokens, chained from the parent.
    digests = {block.event_id: block.digest for block in cache.blocks()}
    for event in sub.events:
        if isinstance(event, BlockStored):
            assert event.block_size == 4 and len(event.token_ids) == 4 * len(event.block_hashes)
            parent = event.parent_block_hash
            if parent is None or parent in digests:
                expected = engine_event_ints(
                    engine, event.token_ids, 4,
                    parent=None if parent is None else digests[int(parent)])
                assert list(event.block_hashes) == expected


async def test_eviction_emits_block_removed_and_frees_capacity(
        start_sim: StartSim, subscribe: Subscribe, http: aiohttp.ClientSession) -> None:
    sim = await start_sim(engine="vllm", kv_capacity_blocks=12)
    sub = subscribe(sim)
    await sub.sync(http, sim.url)
    first = await chat(http, sim, "The first prompt is about apples and pears and plums.")
    cache = sim.engine.cache
    first_blocks = set(cache.contents())
    assert cache.free_blocks < 12
    for i in range(3):
        await chat(http, sim, f"Another prompt number {i} about something else entirely, ok?")
    await sub.wait_for(lambda: any(isinstance(e, BlockRemoved) for e in sub.events))
    removed = {int(h) for e in sub.events if isinstance(e, BlockRemoved) for h in e.block_hashes}
    assert removed & first_blocks
    assert cache.used_blocks <= cache.capacity
    again = await chat(http, sim, "The first prompt is about apples and pears and plums.")
    usage = again["usage"]
    assert isinstance(usage, dict) and isinstance(first["usage"], dict)
    assert usage["prompt_tokens_details"]["cached_tokens"] < usage["prompt_tokens"] - 4


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
async def test_flush_publishes_all_blocks_cleared(start_sim: StartSim, subscribe: Subscribe,
                                                  http: aiohttp.ClientSession, engine: str
                                                  ) -> None:
    sim = await start_sim(engine=engine)
    sub = subscribe(sim)
    await sub.sync(http, sim.url)
    await chat(http, sim, "Something worth caching for a little while, thank you.")
    await sub.wait_for(lambda: any(isinstance(e, BlockStored) for e in sub.events))
    path = "/flush_cache" if engine == "sglang" else "/reset_prefix_cache"
    async with http.post(sim.url + path) as resp:
        assert resp.status == 200
    await sub.wait_for(lambda: isinstance(sub.events[-1], AllBlocksCleared))
    assert mirror(sub.events, 4) == {} == sim.engine.cache.contents()


async def test_sglang_announces_a_clear_at_start(start_sim: StartSim) -> None:
    sim = await start_sim(engine="sglang")
    # Replay holds what no subscriber could have seen: seq 0 is the start-up clear.
    seqs = await replay(sim.replay_endpoint or "", 0)
    assert seqs == [0]


async def test_replay_returns_dropped_batches(start_sim: StartSim, subscribe: Subscribe,
                                              http: aiohttp.ClientSession) -> None:
    sim = await start_sim(engine="vllm", engine_version="0.33.0")
    sub = subscribe(sim)
    await sub.sync(http, sim.url)
    base = sim.publisher.next_seq
    sim.set_faults(drop_batches=2)
    for i in range(4):
        await chat(http, sim, f"Prompt {i} that stores some new blocks in the cache, yes.")
    await sub.wait_for(lambda: len(sub.seqs) >= 2 and sim.publisher.next_seq - 1 in sub.seqs)
    missing = sorted(set(range(base, sim.publisher.next_seq)) - set(sub.seqs))
    assert missing == [base, base + 1] and sim.publisher.dropped_batches == 2
    replayed = await replay(sim.replay_endpoint or "", missing[0])
    assert replayed == list(range(missing[0], sim.publisher.next_seq))


async def test_duplicate_and_reorder_faults(start_sim: StartSim, subscribe: Subscribe,
                                            http: aiohttp.ClientSession) -> None:
    sim = await start_sim(engine="sglang")
    sub = subscribe(sim)
    await sub.sync(http, sim.url)
    base = sim.publisher.next_seq
    sim.set_faults(duplicate_batches=1, reorder_batches=1)
    for i in range(3):
        await chat(http, sim, f"Prompt {i} with enough tokens to fill some blocks here.", 1)
    await sub.wait_for(lambda: len(sub.seqs) >= 4)
    assert sub.seqs[:4] == [base, base, base + 2, base + 1]


async def test_restart_resets_seq_and_clears(start_sim: StartSim, subscribe: Subscribe,
                                             http: aiohttp.ClientSession) -> None:
    sim = await start_sim(engine="vllm")
    sub = subscribe(sim)
    await sub.sync(http, sim.url)
    await chat(http, sim, "Fill the cache with a few blocks before the restart, please.")
    await sub.wait_for(lambda: len(sub.seqs) >= 1)
    async with http.post(sim.url + "/sim/restart") as resp:
        assert resp.status == 200
    await sub.wait_for(lambda: sub.seqs[-1] == 0)
    assert isinstance(sub.events[-1], AllBlocksCleared)
    assert sim.engine.cache.cached_blocks == 0
    assert await replay(sim.replay_endpoint or "", 0) == [0]


def test_decoded_batches_round_trip_the_encoder() -> None:
    from cortex.hashing import Engine
    from cortex.sim.cache import BlocksRemoved, BlocksStored, CacheCleared
    from cortex.sim.publisher import EventEncoder

    for engine, version in [(Engine.SGLANG, "0.5.23"), (Engine.VLLM, "0.33.0"),
                            (Engine.VLLM, "0.9.0")]:
        encoder = EventEncoder(engine, version)
        payload = encoder.encode([BlocksStored((1, 2), None, (1,) * 8, 4), BlocksRemoved((2,)),
                                  CacheCleared()], ts=5.0)
        batch = decode_batch(payload, engine)
        stored, removed, cleared = batch.events
        assert isinstance(stored, BlockStored) and stored.block_hashes == (1, 2)
        assert isinstance(removed, BlockRemoved) and isinstance(cleared, AllBlocksCleared)
        assert batch.ts == 5.0
