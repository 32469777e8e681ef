"""``SourceRunner``: the sockets of one ledger source, feeding its :class:`SourceTracker`.

- a SUB connected to the rank's event endpoint (``port + rank``), filtered by topic, read in
  *turns*: each turn first applies what the tracker holds from earlier turns, then reads
  what the socket has (up to ``read_burst`` messages) and decodes it until ``turn_bytes`` of
  payload were processed; the rest is deferred to the tracker's byte-bounded hold buffer,
  so the socket (and the engine's send queue) keeps draining while decoding waits. Every
  source's runner yields to the event loop after each turn, so one flooding source costs
  the others at most one turn of work, not its whole backlog;
- a monitor on that SUB: a connection that comes back after a break asks the tracker to
  verify through replay (the engine may have restarted, batches may be lost);
- during a replay, a DEALER to the rank's replay endpoint, applying replies in turns of
  ``turn_bytes`` too. A replay that goes silent for ``replay_timeout_s`` is abandoned and its
  socket closed, so late replies cannot reach the tracker (each replay has its own socket).

Both sockets refuse messages above ``max_message_bytes`` (ZMQ ``MAXMSGSIZE``: libzmq drops
the connection instead of receiving the message whole; the tracker then sees a gap).

Every tracker call is followed by :meth:`flush`: ledger ops go to ``on_ops``, replay commands
are carried out.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import cast

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from cortex.edge.tasks import stop_tasks
from cortex.ingest.tracker import AbortReplay, SourceTracker, StartReplay
from cortex.kvevents.codec import CodecError
from cortex.kvevents.frames import ReplayEnd, parse_pub, parse_replay_reply, replay_request
from cortex.ledger.model import Op, Tier

__all__ = ["SourceRunner"]

log = logging.getLogger(__name__)

_MONITORED = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED


class SourceRunner:
    """Run with ``await runner.run()`` (until cancelled; sockets closed on the way out)."""

    def __init__(
        self,
        tracker: SourceTracker,
        *,
        ctx: zmq.asyncio.Context,
        events_endpoint: str,
        replay_endpoint: str | None,
        topic: bytes,
        on_ops: Callable[[SourceTracker, list[Op], Tier], None],
        replay_timeout_s: float = 2.0,
        sub_hwm: int = 100_000,
        read_burst: int = 512,
        turn_bytes: int = 64 << 10,
        max_message_bytes: int = 32 << 20,
        observe_lag: Callable[[float], None] | None = None,
        after_turn: Callable[[], None] | None = None,
    ) -> None:
        self.tracker = tracker
        self.source = tracker.source
        self.events_endpoint = events_endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self._ctx = ctx
        self._on_ops = on_ops
        self._replay_timeout_s = replay_timeout_s
        self._sub_hwm = sub_hwm
        self._burst = read_burst
        self._turn_bytes = turn_bytes
        self._max_message_bytes = max_message_bytes
        self._observe_lag = observe_lag
        self._after_turn = after_turn
        self._waiter: asyncio.Future[None] | None = None  # _readable's, while it waits
        self._replay_task: asyncio.Task[None] | None = None  # the current replay
        self._replays: set[asyncio.Task[None]] = set()  # current and aborted, until done
        self.connected = False
        self.connects = 0
        self.disconnects = 0
        self.bad_frames = 0
        self.foreign_topic = 0

    def __repr__(self) -> str:
        return (
            f"SourceRunner({self.source}, events={self.events_endpoint}, "
            f"replay={self.replay_endpoint}, connected={self.connected}, {self.tracker!r})"
        )

    def _log_extra(self) -> dict[str, str]:
        return {"worker": self.source.worker_id, "source": str(self.source)}

    # ---- lifecycle ----

    async def run(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        monitor: zmq.asyncio.Socket | None = None
        try:
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.RCVHWM, self._sub_hwm)
            sub.setsockopt(zmq.MAXMSGSIZE, self._max_message_bytes)
            sub.setsockopt(zmq.SUBSCRIBE, self.topic)
            monitor = sub.get_monitor_socket(_MONITORED)
            sub.connect(self.events_endpoint)
            self.tracker.start()
            self.flush()
            tasks = [
                asyncio.create_task(self._read_live(sub), name=f"live-{self.source}"),
                asyncio.create_task(self._read_monitor(monitor, sub),
                                    name=f"monitor-{self.source}"),
            ]
            try:
                await asyncio.gather(*tasks)
            finally:
                await stop_tasks(tasks)
        finally:
            try:
                self._cancel_replay()
                # the replay sockets must be closed before the context can terminate
                await stop_tasks(list(self._replays))
            finally:  # also when cancelled again meanwhile
                if monitor is not None:
                    with contextlib.suppress(zmq.ZMQError):
                        sub.disable_monitor()
                    monitor.close(linger=0)
                sub.close(linger=0)

    def flush(self) -> None:
        """Hand the tracker's new ops on and carry out its commands."""
        tracker = self.tracker
        ops = tracker.take_ops()
        if ops:
            self._on_ops(tracker, ops, Tier.DEVICE)
        for tier, tier_ops in tracker.take_tier_ops().items():
            self._on_ops(tracker, tier_ops, tier)
        if tracker.backlog:
            self._wake()
        for command in tracker.take_commands():
            if type(command) is AbortReplay:
                self._cancel_replay()
            elif type(command) is StartReplay:
                self._cancel_replay()
                task = asyncio.create_task(
                    self._replay(command.start_seq), name=f"replay-{self.source}"
                )
                self._replay_task = task
                self._replays.add(task)
                task.add_done_callback(self._replays.discard)

    def _cancel_replay(self) -> None:
        task, self._replay_task = self._replay_task, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()

    # ---- live stream ----

    async def _read_live(self, sub: zmq.asyncio.Socket) -> None:
        raw: zmq.Socket[bytes] = zmq.Socket.shadow(sub.underlying)
        loop = asyncio.get_running_loop()
        fd = raw.FD
        loop.add_reader(fd, self._wake)
        try:
            await self._read_loop(raw)
        finally:
            loop.remove_reader(fd)

    async def _read_loop(self, raw: zmq.Socket[bytes]) -> None:
        tracker = self.tracker
        topic = self.topic
        burst = self._burst
        turn = self._turn_bytes
        again = zmq.Again
        while True:
            if not tracker.backlog:
                await self._readable(raw)
            budget = turn - tracker.drain(turn)  # batches held from earlier turns go first
            for _ in range(burst):
                try:
                    frames = raw.recv_multipart(zmq.NOBLOCK)
                except again:
                    break
                try:
                    message = parse_pub(frames)
                except CodecError:
                    self.bad_frames += 1
                    continue
                if topic and not message.topic.startswith(topic):
                    self.foreign_topic += 1
                    continue
                tracker.on_message(message.seq, message.payload, defer=budget <= 0)
                budget -= len(message.payload)
            self._end_turn()
            await asyncio.sleep(0)  # let the forwarders and other sources run

    async def _readable(self, raw: zmq.Socket[bytes]) -> None:
        """Until the SUB has a message or the tracker holds batches to apply (a replay that
        just ended leaves them).

        The SUB's file descriptor is watched by the event loop itself (``add_reader`` in
        :meth:`_read_live`, once per connection): ``zmq.asyncio``'s ``poll()`` built a poller,
        a future and a task per wake-up, a third of what a message cost the ingest at
        ordinary rates. ZMQ signals that descriptor edge-triggered: reading ``EVENTS`` here
        before waiting resets it, so a message arriving after this check wakes the loop."""
        if self.tracker.backlog or cast(int, raw.get(zmq.EVENTS)) & zmq.POLLIN:
            return
        waiter = self._waiter = asyncio.get_running_loop().create_future()
        try:
            await waiter
        finally:
            self._waiter = None

    def _wake(self) -> None:
        """The SUB may be readable, or the tracker holds batches: :meth:`_readable` returns."""
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _end_turn(self) -> None:
        self.flush()
        tracker = self.tracker
        if self._observe_lag is not None and tracker.stats.last_batch_ts is not None:
            self._observe_lag(time.time() - tracker.stats.last_batch_ts)
        if self._after_turn is not None:
            self._after_turn()

    async def _read_monitor(self, monitor: zmq.asyncio.Socket, sub: zmq.asyncio.Socket) -> None:
        was_connected = False
        while True:
            frames = await monitor.recv_multipart()
            try:
                event = parse_monitor_message(frames)["event"]
            except RuntimeError:
                continue
            if event == zmq.EVENT_CONNECTED:
                self.connected = True
                self.connects += 1
                if was_connected:
                    log.info("events reconnected source=%s endpoint=%s", self.source,
                             self.events_endpoint, extra=self._log_extra())
                was_connected = True
                self.tracker.on_connected()
                self.flush()
            elif event == zmq.EVENT_DISCONNECTED:
                self.connected = False
                self.disconnects += 1
                log.info("events disconnected source=%s endpoint=%s", self.source,
                         self.events_endpoint, extra=self._log_extra())
                # libzmq reconnects after a connection error, but not after a protocol
                # error such as a message over MAXMSGSIZE: dial again ourselves, always.
                with contextlib.suppress(zmq.ZMQError):
                    sub.disconnect(self.events_endpoint)
                sub.connect(self.events_endpoint)

    # ---- replay ----

    async def _replay(self, start_seq: int) -> None:
        if self.replay_endpoint is None:  # the tracker only asks when one is configured
            self.tracker.on_replay_timeout()
            self.flush()
            return
        me = asyncio.current_task()
        dealer = self._ctx.socket(zmq.DEALER)
        try:
            dealer.setsockopt(zmq.LINGER, 0)
            # A replay answers with up to the engine's whole buffer (10,000 batches by
            # default) at once; the engine's ROUTER drops what does not fit the pipe.
            dealer.setsockopt(zmq.RCVHWM, max(self._sub_hwm, 100_000))
            dealer.setsockopt(zmq.MAXMSGSIZE, self._max_message_bytes)
            dealer.connect(self.replay_endpoint)
            await dealer.send_multipart(replay_request(start_seq))
            tracker = self.tracker
            budget = self._turn_bytes
            while self._replay_task is me:
                try:
                    async with asyncio.timeout(self._replay_timeout_s):
                        frames = await dealer.recv_multipart()
                except TimeoutError:
                    log.warning("replay from seq %d timed out source=%s endpoint=%s",
                                start_seq, self.source, self.replay_endpoint,
                                extra=self._log_extra())
                    self._replay_task = None
                    tracker.on_replay_timeout()
                    self.flush()
                    return
                try:
                    reply = parse_replay_reply(frames)
                except CodecError:
                    self.bad_frames += 1
                    continue
                if isinstance(reply, ReplayEnd):
                    self._replay_task = None
                    tracker.on_replay_end()
                    self._end_turn()
                    return
                tracker.on_replay_item(reply.seq, reply.payload)
                self.flush()
                budget -= len(reply.payload)
                if budget <= 0:  # a reply already received does not yield: take turns
                    budget = self._turn_bytes
                    self._end_turn()
                    await asyncio.sleep(0)
        finally:
            dealer.close(linger=0)
