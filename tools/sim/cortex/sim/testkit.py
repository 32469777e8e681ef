"""Helpers for tests and tools that drive sims: a KV-event subscriber and an event mirror.

Used by this package's tests and reusable by other areas' integration tests.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import aiohttp
import zmq
import zmq.asyncio

from cortex.hashing import Engine
from cortex.kvevents.codec import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    decode_batch,
)
from cortex.kvevents.frames import parse_pub

if TYPE_CHECKING:
    from cortex.sim.server import SimServer

__all__ = ["EventSubscriber", "StartSim", "chat_body", "mirror"]

StartSim = Callable[..., Awaitable["SimServer"]]
"""The ``start_sim`` fixture: keyword overrides of :class:`SimConfig` -> a running sim."""


@dataclass
class EventSubscriber:
    """A SUB on a sim's event endpoint; ``batches`` are (seq, decoded batch) in arrival order."""

    engine: Engine
    sock: zmq.asyncio.Socket
    batches: list[tuple[int, EventBatch]] = field(default_factory=list)

    async def receive(self, timeout: float = 0.05) -> bool:
        """Receive what is pending (up to ``timeout`` s for the first); True if anything came."""
        got = False
        while True:
            try:
                frames = await asyncio.wait_for(self.sock.recv_multipart(), timeout)
            except TimeoutError:
                return got
            message = parse_pub(frames)
            self.batches.append((message.seq, decode_batch(message.payload, self.engine)))
            got = True
            timeout = 0.005

    async def sync(self, session: aiohttp.ClientSession, base_url: str) -> None:
        """Beat ZMQ's slow joiner: flush the (idle) cache until a batch arrives, then forget."""
        path = "/flush_cache" if self.engine is Engine.SGLANG else "/reset_prefix_cache"
        for _ in range(200):
            async with session.post(base_url + path) as resp:
                assert resp.status == 200
            if await self.receive(0.05):
                self.batches.clear()
                return
        raise TimeoutError("no KV event batch reached the subscriber")

    async def wait_for(self, predicate: Callable[[], bool], timeout: float = 10.0) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not predicate():
            if loop.time() > deadline:
                raise TimeoutError(f"events never satisfied the condition: {self.batches}")
            await self.receive(0.05)

    @property
    def events(self) -> list[BlockStored | BlockRemoved | AllBlocksCleared]:
        return [event for _, batch in self.batches for event in batch.events]

    @property
    def seqs(self) -> list[int]:
        return [seq for seq, _ in self.batches]



    @classmethod
    def connect(cls, ctx: zmq.asyncio.Context, endpoint: str, engine: Engine | str,
                topic: bytes = b"") -> EventSubscriber:
        """A SUB connected to ``endpoint`` (close it with :meth:`close`)."""
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, topic)
        sock.connect(endpoint)
        return cls(Engine(engine), sock)

    def close(self) -> None:
        self.sock.close(linger=0)


def mirror(events: list[BlockStored | BlockRemoved | AllBlocksCleared], block_size: int
           ) -> dict[int, tuple[int | None, tuple[int, ...]]]:
    """Replay decoded events into ``hash -> (parent hash, tokens)``: what a router learns."""
    blocks: dict[int, tuple[int | None, tuple[int, ...]]] = {}
    for event in events:
        if isinstance(event, AllBlocksCleared):
            blocks.clear()
        elif isinstance(event, BlockRemoved):
            for block_hash in event.block_hashes:
                blocks.pop(int(block_hash), None)
        else:
            parent = event.parent_block_hash
            for i, block_hash in enumerate(event.block_hashes):
                tokens = event.token_ids[i * block_size : (i + 1) * block_size]
                blocks[int(block_hash)] = (None if parent is None else int(parent), tokens)
                parent = block_hash
    return blocks


def chat_body(text: str, **extra: Any) -> dict[str, Any]:
    """A one-message chat request body."""
    return {"model": "cortex-sim", "messages": [{"role": "user", "content": text}], **extra}
