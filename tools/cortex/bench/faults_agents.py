"""Misbehaving peers for ``cortex bench faults``, run on the bench's event loop.

- :class:`StallProxy`: a TCP relay in front of a worker. Transparent until :meth:`stall`;
  then every response that starts afterwards is relayed up to its first SSE event (the
  first ``\\n\\n`` after the headers) and then held: the connection stays open, nothing more
  arrives — a stream that stalls mid-way (the sim can only *cut* a stream).
- :class:`GarbageSource`: a KV-event publisher whose replay endpoint accepts requests and
  never answers (a replay held open) while it sends undecodable 1 MiB batches, and one
  message over the ingest's size limit.
- :class:`SlowBodyClients`: connections that send a request's headers and then its body at
  one byte per second.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import zmq
import zmq.asyncio

from cortex.kvevents.frames import pub_frames

__all__ = ["GarbageSource", "SlowBodyClients", "StallProxy"]

_HEADERS_END = b"\r\n\r\n"
_EVENT_END = b"\n\n"


class StallProxy:
    """``await proxy.start()`` listens on 127.0.0.1 (``proxy.port``), relaying to
    ``upstream`` (``host:port``)."""

    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.port = 0
        self.stalling = False
        self.stalled = 0  # responses held
        self._server: asyncio.Server | None = None
        self._held: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    def __repr__(self) -> str:
        return (f"StallProxy(:{self.port} -> {self.upstream[0]}:{self.upstream[1]}, "
                f"stalling={self.stalling}, stalled={self.stalled})")

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    def stall(self) -> None:
        self.stalling = True

    async def release(self) -> None:
        """Relay normally again; held connections are closed (their clients see a cut)."""
        self.stalling = False
        for writer in list(self._held):
            writer.close()
        self._held.clear()

    async def close(self) -> None:
        await self.release()
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            writer.close()
            return
        up = asyncio.create_task(self._pipe(reader, up_writer, responses=False))
        down = asyncio.create_task(self._pipe(up_reader, writer, responses=True))
        self._tasks.update((up, down))
        try:
            await asyncio.wait((up, down), return_when=asyncio.FIRST_COMPLETED)
        finally:
            if writer in self._held:  # stalled: keep the client waiting, drop the upstream
                up.cancel()
                down.cancel()
            up_writer.close()
            for task in (up, down):
                self._tasks.discard(task)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *,
                    responses: bool) -> None:
        seen = b""  # response bytes relayed since the stall began (to find the cut point)
        try:
            while data := await reader.read(65536):
                if responses and self.stalling:
                    before = len(seen)
                    seen += data
                    head = seen.find(_HEADERS_END)
                    cut = seen.find(_EVENT_END, head + 4) if head >= 0 else -1
                    if cut >= 0:  # relay up to the end of the first event, then hold
                        writer.write(seen[before:cut + 2])
                        await writer.drain()
                        self.stalled += 1
                        self._held.add(writer)
                        return
                    seen = seen[-65536:] if head < 0 else seen
                writer.write(data)
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            if writer not in self._held:
                writer.close()


class GarbageSource:
    """A publisher bound on 127.0.0.1 (``endpoint``) with a replay ROUTER that never
    answers (``replay_endpoint``)."""

    def __init__(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._router = self._ctx.socket(zmq.ROUTER)
        for sock in (self._pub, self._router):
            sock.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, 1000)
        self.endpoint = f"tcp://127.0.0.1:{self._pub.bind_to_random_port('tcp://127.0.0.1')}"
        port = self._router.bind_to_random_port("tcp://127.0.0.1")
        self.replay_endpoint = f"tcp://127.0.0.1:{port}"
        self.seq = 0
        self.sent_bytes = 0

    def __repr__(self) -> str:
        return f"GarbageSource({self.endpoint}, seq={self.seq}, sent={self.sent_bytes} B)"

    def send(self, payload: bytes) -> None:
        with contextlib.suppress(zmq.Again):
            self._pub.send_multipart(pub_frames(b"", self.seq, payload), flags=zmq.NOBLOCK)
            self.sent_bytes += len(payload)
        self.seq += 1

    async def flood(self, seconds: float, rate: float, size: int) -> None:
        """Undecodable ``size``-byte batches at ``rate`` per second for ``seconds``."""
        junk = b"\xc1" * size  # 0xc1 is never valid msgpack
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self.send(junk)
            await asyncio.sleep(1 / rate)

    def close(self) -> None:
        self._pub.close(linger=0)
        self._router.close(linger=0)
        self._ctx.term()


class SlowBodyClients:
    """``count`` connections to ``host:port`` sending a POST body at 1 byte per second."""

    def __init__(self, host: str, port: int, count: int) -> None:
        self.address = (host, port)
        self.count = count
        self.opened = 0
        self.closed_by_server = 0
        self.first_closed_after_s: float | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._started = 0.0

    @property
    def open(self) -> int:
        return self.opened - self.closed_by_server

    def start(self) -> None:
        self._started = time.monotonic()
        self._tasks = [asyncio.create_task(self._client()) for _ in range(self.count)]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _client(self) -> None:
        try:
            reader, writer = await asyncio.open_connection(*self.address)
        except OSError:
            return
        self.opened += 1
        try:
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\n"
                         b"Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n")
            while True:
                writer.write(b" ")
                await writer.drain()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(1.0):
                        if not await reader.read(65536):  # the server closed it
                            raise ConnectionResetError
        except (ConnectionError, OSError):
            self.closed_by_server += 1
            if self.first_closed_after_s is None:
                self.first_closed_after_s = time.monotonic() - self._started
        finally:
            writer.close()
