"""KV events on the wire: a ZMQ PUB of per-step batches and a replay ROUTER, like the engines.

The sync half (:class:`EventEncoder`) turns cache events into the engine version's payload
bytes. The async half (:class:`EventPublisher`) numbers batches (seq from 0), keeps the last
``buffer_steps`` of them for replay, applies the armed faults (drop / duplicate / reorder)
and answers DEALER replay requests exactly as the engine does. ``track_subscribers`` binds
an XPUB instead of a PUB, so a test can wait until its subscriber joined before it sends
(ZMQ's slow joiner); the engines' PUB sockets behave the same on the wire.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Sequence
from typing import Self

import zmq
import zmq.asyncio

from cortex.hashing import BlockMedia, Engine
from cortex.kvevents import codec, frames
from cortex.sim.cache import BlocksRemoved, BlocksStored, CacheEvent
from cortex.sim.faults import BatchFate, FaultState
from cortex.sim.sockets import bind_tcp

__all__ = ["EventEncoder", "EventPublisher"]

log = logging.getLogger(__name__)

_HWM = 100_000  # the engines' default PUB high-water mark


def _version(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


class EventEncoder:
    """Cache events → one batch payload in ``engine``/``version``'s byte format (pure)."""

    def __init__(self, engine: Engine, version: str, dp_rank: int = 0) -> None:
        self.engine = engine
        self.version = version
        v = _version(version)
        if engine is Engine.VLLM:
            self._medium = "GPU" if v >= (0, 11) else None
            # per-block extra_keys, explicit group_idx, spec kind: seen from a real 0.32
            self._rich = v >= (0, 32)
            self._group_nil = (0, 23) <= v < (0, 32)
            self._dp_rank: int | None = dp_rank if v >= (0, 11) else None
            self._names_lora = True
        else:
            self._medium = "GPU" if v >= (0, 5, 9) else None
            self._rich = False
            self._group_nil = False
            self._dp_rank = dp_rank
            # 0.5.23 names the adapter (and namespaces its hashes); 0.5.22 sent neither
            self._names_lora = v >= (0, 5, 23)
        self._host_medium = "CPU" if engine is Engine.VLLM else "CPU_PINNED"
        # Fail at start-up, not on the first batch, when the version has no encoder.
        codec.encode_batch(codec.EventBatch(ts=0.0, events=()), engine, version)

    def convert(self, event: CacheEvent) -> codec.Event:
        if isinstance(event, BlocksStored) and event.tier == "host":
            return self._host_store(event)
        if isinstance(event, BlocksStored):
            lora = event.lora_name if self._names_lora else None
            # EAGLE: vLLM sends lookahead_token_ids; SGLang sends its pages as bigram pairs,
            # which the codec writes from the same per-block next tokens.
            return codec.BlockStored(
                block_hashes=event.block_hashes,
                parent_block_hash=event.parent_block_hash,
                token_ids=event.token_ids,
                block_size=event.block_size,
                medium=self._medium,
                lora_name=lora,
                extra_keys=self._extra_keys(len(event.block_hashes), lora, event.media),
                kv_cache_spec_kind="full_attention" if self._rich else None,
                lookahead_token_ids=event.lookahead_token_ids,
                bigram=event.lookahead_token_ids is not None and self.engine is Engine.SGLANG,
                group_idx_nil=self._group_nil,
            )
        if isinstance(event, BlocksRemoved):
            medium = self._host_medium if event.tier == "host" else self._medium
            return codec.BlockRemoved(block_hashes=event.block_hashes, medium=medium,
                                      group_idx_nil=self._group_nil)
        return codec.AllBlocksCleared()

    def _extra_keys(self, blocks: int, lora: str | None,
                    media: tuple[BlockMedia, ...] | None = None) -> tuple[object, ...] | None:
        """vLLM's (0.32 on) per-block extra keys: the adapter's name in each (its block hashes
        cover it: ``v1/core/kv_cache_utils.py::generate_block_hash_extra_keys``), then the
        block's media pairs ``(identifier, offset)`` (``to_event_extra_keys``)."""
        if self.engine is not Engine.VLLM or not self._rich:
            return None
        head: tuple[object, ...] = (lora,) if lora is not None else ()
        pairs = media or ((),) * blocks
        return tuple((*head, *p) if head or p else None for p in pairs)

    def _host_store(self, event: BlocksStored) -> codec.BlockStored:
        """A block offloaded to host memory, as each engine publishes it: vLLM's offloading
        connector a placeholder (``token_ids=[]``, no parent; ``offloading_connector.py::
        take_events``) with medium ``CPU``, SGLang HiCache the block with its tokens and
        medium ``CPU_PINNED``."""
        if self.engine is Engine.VLLM:
            return codec.BlockStored(block_hashes=event.block_hashes, parent_block_hash=None,
                                     token_ids=(), block_size=event.block_size,
                                     medium=self._host_medium, group_idx_nil=self._group_nil)
        return codec.BlockStored(block_hashes=event.block_hashes,
                                 parent_block_hash=event.parent_block_hash,
                                 token_ids=event.token_ids, block_size=event.block_size,
                                 medium=self._host_medium,
                                 lora_name=event.lora_name if self._names_lora else None,
                                 lookahead_token_ids=event.lookahead_token_ids,
                                 bigram=event.lookahead_token_ids is not None)

    def encode(self, events: Sequence[CacheEvent], ts: float | None = None) -> bytes:
        batch = codec.EventBatch(
            ts=time.time() if ts is None else ts,
            events=tuple(self.convert(event) for event in events),
            dp_rank=self._dp_rank,
        )
        return codec.encode_batch(batch, self.engine, self.version)

    def __repr__(self) -> str:
        return f"EventEncoder({self.engine.value} {self.version})"


class EventPublisher:
    """ZMQ PUB (+ optional replay ROUTER) bound on ``host``; port 0 binds any free port.

    Use as ``async with``. ``publish`` is synchronous (ZMQ PUB never blocks: a slow
    subscriber loses messages at the high-water mark, as with the engines).
    """

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        encoder: EventEncoder,
        faults: FaultState,
        *,
        host: str,
        pub_port: int,
        replay_port: int | None,
        topic: str = "",
        buffer_steps: int = 10_000,
        track_subscribers: bool = False,
    ) -> None:
        self._ctx = ctx
        self._encoder = encoder
        self._faults = faults
        self._host = host
        self._want_pub = pub_port
        self._want_replay = replay_port
        self._topic = topic.encode()
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(
            maxlen=buffer_steps)
        self._replay_topic = frames.replay_has_topic(encoder.engine, encoder.version)
        self._pub: zmq.asyncio.Socket | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task[None] | None = None
        self._track_subscribers = track_subscribers
        self._subscriptions_task: asyncio.Task[None] | None = None
        self._subscribed = asyncio.Event()
        self.subscribers = 0
        """Joined subscribers (``track_subscribers`` only)."""
        self._held: tuple[int, bytes] | None = None
        self.next_seq = 0
        self.pub_port = 0
        self.replay_port: int | None = None
        self.sent_batches = 0
        self.sent_events = 0
        self.dropped_batches = 0
        self.replay_requests = 0

    async def __aenter__(self) -> Self:
        try:
            self._pub = self._ctx.socket(zmq.XPUB if self._track_subscribers else zmq.PUB)
            self._pub.setsockopt(zmq.SNDHWM, _HWM)
            self._pub.setsockopt(zmq.LINGER, 0)
            if self._track_subscribers:
                self._pub.setsockopt(zmq.XPUB_VERBOSE, 1)
            self.pub_port = bind_tcp(self._pub, self._host, self._want_pub)
            if self._track_subscribers:
                self._subscriptions_task = asyncio.create_task(self._count_subscriptions(),
                                                               name="sim-subscriptions")
            if self._want_replay is not None:
                self._router = self._ctx.socket(zmq.ROUTER)
                self._router.setsockopt(zmq.LINGER, 0)
                self.replay_port = bind_tcp(self._router, self._host, self._want_replay)
                self._replay_task = asyncio.create_task(self._serve_replay(),
                                                        name="sim-replay")
        except BaseException:
            await self.aclose()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        tasks = [t for t in (self._replay_task, self._subscriptions_task) if t is not None]
        self._replay_task = self._subscriptions_task = None
        for task in tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for sock in (self._pub, self._router):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._router = None

    @property
    def buffered(self) -> int:
        return len(self._buffer)

    def publish(self, events: Sequence[CacheEvent]) -> int | None:
        """Send one batch; returns its seq (``None`` when ``events`` is empty)."""
        if not events:
            return None
        self.sent_events += len(events)
        return self.publish_payload(self._encoder.encode(events))

    def publish_payload(self, payload: bytes) -> int:
        """Number, buffer and send (faults applied) one encoded batch; returns its seq."""
        seq = self.next_seq
        self.next_seq += 1
        self._buffer.append((seq, payload))
        fate = self._faults.next_batch_fate()
        if fate is BatchFate.DROP:
            self.dropped_batches += 1
            log.info("fault: dropped event batch seq=%d", seq)
        elif fate is BatchFate.DUPLICATE:
            self._send(seq, payload)
            self._send(seq, payload)
        elif fate is BatchFate.REORDER and self._held is None:
            self._held = (seq, payload)
            return seq
        else:
            self._send(seq, payload)
        if self._held is not None:
            held, self._held = self._held, None
            self._send(*held)
        return seq

    def send_raw(self, raw: Sequence[bytes]) -> None:
        """Put arbitrary frames on the PUB socket, unnumbered and unbuffered (hostile input)."""
        if self._pub is not None:
            self._pub.send_multipart(list(raw), flags=zmq.NOBLOCK)

    def forget_buffer(self) -> None:
        """Lose the replay buffer, as when ``buffer_steps`` overran a gap."""
        self._buffer.clear()

    async def wait_subscribed(self, count: int = 1, timeout: float = 10.0) -> None:
        """Until ``count`` subscribers joined (``track_subscribers`` only): what is sent
        after this reaches them."""
        if not self._track_subscribers:
            raise RuntimeError("wait_subscribed needs track_subscribers=True")
        async with asyncio.timeout(timeout):
            while self.subscribers < count:
                self._subscribed.clear()
                await self._subscribed.wait()

    async def _count_subscriptions(self) -> None:
        assert self._pub is not None
        pub = self._pub
        while True:
            msg = await pub.recv_multipart()
            kind = msg[0][:1] if msg else b""
            if kind == b"\x01":
                self.subscribers += 1
            elif kind == b"\x00":
                self.subscribers -= 1
            self._subscribed.set()

    def restart(self) -> None:
        """Behave like a freshly started engine: seq from 0, empty replay buffer."""
        self._held = None
        self._buffer.clear()
        self.next_seq = 0

    def _send(self, seq: int, payload: bytes) -> None:
        if self._pub is None:
            return
        try:
            self._pub.send_multipart(frames.pub_frames(self._topic, seq, payload),
                                     flags=zmq.NOBLOCK)
            self.sent_batches += 1
        except zmq.Again:
            self.dropped_batches += 1

    async def _serve_replay(self) -> None:
        assert self._router is not None
        router = self._router
        while True:
            msg = await router.recv_multipart()
            identity, request = msg[0], msg[1:]
            try:
                start = frames.parse_replay_request(request)
            except ValueError as exc:
                log.warning("ignoring malformed replay request: %s", exc)
                continue
            self.replay_requests += 1
            topic = self._topic if self._replay_topic else None
            for seq, payload in list(self._buffer):
                if seq >= start:
                    await router.send_multipart(
                        [identity, *frames.replay_reply_frames(seq, payload, topic)])
            await router.send_multipart([identity, *frames.replay_end_frames(self._replay_topic)])

    def __repr__(self) -> str:
        return (
            f"EventPublisher({self._encoder!r}, pub={self.pub_port}, replay={self.replay_port}, "
            f"next_seq={self.next_seq}, buffered={len(self._buffer)})"
        )
