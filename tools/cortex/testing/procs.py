"""Free ports, bounded waits and a private ``redis-server``."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import TracebackType

__all__ = ["RedisServer", "die_with", "free_port", "wait_until", "wait_until_async"]

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


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (bind to port 0, read, release)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


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
