"""Free ports, bounded waits and a private ``redis-server``."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from types import TracebackType
from typing import Self

from aiohttp import web

__all__ = ["RedisServer", "die_with", "free_port", "serve_app", "wait_until",
           "wait_until_async"]

_PR_SET_PDEATHSIG = 1


def die_with(parent_pid: int) -> Callable[[], None]:
    """A ``preexec_fn`` that ties a child to its parent: new session, SIGTERM on parent death.

    ``PR_SET_PDEATHSIG`` fires when the *thread* that started the child exits, so start
    children from a thread that lives as long as they should (normally the main thread).
    """

    def setup() -> None:  # runs in the child between fork and exec
        os.setsid()
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os._exit(1)

    return setup


@contextlib.asynccontextmanager
async def serve_app(app: web.Application) -> AsyncIterator[str]:
    """``app`` served on a free port of 127.0.0.1 in this event loop; yields its base URL
    (``http://127.0.0.1:PORT``), stops it on exit (a 0.1 s grace for open handlers)."""
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


_LOWEST_PORT = 10_000
_RECENT = 1_000  # ports handed out lately, not handed out again
_handed_out: collections.deque[int] = collections.deque(maxlen=_RECENT)


def _port_slice() -> range:
    """Ports this process may hand out: those below the kernel's ephemeral range, cut into
    one disjoint slice per pytest-xdist worker, so parallel test files never pick alike."""
    low, _ = _ephemeral_range()
    high = max(low, _LOWEST_PORT + 1)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    if not worker.startswith("gw") or count <= 1:
        return range(_LOWEST_PORT, high)
    index = int(worker[2:]) % count
    width = (high - _LOWEST_PORT) // count
    return range(_LOWEST_PORT + index * width, _LOWEST_PORT + (index + 1) * width)


def free_port(host: str = "127.0.0.1") -> int:
    """A free TCP port for a server this process is about to start.

    Ports from the kernel's ephemeral range (``bind`` to port 0) are not safe to hand on:
    between release and the server's ``bind``, any outgoing connection on the machine may be
    given the port as its source port, and a client that keeps reconnecting to a port whose
    server is down (ZMQ does) can even connect to itself (TCP simultaneous open on 127.0.0.1).
    Ports below that range are handed to no one by the kernel. This picks one at random from
    this process's slice of them (:func:`_port_slice`), none of the last ``_RECENT`` it handed
    out, and checks that it binds."""
    ports = _port_slice()
    rng = random.Random()
    for _ in range(200):
        port = rng.choice(ports)
        if port in _handed_out:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
        _handed_out.append(port)
        return port
    raise OSError(f"no free port among {ports.start}..{ports.stop - 1} after 200 tries")


def wait_until(
    predicate: Callable[[], bool], timeout: float = 10.0, interval: float = 0.01, what: str = ""
) -> None:
    """Poll ``predicate`` until it is true; ``TimeoutError`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what or predicate!r}")
        time.sleep(interval)


async def wait_until_async(
    predicate: Callable[[], bool | Awaitable[bool]],
    timeout: float = 10.0,
    interval: float = 0.01,
    what: str = "",
) -> None:
    """Async twin of :func:`wait_until`; ``predicate`` may be a coroutine function."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if not isinstance(result, bool):
            result = await result
        if result:
            return
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what or predicate!r}")
        await asyncio.sleep(interval)


def stop_process(proc: subprocess.Popen[bytes], grace_s: float) -> None:
    """SIGTERM ``proc``, SIGKILL it if it is still running after ``grace_s`` seconds."""
    proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)


def _port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.2):
            return True
    except OSError:
        return False


class ProgramProcess:
    """A program run as a child for a test or a benchmark, with its own temporary directory
    (``work_dir``: its files and ``<name>.log``), ready once its health URL answers 200.
    Subclasses write their files in :meth:`start` and call :meth:`_launch`."""

    def __init__(self, name: str, grace_s: float = 10.0) -> None:
        self.name = name
        self.grace_s = grace_s
        self._dir = tempfile.TemporaryDirectory(prefix=f"cortex-{name}-")
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def work_dir(self) -> Path:
        return Path(self._dir.name)

    @property
    def log_path(self) -> Path:
        return self.work_dir / f"{self.name}.log"

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self, timeout: float = 30.0) -> None:
        raise NotImplementedError

    def _launch(self, argv: list[str], ready_url: str, timeout: float,
                error: type[Exception] = RuntimeError) -> None:
        """Start ``argv`` (output to :attr:`log_path`; it dies with this process) and wait
        until ``ready_url`` answers 200; ``error`` with the log tail if it exits first."""
        with open(self.log_path, "wb") as log:
            self._proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                          stderr=subprocess.STDOUT,
                                          preexec_fn=die_with(os.getpid()))
        proc = self._proc

        def ready() -> bool:
            if proc.poll() is not None:
                raise error(f"{self.name} exited with {proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(ready_url, timeout=1) as response:
                    return bool(response.status == 200)
            except OSError:
                return False

        wait_until(ready, timeout, interval=0.05, what=f"{self.name} ({ready_url})")

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            stop_process(proc, self.grace_s)

    def __enter__(self) -> Self:
        try:
            self.start()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
        self._dir.cleanup()


class RedisServer:
    """A private, non-persistent ``redis-server`` on a free loopback port.

    Use as a context manager; ``url`` is ready once ``__enter__`` returns.
    ``stop()``/``start()`` let tests simulate an outage on the same port.
    """

    def __init__(self, port: int | None = None, binary: str = "redis-server") -> None:
        path = shutil.which(binary)
        if path is None:
            raise FileNotFoundError(
                f"{binary!r} not found on PATH: install it (Debian: apt-get install redis-server)"
            )
        self.binary = path
        self.host = "127.0.0.1"
        self.port = port or free_port()
        self._dir = tempfile.TemporaryDirectory(prefix="cortex-redis-")
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def start(self, timeout: float = 10.0) -> None:
        log = Path(self._dir.name, "redis.log")
        self._proc = subprocess.Popen(
            [
                self.binary,
                "--port", str(self.port),
                "--bind", self.host,
                "--save", "",
                "--appendonly", "no",
                "--dir", self._dir.name,
                "--logfile", str(log),
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=die_with(os.getpid()),  # no redis-server outlives a killed test run
        )
        proc = self._proc

        def up() -> bool:
            if proc.poll() is not None:
                tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
                raise RuntimeError(f"redis-server exited with {proc.returncode}: {tail}")
            return _port_open(self.host, self.port)

        wait_until(up, timeout, what=f"redis-server on port {self.port}")

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        stop_process(proc, 5)

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
        self._dir.cleanup()

    def __repr__(self) -> str:
        state = "running" if self._proc is not None and self._proc.poll() is None else "stopped"
        return f"RedisServer(port={self.port}, {state})"
